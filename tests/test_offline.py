"""Without network or a Hub token, the commands stop with exit status 2 and one line that says what to do.

The network is made unreachable the same way on every machine: every URL download goes through a proxy at a closed
local port, the Hub endpoint is that port, and the caches are empty folders. The Hub push runs in a process of its
own, with HF_ENDPOINT, HF_HOME and no HF_TOKEN in its environment (huggingface_hub reads them when it is imported).
"""
import os
import socket
import subprocess
import sys
import urllib.request

import pytest
import timm
from PIL import Image
from tiny_models import SMALLEST_MODEL, SMALLEST_SWIN

import lipsformer
from lipsformer.evaluation.validate_command import main as validate_main
from lipsformer.training.train_command import main as train_main
from lipsformer.weights.model_folder import save_model_folder
from lipsformer.weights.model_names import ModelSourceError
from lipsformer.weights.weight_files import CheckpointError, load_file

pytestmark = pytest.mark.usefixtures('one_thread')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE_ROOT = os.path.dirname(os.path.dirname(lipsformer.__file__))  # the code under test, for the subprocesses
URL = 'https://github.com/cyh1112/LipsFormer/releases/download/checkpoint/lipsformer-swin-tiny.pth'
OFFLINE_WAYS = ("pretrained_cfg_overlay=dict(file=", 'python -m lipsformer.hub.convert', 'local-dir:FOLDER')


@pytest.fixture()
def closed_port() -> str:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return f'http://127.0.0.1:{s.getsockname()[1]}'


@pytest.fixture()
def no_route_out(closed_port, tmp_path, monkeypatch):
    """URL downloads (torch.hub, which timm uses) through a proxy at a closed port, into an empty cache."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({'http': closed_port, 'https': closed_port}))
    monkeypatch.setattr(urllib.request, '_opener', opener)
    monkeypatch.setenv('TORCH_HOME', str(tmp_path / 'torch'))
    return tmp_path / 'torch'


def _one_line_error(text: str, *words: str) -> str:
    assert 'Traceback' not in text, text[-3000:]
    (line,) = [line for line in text.splitlines() if 'error' in line.lower()]
    for word in words:
        assert word in line, (word, line)
    return line


def _imagenet_val(root) -> str:
    os.makedirs(root / 'n01440764')
    Image.new('RGB', (40, 40)).save(root / 'n01440764' / 'image.png')
    return str(root)


def test_validate_a_tagged_model_offline(no_route_out, tmp_path, capsys):
    """validate.py --model lipsformer_swin_tiny.in1k (README's suggestion) needs the released weights' URL: it fails
    before the model is built."""
    assert validate_main(['--model', 'lipsformer_swin_tiny.in1k', '--data-dir', _imagenet_val(tmp_path / 'val'),
                          '--workers', '0']) == 2
    _one_line_error(capsys.readouterr().err, 'cannot download the weights of lipsformer_swin_tiny.in1k from ' + URL,
                    "timm.create_model('lipsformer_swin_tiny', pretrained=True", *OFFLINE_WAYS)
    assert not os.listdir(no_route_out / 'hub' / 'checkpoints')  # no partial download left


def test_train_with_pretrained_weights_offline(no_route_out, data_dir, tmp_path, caplog):
    assert train_main(['--data-dir', data_dir, '--model', SMALLEST_MODEL, '--pretrained', '--model-kwargs',
                       'embed_dim=16', 'depths=1,1,1,1', 'num_heads=1,1,1,1', 'window_size=4', '--input-size', '1',
                       '32', '32', '-j', '0', '-b', '8', '--output', str(tmp_path / 'run'), 'log.trackers=[]']) == 2
    _one_line_error(caplog.text, f'model.name: cannot download the weights of {SMALLEST_MODEL} from {URL}',
                    *OFFLINE_WAYS, '(exit 2)')


@pytest.mark.slow  # huggingface_hub 1.x and later retry a refused connection for about 20 s
def test_validate_a_hub_model_offline(closed_port, tmp_path):
    env = dict(os.environ, HF_ENDPOINT=closed_port, HF_HOME=str(tmp_path / 'hf'), OMP_NUM_THREADS='1',
               PYTHONPATH=os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get('PYTHONPATH')])))
    env.pop('HF_HUB_OFFLINE', None)
    completed = subprocess.run([sys.executable, os.path.join(REPO, 'validate.py'), '--model',
                                'hf-hub:someone/lipsformer-tiny', '--data-dir', _imagenet_val(tmp_path / 'val')],
                               env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert completed.returncode == 2
    _one_line_error(completed.stderr, 'cannot download the weights of hf-hub:someone/lipsformer-tiny from the '
                                      f'Hugging Face Hub repository someone/lipsformer-tiny at {closed_port}',
                    *OFFLINE_WAYS)


PUSH_TWICE = '''
import os, sys
from lipsformer.hub.__main__ import main
first = main(['push', sys.argv[1], 'me/lipsformer-tiny', '--no-lipschitz'])
os.environ['HF_TOKEN'] = 'hf_not_checked_offline'
second = main(['push', sys.argv[1], 'me/lipsformer-tiny', '--no-lipschitz'])
sys.exit(10 * first + second)
'''


def test_push_without_a_token_or_a_network_leaves_the_export_as_it_was(closed_port, tmp_path):
    model = timm.create_model(SMALLEST_MODEL, num_classes=3, **SMALLEST_SWIN)
    export = tmp_path / 'export'
    save_model_folder(model, str(export))
    (export / 'README.md').write_text('my own card\n')
    before = {name: (export / name).read_bytes() for name in os.listdir(export)}
    env = {key: value for key, value in os.environ.items() if key not in ('HF_TOKEN', 'HUGGING_FACE_HUB_TOKEN')}
    env.update(HF_ENDPOINT=closed_port, HF_HOME=str(tmp_path / 'hf'), OMP_NUM_THREADS='1', PYTHONPATH=os.pathsep.join(
        filter(None, [PACKAGE_ROOT, os.environ.get('PYTHONPATH')])))
    completed = subprocess.run([sys.executable, '-c', PUSH_TWICE, str(export)], env=env, cwd=str(tmp_path),
                               capture_output=True, text=True, timeout=300)
    assert completed.returncode == 22, completed.stderr[-3000:]
    assert 'Traceback' not in completed.stderr
    # one line each, naming the command (run by `python -c` here) as the other commands' errors do
    no_token, unreachable = [line for line in completed.stderr.splitlines()
                             if line.startswith('python -m lipsformer.hub: error:')]
    assert 'no Hugging Face token' in no_token and 'the export is unchanged' in no_token
    assert f'cannot reach the Hugging Face Hub at {closed_port}' in unreachable
    assert {name: (export / name).read_bytes() for name in os.listdir(export)} == before


def test_timm_create_model_with_pretrained_weights_offline_says_what_to_do(no_route_out):
    """README's Python API: ``pretrained=True`` without network is the commands' one explained error, not urllib's
    traceback."""
    with pytest.raises(ModelSourceError) as raised:
        timm.create_model(SMALLEST_MODEL, pretrained=True, **SMALLEST_SWIN)
    message = str(raised.value)
    assert message.startswith(f'cannot download the weights of {SMALLEST_MODEL} from {URL}')
    assert all(way in message for way in OFFLINE_WAYS)


def test_a_wrong_or_bad_overlay_file_is_explained(tmp_path):
    """README's offline way, ``pretrained_cfg_overlay=dict(file=...)``, with a path that is not there (an empty
    FileNotFoundError) or a file that is not weights (torch's advice to unpickle it with weights_only=False)."""
    missing = str(tmp_path / 'lipsformer-swin-tiny.pth')
    with pytest.raises(CheckpointError, match=rf"pretrained_cfg_overlay=dict\(file={missing!r}\): no such file"):
        timm.create_model(SMALLEST_MODEL, pretrained=True, pretrained_cfg_overlay=dict(file=missing), **SMALLEST_SWIN)
    garbage = tmp_path / 'garbage.pth'
    garbage.write_bytes(b'not a checkpoint' * 8)
    with pytest.raises(CheckpointError) as raised:
        timm.create_model(SMALLEST_MODEL, pretrained=True, pretrained_cfg_overlay=dict(file=str(garbage)),
                          **SMALLEST_SWIN)
    assert str(garbage) in str(raised.value) and 'weights_only=False' not in str(raised.value)
    with pytest.raises(CheckpointError) as from_validate:
        load_file(str(garbage))
    assert str(raised.value) == str(from_validate.value)  # the words validate.py and convert give
