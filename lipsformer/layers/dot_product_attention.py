"""Standard scaled dot-product attention (Vaswani et al., 2017), the non-Lipschitz baseline of the ablations.

    Attn(X) = softmax(Q K^T / sqrt(d) + B) V

Dot-product self-attention is not Lipschitz (Kim et al., ICML 2021, Theorem 3.1): with one token at 0 and the others
scaled by s, its Jacobian grows like s^2. It is here so that LipsFormer's SCSA can be swapped for it
(``attn_type='dot'``).
"""

import torch
import torch.nn as nn
from timm.layers import use_fused_attn

from .softmax_attention import softmax_attention

__all__ = ['DotProductAttention']


class DotProductAttention(nn.Module):
    """softmax(q k^T * scale + bias) v on (batch, heads, tokens, head_dim) tensors."""

    fused_attn: torch.jit.Final[bool]

    def __init__(self, head_dim: int, attn_drop: float = 0.0) -> None:
        super().__init__()
        self.fused_attn = use_fused_attn()
        self.scale = head_dim ** -0.5
        self.attn_drop = nn.Dropout(attn_drop)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        dropout_p = self.attn_drop.p if self.training else 0.0
        return softmax_attention(q, k, v, attn_bias, dropout_p, self.fused_attn, self.scale)
