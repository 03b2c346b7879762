"""The softmax attention every kernel ends with, after its own treatment of q, k and v:

    Attn(q, k, v) = softmax(s q k^T + B) v

on (batch, heads, tokens, head_dim) tensors, with B an additive bias (a relative-position bias, a key mask) and
dropout on the probabilities. PyTorch's fused ``scaled_dot_product_attention`` computes it wherever it is faster
than the explicit expression below.
"""

import torch
import torch.nn.functional as F
from timm.models import register_notrace_function

__all__ = ['softmax_attention']


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

    ``fused`` uses PyTorch's SDPA, except on CPU where a backward will run: for windows and stripes (tens to a few
    hundred tokens) its CPU backward is slower than the explicit expression's, and with a bias that needs a gradient
    (a learned relative-position bias) SDPA falls back to an unfused math path slower than the one below.
    """
    cpu_backward = q.device.type == 'cpu' and torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, attn_bias))
    if fused and not cpu_backward:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=dropout_p, scale=scale)
    attn = (q * scale if scale != 1.0 else q) @ k.transpose(-2, -1)
    if attn_bias is not None:
        # In place (the product's backward does not need its output) unless the sum must promote the dtype.
        attn = attn.add_(attn_bias) if attn_bias.dtype == attn.dtype else attn + attn_bias
    attn = attn.softmax(dim=-1)
    if dropout_p > 0.0:
        attn = F.dropout(attn, dropout_p)
    return attn @ v
