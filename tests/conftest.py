"""Fixtures shared by the test modules; shared constants and helpers are plain modules beside this one (tiny_models,
training_support, ...), importable because pyproject sets pytest's pythonpath to tests/."""
import os

import pytest
import torch
from training_support import make_image_folder, single_thread

import lipsformer  # noqa: F401  (registers the models with timm)


@pytest.fixture(scope='session', autouse=True)
def _native_cache(tmp_path_factory):
    """The C kernels are built into a folder of the test session (and its subprocesses), not the user's cache."""
    previous = os.environ.get('LIPSFORMER_CACHE_DIR')
    os.environ['LIPSFORMER_CACHE_DIR'] = str(tmp_path_factory.mktemp('native'))
    yield
    if previous is None:
        del os.environ['LIPSFORMER_CACHE_DIR']
    else:
        os.environ['LIPSFORMER_CACHE_DIR'] = previous


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope='module')
def one_thread():
    """Torch on one thread for a test module: tiny models gain nothing from intra-op threads, and on a shared CPU
    their spin-waits cost up to 30x."""
    with single_thread():
        yield


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    """A small ImageFolder tree (see training_support.make_image_folder)."""
    return make_image_folder(str(tmp_path_factory.mktemp('images')))
