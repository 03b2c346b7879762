"""Attention with LipschitzNorm scores (Dasoulas, Scaman and Virmaux, ICML 2021, section 4, transformer case).

For one head with queries Q, keys K and values V (N x d each):

    Attn(Q, K, V) = softmax(Q K^T / max(u v, u w, v w, c) + B) V,
    u = ||Q||_F,    v = max_j ||k_j||_2,    w = max_j ||v_j||_2

with no 1/sqrt(d). The paper has no floor; ``c`` (``denominator_floor``, default 1e-6) keeps the scores defined when
Q, K and V are all (near) zero. It is only active when all three products are below c, where it makes the scores
smaller, so the ratios the paper's proof relies on (u v / M, u w / M, v w / M <= 1) still hold.

Lipschitz constant (Corollary 2), as a map of (Q, K, V) in the Frobenius norm, with m queries and n keys:

    Lip_F <= e^sqrt(3) sqrt(m / n) + 2 sqrt(6)        (= 10.55 for self-attention, m = n)

and for multi-head attention with W_h the joint projection x -> (q, k, v) of head h and output projection W_O,

    Lip_2(MHA) <= 10.55 ||W_O||_2 sqrt(sum_h ||W_h||_2^2)        (the paper rounds 10.55 up to 11).

The corollary has no positional term: with an additive bias (Swin's relative-position bias) the bound is not proven;
a -inf key mask (padded stripes) only removes keys.

The normalisation is a per-(batch, head) scalar, so the fused path folds it into q and runs
``scaled_dot_product_attention`` with scale 1.
"""

import torch
import torch.nn as nn
from timm.layers import use_fused_attn

from .softmax_attention import softmax_attention

__all__ = ['LipschitzNormAttention']


class LipschitzNormAttention(nn.Module):
    """softmax(q k^T / max(u v, u w, v w, c) + bias) v on (batch, heads, tokens, head_dim) tensors."""

    fused_attn: torch.jit.Final[bool]

    def __init__(self, denominator_floor: float = 1e-6, attn_drop: float = 0.0) -> None:
        """
        Args:
            denominator_floor: c, the smallest value of the score denominator.
            attn_drop: Dropout on the attention probabilities.
        """
        super().__init__()
        self.fused_attn = use_fused_attn()
        self.denominator_floor = denominator_floor
        self.attn_drop = nn.Dropout(attn_drop)

    def score_scale(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """1 / max(u v, u w, v w, c) per (batch, head), shaped to broadcast over (tokens, head_dim)."""
        # Norms in float32: a Frobenius norm over a whole window overflows float16.
        u = torch.linalg.vector_norm(q.float(), dim=(-2, -1))
        key_norm = torch.linalg.vector_norm(k.float(), dim=-1).amax(dim=-1)
        value_norm = torch.linalg.vector_norm(v.float(), dim=-1).amax(dim=-1)
        denominator = torch.stack([u * key_norm, u * value_norm, key_norm * value_norm], dim=-1).amax(dim=-1)
        return denominator.clamp_min(self.denominator_floor).reciprocal()[..., None, None].to(q.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        q = q * self.score_scale(q, k, v)
        return softmax_attention(q, k, v, attn_bias, self.attn_drop.p if self.training else 0.0, self.fused_attn)

    def extra_repr(self) -> str:
        return f'denominator_floor={self.denominator_floor}, fused_attn={self.fused_attn}'
