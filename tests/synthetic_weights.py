"""Deterministic synthetic weights for the authors' state-dict layouts.

Full-size authors' checkpoints are too large to commit, so the equivalence fixtures for Swin-T and CSwin-T store
only the authors' key names and shapes plus the logits their code produced with these weights. Every float tensor
is a pure function of its key name, so a test can rebuild the exact state dict without the authors' code.
"""
import math
import zlib

import torch

INPUT_SEED = 0


def synthetic_tensor(key: str, shape: list[int]) -> torch.Tensor:
    """A float32 tensor that depends only on ``key`` and ``shape``, scaled like a trained weight of that kind."""
    generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    name = key.rsplit('.', 1)[-1]
    if 'relative_position_bias_table' in key:
        return 0.5 * noise
    if name == 'scale':  # weighted-residual alpha
        return 0.1 + 0.05 * noise
    if len(shape) >= 2:
        fan_in = math.prod(shape[1:])
        return noise / math.sqrt(fan_in)
    if name == 'weight':  # norm gain
        return 1.0 + 0.1 * noise
    return 0.05 * noise


def synthetic_state_dict(shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Synthetic float tensors for every key in ``shapes`` (integer buffers are left to the model)."""
    return {key: synthetic_tensor(key, shape) for key, shape in shapes.items()}


def synthetic_input(batch_size: int, img_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(INPUT_SEED)
    return torch.randn(batch_size, 3, img_size, img_size, generator=generator)
