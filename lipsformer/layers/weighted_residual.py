"""The weighted residual of LipsFormer (Qi et al., ICLR 2023, section 4.1.3).

    y = x + DropPath(alpha (.) f(x))

with alpha a learnable per-channel vector initialised small (1 / sum(depths) for LipsFormer-Swin, 0.2 for
LipsFormer-CSwin). Its Lipschitz constant is

    Lip(y) <= 1 + max|alpha| * Lip(f)

so a stack of L such blocks with alpha = 1/L is bounded by (1 + kappa / L)^L <= exp(kappa) (Theorem 2). With drop
path each factor is 1 with probability p (Appendix J; timm's DropPath rescales kept paths by 1 / (1 - p)).

Where f ends in a linear layer (attention's output projection, the MLP's fc2), alpha is folded into that layer's
weight and bias (:func:`~lipsformer.layers.lean_autograd.scaled_linear`): the same function, but the per-channel
multiply then costs a (C, C_in) weight product instead of a full (B, L, C) activation product, forward and backward,
and the activation it would keep for alpha's gradient is not stored. Elsewhere (the conv shortcuts, which end in a
GELU) alpha, the drop-path mask and the sum are one multiply-add (:class:`ResidualDropPath`) instead of three passes
over the activations.
"""

import torch
import torch.nn as nn
from timm.layers import DropPath, Mlp

from .lean_autograd import mlp, scaled_linear

__all__ = ['ResidualDropPath', 'ScaleLayer', 'ScaledOutputMlp']


class ScaledOutputMlp(Mlp):
    """timm's Mlp whose output can be scaled per channel by alpha folded into fc2 (same parameters and keys).

    With an exact GELU and nothing between it and fc2 (no dropout in training, no norm), the MLP is
    :func:`~lipsformer.layers.lean_autograd.mlp`, whose backward keeps fc1's input and output but not GELU's.
    """

    gelu_into_fc2: torch.jit.Final[bool]

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gelu_into_fc2 = (isinstance(self.act, nn.GELU) and self.act.approximate == 'none'
                              and isinstance(self.norm, nn.Identity))

    def forward(self, x: torch.Tensor, out_scale: torch.Tensor | None = None) -> torch.Tensor:
        if self.gelu_into_fc2 and (self.drop1.p == 0.0 or not self.training):
            x = mlp(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias, out_scale)
            return self.drop2(x)
        x = self.norm(self.drop1(self.act(self.fc1(x))))
        return self.drop2(scaled_linear(x, self.fc2.weight, self.fc2.bias, out_scale))


class ScaleLayer(nn.Module):
    """Multiply the last (channel) dimension by alpha, a per-channel vector (learnable, or fixed as a buffer)."""

    def __init__(self, dim: int, init_value: float, learnable: bool = True, device=None, dtype=None) -> None:
        """
        Args:
            dim: Number of channels.
            init_value: Initial value of every entry of alpha.
            learnable: Train alpha; if False alpha stays at ``init_value`` (a non-trainable buffer, still saved).
        """
        super().__init__()
        self.init_value = init_value
        gamma = torch.full((dim,), float(init_value), device=device, dtype=dtype)
        if learnable:
            self.gamma = nn.Parameter(gamma)
        else:
            self.register_buffer('gamma', gamma)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.gamma.fill_(self.init_value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma

    def extra_repr(self) -> str:
        return f'{self.gamma.shape[0]}, init_value={self.init_value}, learnable={isinstance(self.gamma, nn.Parameter)}'


class ResidualDropPath(DropPath):
    """timm's DropPath that also adds the residual: ``x + DropPath(scale (.) branch)`` as one fused multiply-add.

    The per-sample keep mask (drawn exactly as timm's ``drop_path`` draws it, so the same seed drops the same samples)
    and the per-channel scale are multiplied into one small (B, 1, ..., C) factor, and ``torch.addcmul`` applies it
    and the sum in one pass over the activations, forward and backward. Called as a module it is plain DropPath.
    """

    def branch_scale(self, branch: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor | None:
        """The factor that ``DropPath(branch * scale)`` multiplies ``branch`` by: ``scale`` (None: 1) times, in
        training, the per-sample keep mask (B, 1, ..., 1) over the keep probability."""
        if self.training and self.drop_prob > 0.0:
            keep_prob = 1.0 - self.drop_prob
            keep = branch.new_empty([branch.shape[0]] + [1] * (branch.dim() - 1)).bernoulli_(keep_prob)
            if keep_prob > 0.0 and self.scale_by_keep:
                keep = keep / keep_prob
            scale = keep if scale is None else keep * scale
        return scale

    def residual(self, x: torch.Tensor, branch: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """``x + DropPath(branch * scale)``; ``scale=None``: no scale."""
        scale = self.branch_scale(branch, scale)
        if scale is None:
            return x + branch
        return torch.addcmul(x, branch, scale)
