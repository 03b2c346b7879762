"""Standard scaled dot-product attention (Vaswani et al., 2017), the non-Lipschitz baseline of the ablations.

    Attn(X) = softmax(Q K^T / sqrt(d) + B) V

Dot-product self-attention is not Lipschitz (Kim et al., ICML 2021, Theorem 3.1): with one token at 0 and the others
scaled by s, its Jacobian grows like s^2. It is here so that LipsFormer's SCSA can be swapped for it
(``attn_type='dot'``).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import use_fused_attn
from timm.models import register_notrace_function

__all__ = ['DotProductAttention', 'softmax_attention']


@register_notrace_function  # picks its kernel from the tensors' device and autograd state at run time
def softmax_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_bias: torch.Tensor | None,
        dropout_p: float,
        fused: bool,
        scale: float = 1.0,
) -> torch.Tensor:
    """softmax(scale q k^T + bias) v, with dropout ``dropout_p`` on the probabilities (pass 0.0 outside training).

    The attention every kernel here ends with, after its own treatment of q, k and v. ``fused`` uses PyTorch's SDPA,
    except on CPU with a bias that needs a gradient (a learned relative-position bias, in training): SDPA then falls
    back to an unfused math path that is slower than the explicit one below.
    """
    cpu_bias_grad = attn_bias is not None and attn_bias.requires_grad and q.device.type == 'cpu'
    if fused and not cpu_bias_grad:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=dropout_p, scale=scale)
    attn = (q * scale if scale != 1.0 else q) @ k.transpose(-2, -1)
    if attn_bias is not None:
        # In place (the product's backward does not need its output) unless the sum must promote the dtype.
        attn = attn.add_(attn_bias) if attn_bias.dtype == attn.dtype else attn + attn_bias
    attn = attn.softmax(dim=-1)
    if dropout_p > 0.0:
        attn = F.dropout(attn, dropout_p)
    return attn @ v


class DotProductAttention(nn.Module):
    """softmax(q k^T * scale + bias) v on (batch, heads, tokens, head_dim) tensors."""

    fused_attn: torch.jit.Final[bool]

    def __init__(self, head_dim: int, attn_drop: float = 0.0) -> None:
        super().__init__()
        self.fused_attn = use_fused_attn()
        self.scale = head_dim ** -0.5
        self.attn_drop = nn.Dropout(attn_drop)

    def forward(
            self,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            attn_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        dropout_p = self.attn_drop.p if self.training else 0.0
        return softmax_attention(q, k, v, attn_bias, dropout_p, self.fused_attn, self.scale)
