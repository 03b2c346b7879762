"""Spectral initialisation (Qi et al., ICLR 2023, section 4.1.4) and the alternative initialisations of the ablations.

    W_si = W / sigma_max(W),    W ~ Xavier-normal

where sigma_max is the largest singular value of the weight reshaped to (out_features, -1) (a depthwise 7x7 conv
becomes a (C, 49) matrix), so every Linear layer is exactly 1-Lipschitz at initialisation (the reshaped convolution
matrix has spectral norm 1 too; the convolution operator itself can be larger, by at most sqrt(kernel area)).
Following the authors' code, Linear biases start at 0, conv biases keep PyTorch's default, norms start at weight 1,
bias 0.
"""
import torch
import torch.nn as nn
from timm.layers import trunc_normal_

from .center_norm import CenterNorm

__all__ = ['WEIGHT_INITS', 'init_weights_', 'spectral_norm', 'spectral_normalize_']

WEIGHT_INITS = ('spectral', 'xavier', 'trunc_normal')


@torch.no_grad()
def spectral_norm(weight: torch.Tensor) -> torch.Tensor:
    """Largest singular value of ``weight`` reshaped to (out, -1), exactly.

    Computed as the square root of the top eigenvalue of the smaller float64 Gram matrix, which equals the SVD's
    sigma_max (to float64 precision) at a fraction of its cost: a full SVD of Swin-L's MLP weights takes seconds each.
    """
    matrix = weight.reshape(weight.shape[0], -1).double()
    if matrix.shape[0] > matrix.shape[1]:
        matrix = matrix.T
    return torch.linalg.eigvalsh(matrix @ matrix.T)[-1].clamp_min(0).sqrt()


@torch.no_grad()
def spectral_normalize_(weight: torch.Tensor) -> torch.Tensor:
    """Divide ``weight`` in place by the largest singular value of its (out, -1) reshape."""
    return weight.div_(spectral_norm(weight).to(weight.dtype))


def init_weights_(module: nn.Module, mode: str = 'spectral') -> None:
    """Initialise one module's own weights (use with ``model.apply`` or timm's ``named_apply``).

    Args:
        module: Any module; Linear, Conv2d and norm layers are initialised, others are left alone.
        mode: ``'spectral'`` (Xavier-normal then divided by sigma_max), ``'xavier'`` (Xavier-normal) or
            ``'trunc_normal'`` (truncated normal, std 0.02, as ViT/Swin).
    """
    if mode not in WEIGHT_INITS:
        raise ValueError(f'unknown weight_init {mode!r}; expected one of {WEIGHT_INITS}')
    if isinstance(module, (nn.Linear, nn.Conv2d)):
        if module.weight.is_meta:
            return  # nothing to initialise in a model built for counting on the meta device
        if mode == 'trunc_normal':
            trunc_normal_(module.weight, std=0.02)
        else:
            nn.init.xavier_normal_(module.weight)
            if mode == 'spectral':
                spectral_normalize_(module.weight)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, (nn.LayerNorm, nn.GroupNorm, CenterNorm)):
        if module.weight is not None and not module.weight.is_meta:
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
