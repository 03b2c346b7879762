"""CenterNorm: LipsFormer's Lipschitz replacement for LayerNorm (Qi et al., ICLR 2023, section 4.1.1).

    CN(x) = gamma * D / (D - 1) * (x - mean(x)) + beta = gamma * D / (D - 1) * (I - 1 1^T / D) x + beta

over the D channels of each token. Centring is the orthogonal projection onto the complement of the all-ones vector,
so with gamma = 1 the Jacobian is D / (D - 1) times a projection at every input:

    Lip_2(CN) = D / (D - 1) * max|gamma|        and, at gamma = 1, Lip_inf(CN) = D / (D - 1) * 2 (D - 1) / D = 2

LayerNorm, by contrast, divides by the standard deviation, and its Jacobian grows like eps^-1/2 near constant inputs.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models import register_notrace_module

__all__ = ['CenterNorm']

# CenterNorm through LayerNorm's fused kernel (faster than the centring expression, forward and backward, on CPU):
# LayerNorm divides the centred x by sqrt(var + eps), and with eps = 2^60 (which any variance below 2^36 leaves
# unchanged in float32 arithmetic) that is exactly 2^30, so a weight scaled by 2^30 gives D / (D - 1) gamma (x - mean)
# + beta. Powers of two multiply without rounding; the variance's share of the gradient is below var / 2^60.
_LAYER_NORM_EPS = 2.0 ** 60
_LAYER_NORM_RSTD_INV = 2.0 ** 30


@register_notrace_module  # a leaf for FX: its forward branches on the input's dtype
class CenterNorm(nn.Module):
    """Centre each token over its last (channel) dimension and rescale by D / (D - 1), with a learnable affine.

    Works on any tensor whose last dimension is the channel dimension (NHWC feature maps or B, L, C tokens).
    """

    def __init__(self, dim: int, eps: float = 0.0, device=None, dtype=None) -> None:
        """
        Args:
            dim: Number of channels D (at least 2).
            eps: Accepted for drop-in compatibility with ``nn.LayerNorm``-style constructors; CenterNorm has no
                variance, so it is unused.
        """
        super().__init__()
        if dim < 2:
            raise ValueError(f'CenterNorm needs at least 2 channels, got dim={dim}')
        self.dim = dim
        self.scale = dim / (dim - 1.0)
        self.layer_norm_eps = _LAYER_NORM_EPS  # attributes rather than globals, for TorchScript
        self.layer_norm_weight_scale = self.scale * _LAYER_NORM_RSTD_INV
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def lipschitz_constant(self) -> float:
        """Exact 2-norm Lipschitz constant, D / (D - 1) * max|gamma|."""
        return self.scale * self.weight.detach().abs().max().item()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Contiguous like LayerNorm's output: elementwise ops keep their input's layout, and an NHWC view of NCHW
        # memory (timm's PatchEmbed output) would otherwise reach the conv shortcuts channels-first, where oneDNN's
        # depthwise convolutions are several times slower on CPU. A no-op for contiguous inputs.
        x = x.contiguous()
        if x.dtype == torch.float16:  # the LayerNorm form's weight (about 1e9) does not fit in float16
            return torch.addcmul(self.bias, x - x.mean(-1, keepdim=True), self.weight * self.scale)
        return F.layer_norm(x, [self.dim], self.weight * self.layer_norm_weight_scale, self.bias,
                            eps=self.layer_norm_eps)

    def extra_repr(self) -> str:
        return f'{self.dim}'
