"""Random number generator states as plain tensors and numbers (loadable with ``weights_only=True``)."""
import random
from typing import Any

import numpy as np
import torch


def capture_rng_state() -> dict[str, Any]:
    """The states of Python's, NumPy's, torch's CPU and (if present) CUDA generators of this process."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        'python': random.getstate(),
        'numpy': {'kind': kind, 'keys': torch.from_numpy(keys.astype(np.int64)), 'position': int(position),
                  'has_gauss': int(has_gauss), 'cached_gaussian': float(cached_gaussian)},
        'torch': torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` returned."""
    version, internal, gauss_next = state['python']
    random.setstate((version, tuple(internal), gauss_next))
    numpy_state = state['numpy']
    np.random.set_state((numpy_state['kind'], numpy_state['keys'].numpy().astype(np.uint32),
                         numpy_state['position'], numpy_state['has_gauss'], numpy_state['cached_gaussian']))
    torch.set_rng_state(state['torch'])
    if 'cuda' in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state['cuda'])
