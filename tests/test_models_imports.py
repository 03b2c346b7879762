"""The models stand on torch, timm and the fast path alone: importing them (or the package, which registers them)
and building one imports no training, evaluation, weights or utils module (pretrained weights, read by the weights
room, import it then); the errors they raise about checkpoints are the ones the rest of the package raises and
catches."""
import ast
import json
import pathlib
import subprocess
import sys

import pytest
import timm
import torch
from timm.models._registry import _model_entrypoints
from tiny_models import TINY_MODELS

import lipsformer.layers
import lipsformer.models
from lipsformer.models import lipsformer_swin
from lipsformer.weights import model_names, pretrained_sources, weight_files

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
    assert model_names.ModelSourceError is pretrained_sources.ModelSourceError
    assert issubclass(pretrained_sources.ModelSourceError, lipsformer.models.CheckpointError)
    assert issubclass(lipsformer.models.CheckpointError, ValueError)


def test_the_models_files_import_torch_timm_and_each_other_alone():
    """Read from the source: no file of the models or the layers imports another room of the package but the fast
    path (whose lift above the models is still to come); the weights are given to the builder by ``import
    lipsformer``, so the models know no file format."""
    imports = set()
    for package in (lipsformer.models, lipsformer.layers):
        for path in sorted(pathlib.Path(package.__file__).parent.glob('*.py')):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 2:
                    rooms = [node.module.split('.')[0]] if node.module else [alias.name for alias in node.names]
                    imports.update((f'{path.parent.name}/{path.name}', room) for room in rooms)
                elif isinstance(node, ast.Import) or isinstance(node, ast.ImportFrom) and node.level == 0:
                    names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                    imports.update((f'{path.parent.name}/{path.name}', name) for name in names
                                   if name.split('.')[0] == 'lipsformer')
    assert ('models/lipsformer_swin.py', 'layers') in imports  # the reading sees the imports there are
    assert {room for _, room in imports} <= {'layers', 'models', 'fastpath'}, sorted(imports)


def test_pretrained_weights_are_read_by_the_weights_room_imported_then():
    modules = _lipsformer_modules_after(
        'import lipsformer, timm',
        'try:',
        "    timm.create_model('lipsformer_swin_tiny', pretrained=True, pretrained_cfg_overlay=dict(file='/no/such'))",
        'except lipsformer.models.CheckpointError as error:',
        "    assert 'no such file' in str(error), error")
    assert 'lipsformer.weights.pretrained_sources' in modules


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
