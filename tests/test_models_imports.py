"""The models stand on torch, timm and the fast path alone: importing them (or the package, which registers them)
and building one imports no training, evaluation, weights or utils module; the errors they raise about checkpoints
are the ones the rest of the package raises and catches."""
import json
import subprocess
import sys

import pytest
import timm
import torch
from timm.models._registry import _model_entrypoints
from tiny_models import TINY_MODELS

import lipsformer.models
from lipsformer.models import lipsformer_swin
from lipsformer.weights import model_names, weight_files

# What the models must not pull in: the commands, and the package's file handling above them.
NOT_FOR_THE_MODELS = ('lipsformer.training', 'lipsformer.evaluation', 'lipsformer.weights', 'lipsformer.hub',
                      'lipsformer.instruments', 'lipsformer.utils')

_IMPORTED_AFTER = '''
import json, sys
{statements}
print(json.dumps(sorted(name for name in sys.modules if name.startswith('lipsformer'))))
'''


def _lipsformer_modules_after(*statements: str) -> list[str]:
    """The lipsformer modules a fresh interpreter holds after running ``statements``."""
    completed = subprocess.run([sys.executable, '-c', _IMPORTED_AFTER.format(statements='\n'.join(statements))],
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _forbidden(modules: list[str]) -> list[str]:
    return [name for name in modules if any(name == part or name.startswith(part + '.')
                                            for part in NOT_FOR_THE_MODELS)]


def test_importing_the_models_imports_none_of_the_package_above_them():
    modules = _lipsformer_modules_after('import lipsformer.models')
    assert 'lipsformer.models.lipsformer_swin' in modules  # the check sees what was imported
    assert _forbidden(modules) == []


def test_importing_the_package_and_building_a_model_imports_none_of_it_either():
    kwargs = dict(TINY_MODELS['lipsformer_swin_tiny'])
    modules = _lipsformer_modules_after(
        'import lipsformer, timm, torch',
        f"with torch.device('meta'): timm.create_model('lipsformer_swin_tiny', pretrained=False, **{kwargs!r})")
    assert _forbidden(modules) == []


def test_the_forbidden_modules_are_found_where_they_are_imported():
    assert _forbidden(_lipsformer_modules_after('import lipsformer.weights.model_names')) != []


def test_timms_registry_holds_the_models_own_entry_points():
    """Nothing wraps timm's registry: the pretrained-weights messages come from the models' builder."""
    assert _model_entrypoints['lipsformer_swin_tiny'] is lipsformer_swin.lipsformer_swin_tiny


def test_the_models_errors_are_the_ones_the_package_catches():
    assert weight_files.CheckpointError is lipsformer.models.CheckpointError
    assert model_names.ModelSourceError is lipsformer.models.ModelSourceError
    assert issubclass(lipsformer.models.ModelSourceError, lipsformer.models.CheckpointError)
    assert issubclass(lipsformer.models.CheckpointError, ValueError)


def test_a_checkpoint_of_other_depths_raises_the_models_error_that_weight_files_catches(tmp_path):
    """The authors' layout (``layers.S.blocks.B``) with one block a stage, loaded into a model with two in stage 2."""
    path = tmp_path / 'other_depths.pth'
    torch.save({'model': {f'layers.{stage}.blocks.0.norm1.weight': torch.ones(16) for stage in range(4)}}, path)
    kwargs = dict(TINY_MODELS['lipsformer_swin_tiny'], depths=(1, 1, 2, 1))
    for caught in (lipsformer.models.CheckpointError, weight_files.CheckpointError):
        with pytest.raises(caught, match=r'checkpoint has depths \(1, 1, 1, 1\) but the model has depths '
                                         r'\(1, 1, 2, 1\)'):
            timm.create_model('lipsformer_swin_tiny', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                              **kwargs)
