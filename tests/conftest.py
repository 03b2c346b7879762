import sys
from pathlib import Path

import pytest
import torch

import lipsformer  # noqa: F401  (registers the models with timm)

sys.path.insert(0, str(Path(__file__).parent))

from training_support import make_image_folder, single_thread  # noqa: E402  (needs the path above)

FIXTURES = Path(__file__).parent / 'fixtures'

# Tiny shapes of each family that keep every code path: two-branch and one-branch CSwin stages, a Swin stage smaller
# than its window, conv shortcuts, post-norms.
TINY_SWIN = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4, img_size=64)
TINY_CSWIN = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(2, 2, 4, 4), split_size=(1, 2, 2, 2), img_size=64)
TINY_MODELS = {'lipsformer_swin_tiny': TINY_SWIN, 'lipsformer_cswin_tiny': TINY_CSWIN}


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
