"""Files that are not checkpoints get lipsformer's own message, wherever a checkpoint is taken: what the file is
(empty, text, unknown bytes, a truncated archive, a pickle that references code), its size and the formats read;
never torch's advice to load it with weights_only=False, and nothing in it is ever run."""
import io
import json
import os
import pickle
import random

import pytest
import timm
import torch
from safetensors.torch import save_file
from tiny_models import SMALLEST_MODEL, SMALLEST_SWIN

from lipsformer.evaluation.checkpoints import create_eval_model, resolve_checkpoint
from lipsformer.hub import create_model
from lipsformer.hub.convert import main as convert_main
from lipsformer.lipschitz.report_command import main as lipschitz_main
from lipsformer.training.session import load_initial_weights
from lipsformer.weights.weight_files import READABLE_FORMATS, CheckpointError, load_file

pytestmark = pytest.mark.usefixtures('one_thread')


class _RunsCode:
    """Unpickling this would call os.system: the payload a malicious checkpoint carries."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f'touch {self.marker}',)


def _weights_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.save(timm.create_model(SMALLEST_MODEL, **SMALLEST_SWIN).state_dict(), buffer)
    return buffer.getvalue()


def _make(kind: str, folder: str) -> tuple[str, str]:
    """A bad file of ``kind`` in ``folder``; returns its path and what the message must say it is."""
    path = os.path.join(folder, f'{kind}.safetensors' if 'safetensors' in kind else f'{kind}.pth')
    marker = os.path.join(folder, 'code-ran')
    if kind == 'random':
        data, said = random.Random(3000).randbytes(3000), 'neither a safetensors file nor a torch.save archive'
    elif kind == 'truncated_zip':
        data, said = _weights_bytes()[:5000], 'truncated or corrupt torch.save archive'
    elif kind == 'text':
        data, said = b'model:\n  name: lipsformer_swin_tiny\n', 'a text file'
    elif kind == 'empty':
        data, said = b'', 'empty (0 bytes)'
    elif kind == 'code_pickle':
        data, said = pickle.dumps({'model': _RunsCode(marker)}), 'references code (posix.system)'
    elif kind == 'code_zip':
        buffer = io.BytesIO()
        torch.save({'model': _RunsCode(marker)}, buffer)
        data, said = buffer.getvalue(), 'references code (posix.system)'
    else:  # truncated_safetensors
        save_file({'w': torch.ones(256)}, path)
        with open(path, 'rb') as f:
            data, said = f.read()[:-100], 'corrupt or truncated safetensors file'
    with open(path, 'wb') as f:
        f.write(data)
    return path, said


KINDS = ['random', 'truncated_zip', 'text', 'empty', 'code_pickle', 'code_zip', 'truncated_safetensors']


def _check_message(message: str, path: str, said: str) -> None:
    assert said in message
    assert 'weights_only' not in message  # neither torch's advice nor its text
    assert f'({os.path.getsize(path):,} bytes)' in message or '(0 bytes)' in message
    if 'references code' not in said:
        assert READABLE_FORMATS in message
    assert not os.path.exists(os.path.join(os.path.dirname(path), 'code-ran'))


@pytest.mark.parametrize('kind', KINDS)
def test_load_file_says_what_the_file_is(kind, tmp_path):
    path, said = _make(kind, str(tmp_path))
    with pytest.raises(CheckpointError) as error:
        load_file(path)
    _check_message(str(error.value), path, said)
    # torch's own error, with its advice, is not chained to ours (a traceback would print it)
    assert error.value.__cause__ is None and (error.value.__context__ is None or error.value.__suppress_context__)


@pytest.mark.parametrize('kind', KINDS)
def test_validate_checkpoint(kind, tmp_path):
    path, said = _make(kind, str(tmp_path))
    with pytest.raises(CheckpointError) as error:
        create_eval_model(SMALLEST_MODEL, resolve_checkpoint(path), model_kwargs=dict(SMALLEST_SWIN))
    _check_message(str(error.value), path, said)


@pytest.mark.parametrize('kind', KINDS)
def test_train_init_checkpoint(kind, tmp_path):
    path, said = _make(kind, str(tmp_path))
    with pytest.raises(CheckpointError) as error:
        load_initial_weights(timm.create_model(SMALLEST_MODEL, **SMALLEST_SWIN), path)
    _check_message(str(error.value), path, said)


@pytest.mark.parametrize('kind', KINDS)
def test_convert_and_lipschitz_commands(kind, tmp_path, capsys):
    path, said = _make(kind, str(tmp_path))
    assert convert_main([path, str(tmp_path / 'out'), '--model', SMALLEST_MODEL]) == 2
    _check_message(capsys.readouterr().err, path, said)
    assert not os.path.exists(tmp_path / 'out')
    kwargs = [f'{k}={list(v) if isinstance(v, tuple) else v}' for k, v in SMALLEST_SWIN.items()]
    assert lipschitz_main(['--model', SMALLEST_MODEL, '--checkpoint', path, '--no-empirical',
                           '--model-kwargs', *kwargs]) == 2
    _check_message(capsys.readouterr().err, path, said)


def test_unknown_bytes_are_not_taken_for_a_pickle(tmp_path):
    """One random file in 200 begins with bytes that parse as a pickle opcode by opcode (a lone STOP, b'.'); read
    as a pickle it would get a message about a corrupt archive. Files beginning with STOP, and 300 more, are unknown
    bytes."""
    path = tmp_path / 'unknown.pth'
    starts = [b'.z\xddq', b'.', b'.N.']
    for data in [s + random.Random(i).randbytes(3000) for i, s in enumerate(starts)] + \
            [random.Random(seed).randbytes(3000) for seed in range(300)]:
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match='neither a safetensors file nor a torch.save archive'):
            load_file(path)


def test_legacy_torch_save_files_still_load(tmp_path):
    path = str(tmp_path / 'legacy.pth')
    torch.save({'w': torch.arange(5.0)}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(load_file(path)['w'], torch.arange(5.0))


@pytest.mark.parametrize('kind', ['code_pickle', 'code_zip', 'truncated_safetensors', 'random'])
def test_local_dir_weights(kind, tmp_path):
    """A model folder whose weights file is bad: the same message through local-dir: names."""
    folder = tmp_path / 'folder'
    folder.mkdir()
    (folder / 'config.json').write_text(json.dumps({'architecture': SMALLEST_MODEL, 'num_classes': 1000,
                                                    'model_args': dict(SMALLEST_SWIN), 'pretrained_cfg': {}}))
    made, said = _make(kind, str(folder))
    path = str(folder / ('model.safetensors' if made.endswith('.safetensors') else 'pytorch_model.bin'))
    os.rename(made, path)
    with pytest.raises(CheckpointError) as error:
        create_model(f'local-dir:{folder}', pretrained=True)
    _check_message(str(error.value), path, said)
    assert error.value.__cause__ is None and error.value.__suppress_context__
