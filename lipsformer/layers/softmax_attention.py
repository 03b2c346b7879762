"""The softmax attention every kernel ends with, after its own treatment of q, k and v:

    Attn(q, k, v) = softmax(s q k^T + B) v

on (..., heads, tokens, head_dim) tensors, with B an additive bias (a relative-position bias, a key mask) and
dropout on the probabilities. PyTorch's fused ``scaled_dot_product_attention`` computes it where timm's fused-attention
switch says so (``timm.layers.use_fused_attn``), except where its kernels cannot serve the call: under ``torch.func``
transforms and forward-mode AD (:func:`transformed`), and on the CPU where a backward will run.
"""

import torch
import torch.nn.functional as F
from timm.models import register_notrace_function
from torch.autograd import forward_ad

__all__ = ['needs_backward', 'softmax_attention', 'transformed']


def needs_backward(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will record an operation on these tensors."""
    return torch.is_grad_enabled() and any(tensor is not None and tensor.requires_grad for tensor in tensors)


def transformed() -> bool:
    """Whether a ``torch.func`` transform (vmap, grad, jvp, jacrev, ...) or forward-mode AD is running (outside
    dynamo, which reads nothing after its ``is_compiling()``). PyTorch has no public test for either; SDPA's fused
    kernels have no forward AD, so the attention must know."""
    return not torch.compiler.is_compiling() and (torch._C._functorch.peek_interpreter_stack() is not None
                                                  or getattr(forward_ad, '_current_level', -1) >= 0)


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

    ``fused`` uses PyTorch's SDPA, except under ``torch.func`` transforms and forward-mode AD, which its fused kernels
    do not support, and on the CPU where a backward will run: for windows and stripes (tens to a few hundred tokens)
    SDPA's CPU backward is slower, and with a bias that needs a gradient (a learned relative-position bias) SDPA falls
    back to an unfused math path slower than the one below; the explicit expression is also twice differentiable
    (gradient penalties, ``torch.autograd.functional.jvp``), which SDPA's fused CPU kernels are not.
    """
    if not torch.jit.is_scripting():  # TorchScript compiles neither test
        if fused and (transformed() or q.device.type == 'cpu' and needs_backward(q, k, v, attn_bias)):
            fused = False
    if fused:
        if q.dim() > 4:
            return _fused_windows_as_heads(q, k, v, attn_bias, dropout_p, scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=dropout_p, scale=scale)
    attn = (q * scale if scale != 1.0 else q) @ k.transpose(-2, -1)
    if attn_bias is not None:
        # In place (the product's backward does not need its output) unless the sum must promote the dtype.
        attn = attn.add_(attn_bias) if attn_bias.dtype == attn.dtype else attn + attn_bias
    attn = attn.softmax(dim=-1)
    if dropout_p > 0.0:
        attn = F.dropout(attn, dropout_p)
    return attn @ v


def _fused_windows_as_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: torch.Tensor | None,
                            dropout_p: float, scale: float) -> torch.Tensor:
    """SDPA on (B, windows, ..., heads, tokens, head_dim) tensors, as the windowed callers pass them to broadcast a
    per-window mask over the batch.

    SDPA's fused CUDA kernels and ONNX's Attention operator take 4-D tensors (the dynamo ONNX exporter refuses 5-D
    ones), so every dimension between the batch and the tokens is folded into the heads' and the bias is expanded to
    match; the batch dimension itself is left alone, so that nothing depends on its size.
    """
    groups = list(q.shape[1:-2])  # lists, not unpacking: TorchScript compiles this function too
    if attn_bias is not None:
        logits = [attn_bias.shape[-2], attn_bias.shape[-1]]
        if attn_bias.dim() == q.dim():  # a leading batch dimension of its own (1 or B)
            attn_bias = attn_bias.expand([attn_bias.shape[0]] + groups + logits).flatten(1, -3)
        else:
            attn_bias = attn_bias.expand(groups + logits).flatten(0, -3).unsqueeze(0)
    out = F.scaled_dot_product_attention(q.flatten(1, -3), k.flatten(1, -3), v.flatten(1, -3), attn_mask=attn_bias,
                                         dropout_p=dropout_p, scale=scale)
    return out.unflatten(1, groups)
