"""Token-wise linear layers on CPU through oneDNN's 1x1 convolution (a fast path: see ``lipsformer.fastpath``).

    y = x W^T + b,    computed as the 1x1 convolution of the (rows, C_in) tokens laid out as a (1, C_in, 1, rows)
                      channels-last map (a view: no copy)

The same products, summed in another order. On CPU, PyTorch computes ``F.linear`` with its BLAS (MKL on x86) and a
channels-last 1x1 convolution with oneDNN's JIT kernels, which are faster for the tall products of a vision
transformer (thousands of tokens, a few hundred channels) on the CPUs measured in docs/performance.md; the backward
goes through oneDNN's convolution backward (input and weight gradients in one call). The choice depends on the
device and dtype only, never on the number of rows (a batch or token count that export keeps dynamic), but for an
empty input (a batch of 0), which oneDNN's convolution refuses: elsewhere (GPU, other dtypes, autocast, no rows) it is
``F.linear`` and a matrix product. Only the blocks' token-wise layers come here;
a classifier head or a pooled batch, a few rows, keeps its module.
"""

import torch
import torch.nn.functional as F

__all__ = ['onednn_linear', 'linear_backward']

_ONEDNN_AVAILABLE = torch.backends.mkldnn.is_available()


def _use_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() > 1 and x.device.type == 'cpu' and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not torch.is_autocast_enabled('cpu') and _ONEDNN_AVAILABLE and x.numel() != 0)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _as_map(rows: torch.Tensor) -> torch.Tensor:
    """(rows, C) contiguous -> (1, C, 1, rows), the same memory as a channels-last map."""
    return rows.unsqueeze(0).unsqueeze(0).permute(0, 3, 1, 2)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over the last dimension of ``x``, on CPU as a 1x1 convolution (module docstring).

    Differentiable either way; autograd keeps x, as ``F.linear`` does.
    """
    if _use_onednn(x, weight):
        out = F.conv2d(_as_map(_rows(x)), weight.unsqueeze(-1).unsqueeze(-1), bias)
        return out.permute(0, 2, 3, 1).reshape(x.shape[:-1] + (weight.shape[0],))
    return F.linear(x, weight, bias)


def linear_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, need_input: bool, need_weight: bool,
                    need_bias: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The gradients of ``linear(x, weight, bias)`` from the output gradient ``grad``: input, weight and bias, each
    None unless asked for; on CPU through oneDNN's convolution backward."""
    if _use_onednn(x, weight) and grad.dtype == torch.float32:
        grad_input, grad_weight, grad_bias = torch.ops.aten.convolution_backward(
            _as_map(_rows(grad)), _as_map(_rows(x)), weight.unsqueeze(-1).unsqueeze(-1),
            [weight.shape[0]] if need_bias else None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
            [need_input, need_weight, need_bias])
        if grad_input is not None:
            grad_input = grad_input.permute(0, 2, 3, 1).reshape(x.shape)
        # oneDNN computes the weight's gradient with the bias's, asked for or not.
        return grad_input, grad_weight.flatten(1) if need_weight else None, grad_bias
    grad_rows = grad.reshape(-1, grad.shape[-1])
    grad_input = (grad @ weight.to(grad.dtype)).to(x.dtype) if need_input else None
    grad_weight = grad_rows.t() @ x.reshape(-1, x.shape[-1]).to(grad.dtype) if need_weight else None
    return grad_input, grad_weight, grad_rows.sum(0) if need_bias else None

