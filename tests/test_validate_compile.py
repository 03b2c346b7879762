"""validate.py ``--torchcompile`` with its scope and mode: a LipsFormer model compiled block by block (regional, the
default) or whole scores as eager, a model without LipsFormer blocks compiles whole, and the results say what ran.

The ``aot_eager`` backend captures the graphs inductor would compile without compiling them, so that the tests take
seconds; inductor's own code is tested by tests/test_train_compile.py.
"""
import json

import pytest
import timm
import torch
from accelerate.state import AcceleratorState
from image_data import make_image_folder
from safetensors.torch import save_file
from timm.models import save_for_hf
from tiny_models import SMALLEST_MODEL, SMALLEST_SWIN

from lipsformer.evaluation.validate_command import main

pytestmark = pytest.mark.usefixtures('one_thread')


def _validate(argv: list[str], tmp_path) -> tuple[int, dict | None]:
    AcceleratorState._reset_state(reset_partial_state=True)  # a fresh state, as a new process would have
    results_file = tmp_path / 'results.json'
    results_file.unlink(missing_ok=True)
    code = main([*argv, '--workers', '0', '--batch-size', '5', '--results-file', str(results_file)])
    return code, json.loads(results_file.read_text()) if code == 0 else None


@pytest.fixture(scope='module')
def lipsformer_folder(tmp_path_factory) -> tuple[str, str]:
    """A tiny LipsFormer export (grayscale, 4 classes) and an image folder of 24 validation images."""
    root = tmp_path_factory.mktemp('validate_compile')
    torch.manual_seed(0)
    model = timm.create_model(SMALLEST_MODEL, **SMALLEST_SWIN, in_chans=1, num_classes=4, drop_path_rate=0.1).eval()
    save_for_hf(model, str(root / 'export'), safe_serialization=True, data_config={'img_size': 32})
    data = make_image_folder(str(root / 'images'))
    return f'local-dir:{root / "export"}', f'{data}/validation'


def test_regional_and_whole_compilation_score_as_eager_and_are_recorded(lipsformer_folder, tmp_path):
    model, images = lipsformer_folder
    args = ['--model', model, '--data-dir', images, '--data-layout', 'imagefolder', '--img-size', '32']
    _, eager = _validate(args, tmp_path)
    assert eager['settings']['torchcompile'] is None and eager['settings']['torchcompile_scope'] is None
    for scope in ('regional', 'whole'):
        torch._dynamo.reset()
        code, compiled = _validate([*args, '--torchcompile', 'aot_eager', '--torchcompile-scope', scope], tmp_path)
        assert code == 0 and compiled['settings']['torchcompile_scope'] == scope
        assert compiled['settings']['torchcompile'] == 'aot_eager' and compiled['settings']['torchcompile_mode'] is None
        for key in ('top1', 'top5', 'count'):
            assert compiled['results'][0][key] == pytest.approx(eager['results'][0][key])


def test_a_model_without_lipsformer_blocks_compiles_whole_and_a_mode_needs_inductor(lipsformer_folder, tmp_path,
                                                                                   capsys):
    _, images = lipsformer_folder
    checkpoint = str(tmp_path / 'vit.safetensors')
    save_file(timm.create_model('test_vit', img_size=32, in_chans=1, num_classes=4).state_dict(), checkpoint)
    args = ['--model', 'test_vit', '--checkpoint', checkpoint, '--img-size', '32', '--in-chans', '1', '--num-classes',
            '4', '--data-dir', images, '--data-layout', 'imagefolder']
    code, record = _validate([*args, '--torchcompile', 'aot_eager'], tmp_path)
    assert code == 0 and record['settings']['torchcompile_scope'] == 'whole'
    code, _ = _validate([*args, '--torchcompile', 'aot_eager', '--torchcompile-mode', 'reduce-overhead'], tmp_path)
    assert code == 2 and 'modes are inductor\'s' in capsys.readouterr().err
