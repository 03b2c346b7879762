import sys
from pathlib import Path

import pytest
import torch

import lipsformer  # noqa: F401  (registers the models with timm)

sys.path.insert(0, str(Path(__file__).parent))

FIXTURES = Path(__file__).parent / 'fixtures'

# Tiny shapes of each family that keep every code path: two-branch and one-branch CSwin stages, a Swin stage smaller
# than its window, conv shortcuts, post-norms.
TINY_SWIN = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4, img_size=64)
TINY_CSWIN = dict(embed_dim=16, depths=(1, 1, 2, 1), num_heads=(2, 2, 4, 4), split_size=(1, 2, 2, 2), img_size=64)
TINY_MODELS = {'lipsformer_swin_tiny': TINY_SWIN, 'lipsformer_cswin_tiny': TINY_CSWIN}


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
