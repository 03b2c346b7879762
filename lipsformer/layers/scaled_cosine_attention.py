"""Scaled cosine similarity attention, SCSA (Qi et al., ICLR 2023, section 4.1.2 and Theorem 1).

    SCSA(X) = nu * softmax(tau * Q_n K_n^T + B) V_n,    q_n = q / max(||q||, eps)  (likewise k, and v if v_norm)

Every logit lies in [-tau, tau], so the softmax is never saturated by the input scale, unlike dot-product attention.
With l2-normalised v (the paper's form) SCSA is Lipschitz: Theorem 1 bounds its Jacobian by a constant in tau, nu,
N, ||W^Q||, ||W^K||, ||W^V|| and 1 / sqrt(eps); each output row has norm <= nu. The authors' released code, which
this module follows by default, keeps v un-normalised (``v_norm=False``, no nu): the logits are still bounded by
tau, and the output is a convex combination of the value rows.

This module holds only the attention maths on (batch, heads, tokens, head_dim) tensors; window and stripe
partitioning, projections and positional terms belong to the caller.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import use_fused_attn

from .softmax_attention import softmax_attention

__all__ = ['ScaledCosineAttention', 'norm_floor']


def norm_floor(eps: float, dtype: torch.dtype) -> float:
    """The floor of the norms for tensors of ``dtype``: ``eps``, or float16's smallest normal number (2^-14) where
    ``eps`` is below it, so that a zero vector (a token of a padded window or stripe) normalises to zero in every
    dtype. A float eps is rounded to the tensor's dtype: the authors' 1e-12 is 0 in float16, where a zero vector
    would normalise to 0 / 0; the other floating dtypes hold it."""
    if dtype == torch.float16:
        return max(eps, 6.103515625e-05)  # a literal: TorchScript reads no global floats
    return eps


class ScaledCosineAttention(nn.Module):
    """softmax(tau * cos(q, k) + bias) v, optionally with l2-normalised v scaled by nu."""

    fused_attn: torch.jit.Final[bool]
    tau_learnable: torch.jit.Final[bool]
    v_norm: torch.jit.Final[bool]

    def __init__(
            self,
            tau: float = 10.0,
            tau_learnable: bool = False,
            v_norm: bool = False,
            nu: float = 1.0,
            eps: float = 1e-12,
            attn_drop: float = 0.0,
            device=None,
            dtype=None,
    ) -> None:
        """
        Args:
            tau: Temperature multiplying the cosine similarities (10 in the authors' Swin, 12 in their CSwin and
                the paper).
            tau_learnable: Learn tau (a scalar parameter initialised at ``tau``).
            v_norm: l2-normalise the values and scale the output by ``nu``, the paper's form.
            nu: Output scale used with ``v_norm``.
            eps: Floor of the norms (``F.normalize``'s eps, as the authors' code), raised to float16's smallest
                normal number for float16 tensors (:func:`norm_floor`).
            attn_drop: Dropout on the attention probabilities.
            device, dtype: Where and in which dtype to create a learned tau.
        """
        super().__init__()
        self.fused_attn = use_fused_attn()
        self.tau_learnable = tau_learnable
        self.v_norm = v_norm
        self.nu = nu
        self.eps = eps
        self.tau_init = float(tau)
        self.tau = (nn.Parameter(torch.tensor(self.tau_init, device=device, dtype=dtype)) if tau_learnable
                    else self.tau_init)
        self.attn_drop = nn.Dropout(attn_drop)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        """(..., heads, tokens, head_dim) q, k, v and an additive bias (a relative-position bias, a -inf/-100 mask)
        broadcastable to the logits -> (..., heads, tokens, head_dim)."""
        # A fixed tau scales the logits inside the attention (SDPA's scale); a learned one scales q, not the
        # (tokens x tokens) logits.
        q, k, v, scale = self.normalize(q, k, v, 1.0 if self.tau_learnable else self.tau_init)
        if self.tau_learnable:
            q = q * self.tau
        x = softmax_attention(q, k, v, attn_bias, self.attn_drop.p if self.training else 0.0, self.fused_attn, scale)
        if self.v_norm:
            x = x * self.nu
        return x

    def normalize(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        """q, k (and v with ``v_norm``) l2-normalised, and the scale of the logits left to apply (``scale``; a fast
        form may fold it into q's normalisation and return 1)."""
        eps = norm_floor(self.eps, q.dtype)
        q = F.normalize(q, dim=-1, eps=eps)
        k = F.normalize(k, dim=-1, eps=eps)
        if self.v_norm:
            v = F.normalize(v, dim=-1, eps=eps)
        return q, k, v, scale

    def extra_repr(self) -> str:
        return (f'tau={self.tau_init}, tau_learnable={self.tau_learnable}, v_norm={self.v_norm}, nu={self.nu}, '
                f'fused_attn={self.fused_attn}')
