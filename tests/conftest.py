"""Fixtures shared by the test modules; shared constants and helpers are plain modules beside this one (tiny_models,
training_support, ...), importable because pyproject sets pytest's pythonpath to tests/."""
import pytest
import torch
from training_support import make_image_folder, single_thread

import lipsformer  # noqa: F401  (registers the models with timm)


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
