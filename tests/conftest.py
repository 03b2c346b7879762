"""Fixtures shared by the test modules. Shared constants and helpers are plain modules beside this one, importable
because pyproject sets pytest's pythonpath to tests/, each for one purpose:

- ``tiny_models``: the tiny model shapes; ``tool_support``: what the tests of PyTorch's and timm's tools share;
- ``image_data``: tiny image-folder and WebDataset trees; ``imagenet_trees``: ImageNet-like trees for evaluation;
- ``training_support``: overrides for seconds-long training runs, checkpoint metadata, resumed-run comparisons;
- ``probe_models``: a model that fails or signals on cue and a counting constraint, registered only on request
  (:func:`probe_model`);
- ``process_support``: one torch thread, subprocess environments, a lock held by another process, a free port;
- ``synthetic_weights`` / ``validate_reference``: weights and timm's own validation, for comparisons.

The suite runs in parallel with pytest-xdist (``python -m pytest -n auto``): a worker a core, at most
:data:`MAX_WORKERS`, each with its share of the cores for torch's threads.
"""
import os
import signal

import pytest
import torch
from accelerate.state import AcceleratorState
from image_data import make_image_folder
from probe_models import register_probe_model
from process_support import single_thread

import lipsformer  # noqa: F401  (registers the models with timm)

# Each worker holds torch, timm and a few models (about 1 GB); most tests spend their time in one thread.
MAX_WORKERS = 8

if os.environ.get('PYTEST_XDIST_WORKER_COUNT'):  # torch's threads shared out among the workers, not each taking all
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ['PYTEST_XDIST_WORKER_COUNT'])))


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker a core, at most :data:`MAX_WORKERS`."""
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))

# A suite started in the background by a shell without job control (`bash script &`, nohup) inherits SIGINT ignored,
# which Python then keeps: a Ctrl-C raises nothing, and every child process inherits the ignoring. The Ctrl-C tests
# test what a terminal's Ctrl-C does, so the suite starts as an interactive Python does (children exec'd from here
# get SIGINT's default, Python's handler in theirs).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope='module')
def one_thread():
    """Torch on one thread for a test module: tiny models gain nothing from intra-op threads, whose spin-waits slow
    every test on a shared CPU."""
    with single_thread():
        yield


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    """A small ImageFolder tree (see image_data.make_image_folder)."""
    return make_image_folder(str(tmp_path_factory.mktemp('images')))


@pytest.fixture(scope='session')
def probe_model():
    """``nan_probe_net`` registered with timm, for the tests that train it (probe_models.NanProbeNet)."""
    return register_probe_model()


@pytest.fixture
def fresh_accelerator():
    """Accelerate's state as a new process has it, before and after the test (a run in another mixed precision
    cannot follow one in a process)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
