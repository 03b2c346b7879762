"""CenterNorm: LipsFormer's Lipschitz replacement for LayerNorm (Qi et al., ICLR 2023, section 4.1.1).

    CN(x) = gamma * D / (D - 1) * (x - mean(x)) + beta = gamma * D / (D - 1) * (I - 1 1^T / D) x + beta

over the D channels of each token. Centring is the orthogonal projection onto the complement of the all-ones vector,
so with gamma = 1 the Jacobian is D / (D - 1) times a projection at every input:

    Lip_2(CN) = D / (D - 1) * max|gamma|        and, at gamma = 1, Lip_inf(CN) = D / (D - 1) * 2 (D - 1) / D = 2

LayerNorm, by contrast, divides by the standard deviation, and its Jacobian grows like eps^-1/2 near constant inputs.
"""
import torch
import torch.nn as nn
from timm.models import register_notrace_module

__all__ = ['CenterNorm']


# A leaf of timm's FX tracer, as torch's own norms are of FX's: a traced model calls it as a module, so that the
# traced graph runs the same code as eager (its fast form included) and gives the same bits.
@register_notrace_module
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
            device, dtype: Where and in which dtype to create the parameters (``device='meta'`` for deferred init).
        """
        super().__init__()
        if dim < 2:
            raise ValueError(f'CenterNorm needs at least 2 channels, got dim={dim}')
        self.dim = dim
        self.scale = dim / (dim - 1.0)
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def lipschitz_constant(self) -> float:
        """Exact 2-norm Lipschitz constant, D / (D - 1) * max|gamma|."""
        return self.scale * self.weight.detach().abs().max().item()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A LipsFormer block computes its norms through LayerNorm's fused kernel in its fast form
        # (lipsformer.fastpath.fused_center_norm).
        return self.weight * self.scale * (x - x.mean(-1, keepdim=True)) + self.bias

    def extra_repr(self) -> str:
        return f'{self.dim}'
