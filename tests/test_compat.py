"""lipsformer.models._compat: each shim behaves the same whether the dependency has the newer API or not."""
import importlib
import sys

import pytest
import timm
import torch
from tiny_models import TINY_MODELS

import lipsformer.models._compat
from lipsformer.models import _base

HAS_INPUT_RECORD = importlib.util.find_spec('timm.models._input') is not None


def tiny_swin() -> torch.nn.Module:
    return timm.create_model('lipsformer_swin_tiny', **TINY_MODELS['lipsformer_swin_tiny'])


@pytest.fixture
def without_timm_input_record(monkeypatch):
    """lipsformer.models._compat imported as under a timm that has no ``timm.models._input``, restored afterwards."""
    monkeypatch.setitem(sys.modules, 'timm.models._input', None)  # makes the import raise ImportError
    fallback = importlib.reload(lipsformer.models._compat).update_model_input_size
    monkeypatch.setattr(_base, 'update_model_input_size', fallback)
    yield fallback
    monkeypatch.undo()
    importlib.reload(lipsformer.models._compat)


@pytest.mark.skipif(not HAS_INPUT_RECORD, reason=f'timm {timm.__version__} has no timm.models._input')
def test_set_input_size_is_recorded_where_timm_keeps_a_record():
    model = tiny_swin()
    model.set_input_size(128)
    assert _base.update_model_input_size.__module__ == 'timm.models._input'
    assert timm.models.get_model_input_config(model)['input_size'] == (3, 128, 128)
    assert timm.models.get_model_args(model)['img_size'] == (128, 128)
    # and in the pretrained cfg, which timm.data.resolve_model_data_config reads
    assert model.pretrained_cfg['input_size'] == (3, 128, 128)


def test_set_input_size_without_timms_record(without_timm_input_record):
    assert without_timm_input_record.__module__ == 'lipsformer.models._compat'
    model = tiny_swin()
    model.set_input_size((96, 128))
    assert model.patch_embed.img_size == (96, 128)
    assert model.pretrained_cfg['input_size'] == (3, 96, 128)
    assert model(torch.randn(1, 3, 96, 128)).shape == (1, 1000)
    with pytest.raises(ValueError, match='multiple of 32'):
        model.set_input_size(120)


def test_compat_is_restored_after_the_fallback_test():
    expected = 'timm.models._input' if HAS_INPUT_RECORD else 'lipsformer.models._compat'
    assert lipsformer.models._compat.update_model_input_size.__module__ == expected
