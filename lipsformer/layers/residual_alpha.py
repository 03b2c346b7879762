"""The weighted residual of LipsFormer (Qi et al., ICLR 2023, section 4.1.3).

    y = x + DropPath(alpha (.) f(x))

with alpha a learnable per-channel vector initialised small (1 / sum(depths) for LipsFormer-Swin, 0.2 for
LipsFormer-CSwin). Its Lipschitz constant is

    Lip(y) <= 1 + max|alpha| * Lip(f)

so a stack of L such blocks with alpha = 1/L is bounded by (1 + kappa / L)^L <= exp(kappa) (Theorem 2). With drop
path each factor is 1 with probability p (Appendix J; timm's DropPath rescales kept paths by 1 / (1 - p)).

In the models, ``x + DropPath(alpha (.) f(x))`` is ``x + drop_path(alpha(f(x)))``: timm's ``DropPath`` and a
:class:`ResidualAlpha`, each called as a module. Their fast path (``lipsformer.fastpath.blocks``) folds alpha into f's
last linear layer where f ends in one (attention's output projection, the MLP's fc2): the same function, but the
per-channel multiply then costs a (C, C_in) weight product instead of a full (B, L, C) activation product, and the
activation it would keep for alpha's gradient is not stored; the drop-path mask and the sum become one multiply-add.
"""

import torch
import torch.nn as nn

__all__ = ['ResidualAlpha']


class ResidualAlpha(nn.Module):
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

