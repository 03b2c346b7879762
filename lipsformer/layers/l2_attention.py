"""L2 multi-head attention with tied query and key weights (Kim, Papamakarios and Mnih, ICML 2021, section 3.2).

Kim et al.'s head h, for tokens X (N x D), W^Q_h = W^K_h (D x D/H) and A_h = W^Q_h W^Q_h^T / sqrt(D/H):

    P_ij ∝ exp(-||x_i^T W^Q_h - x_j^T W^Q_h||^2 / sqrt(D/H)),        head_h(X) = P X A_h W^V_h

Writing Y_h = X W^Q_h (the queries, which are also the keys), the head is P Y_h M_h with
M_h = W^Q_h^T W^V_h / sqrt(D/H), a (D/H x D/H) matrix. This module learns M_h directly (``value_map``): the family of
functions is exactly Kim's, and the mixer needs a single projection (``tied_qkv``: it passes Y_h as q, k and v) in
place of three. M_h starts at the identity, so it has sigma_max = 1 like every spectrally initialised matrix.

Lipschitz constant (Theorem 3.2, with c(N) = W0((N - 1) / e) <= log N, W0 the principal Lambert W): applied to the
head as a map of Y_h (D = D/H, H = 1, W^Q = W^V = W^O = I), then composed with X -> X W^Q_h and Y -> Y M_h,

    Lip_2(head_h) <= sqrt(N) (4 c(N) + 1) ||W^Q_h||_2 ||M_h||_2,
    Lip_2(MHA) <= ||W^O||_2 sqrt(sum_h Lip_2(head_h)^2).

Since sqrt(D/H) M_h = W^Q_h^T W^V_h, this is never larger than the Theorem's own form
sqrt(N) / sqrt(D/H) (4 c(N) + 1) sqrt(sum_h ||W^Q_h||^2 ||W^V_h||^2) ||W^O|| for any W^V_h that gives the same M_h.
The theorem has no positional term: with an additive bias (Swin's relative-position bias) the bound is not proven;
a -inf key mask (padded stripes) only removes tokens and keeps it.

The fused path uses ``scaled_dot_product_attention``: -||q_i - k_j||^2 = 2 q_i.k_j - ||k_j||^2 - ||q_i||^2, and the
last term is constant along each softmax row, so appending a 1 to each query and -||k_j||^2 / 2 to each key gives the
same softmax as a dot product with scale 2 / sqrt(d). Queries and keys are first centred on the keys' mean, which
leaves every distance unchanged and keeps the expansion accurate when tokens are far from the origin.
"""

import torch
import torch.nn as nn
from timm.layers import use_fused_attn

from .softmax_attention import softmax_attention

__all__ = ['L2Attention']


class L2Attention(nn.Module):
    """softmax(-||q_i - k_j||^2 / sqrt(d) + bias) (v M_h) on (batch, heads, tokens, head_dim) tensors.

    In LipsFormer's mixers ``tied_qkv`` makes q, k and v the same projection X W^Q_h, which is Kim et al.'s L2
    multi-head attention; the kernel itself also accepts distinct q, k, v.
    """

    fused_attn: torch.jit.Final[bool]

    def __init__(self, head_dim: int, num_heads: int, attn_drop: float = 0.0, device=None, dtype=None) -> None:
        """
        Args:
            head_dim: d = D/H, the width of each head.
            num_heads: Heads; each has its own value map M_h.
            attn_drop: Dropout on the attention probabilities.
            device, dtype: Where and in which dtype to create the value maps.
        """
        super().__init__()
        self.fused_attn = use_fused_attn()
        self.tied_qkv = True  # read by the mixers: one projection serves as queries, keys and values
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.scale = head_dim ** -0.5
        self.value_map = nn.Parameter(torch.empty(num_heads, head_dim, head_dim, device=device, dtype=dtype))
        self.attn_drop = nn.Dropout(attn_drop)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.value_map.copy_(torch.eye(self.head_dim, device=self.value_map.device).expand(self.num_heads, -1, -1))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: torch.Tensor | None = None
                ) -> torch.Tensor:
        """As every kernel (``create_attention_kernel``); q, k and v are the same tensor X W^Q_h, Kim's tied form."""
        values = v @ self.value_map
        centre = k.mean(dim=-2, keepdim=True)  # distances are translation invariant
        q = q - centre
        k = k - centre
        key_sq = k.pow(2).sum(dim=-1, keepdim=True)
        if self.fused_attn:
            q = torch.cat([q, torch.ones_like(key_sq)], dim=-1)
            k = torch.cat([k, -0.5 * key_sq], dim=-1)
            dropout_p = self.attn_drop.p if self.training else 0.0
            return softmax_attention(q, k, values, attn_bias, dropout_p, True, 2.0 * self.scale)
        query_sq = q.pow(2).sum(dim=-1, keepdim=True)
        attn = (2.0 * q @ k.transpose(-2, -1) - query_sq - key_sq.transpose(-2, -1)) * self.scale
        if attn_bias is not None:
            attn = attn + attn_bias
        return self.attn_drop(attn.softmax(dim=-1)) @ values

    def extra_repr(self) -> str:
        return f'head_dim={self.head_dim}, num_heads={self.num_heads}, fused_attn={self.fused_attn}'
