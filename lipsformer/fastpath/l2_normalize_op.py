"""SCSA's l2 normalisation as one fused reduction a direction: the ``lipsformer::l2_normalize`` custom op (a fast path).

    y = s x / r,  r^2 = max(||x||^2, eps^2) over the last dimension,   returned as (y, r^2)

On a GPU, ``F.normalize(x) * tau`` is a norm, a clamp, a division and a multiply (and their backward about twice as
many kernels) for each of q and k in every block. Here one Triton kernel reads x once and writes y and r^2 (in
float32), and one kernel computes the backward from y, r^2 and the output gradient:

    dL/dx = (s g - <g, y> y / s) / r + 2 (dL/dr^2) r y / s        (both terms only where ||x|| > eps)

It is a ``torch.library`` custom op with a fake-tensor registration and an autograd formula, so that
``torch.compile``, ``torch.export`` and the kernel counter of :mod:`lipsformer.instruments.kernel_count` see one
operation. Where Triton cannot run (no Triton, a CPU tensor outside Triton's interpreter) the op computes the same in
PyTorch; either way its backward keeps the (contiguous) output, which attention keeps anyway, and the (..., 1) squared
norm, not x (q and k are views of the qkv projection, which x would keep whole). A recorded backward
(``create_graph=True``) is written in y and r^2 with differentiable PyTorch operations, so second derivatives are those
of the plain expression, as in :mod:`.lean_autograd`.

``TRITON_INTERPRET=1`` (set before Triton is imported) runs the kernels on CPU tensors, which the tests use.
"""
import functools
import os
from types import SimpleNamespace

import torch

from .lean_autograd import lean_backward

__all__ = ['l2_normalize', 'l2_normalize_op', 'l2_normalize_kernels_run_on']

_MAX_WIDTH = 1024  # the widest rows one program reduces (head dims are 32 to 128)
_TILE = 4096  # elements a program loads: rows of one head are too short to keep a program's threads busy alone
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def l2_normalize_kernels_run_on(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run for ``x``: x is on a GPU (or on the CPU under Triton's interpreter,
    ``TRITON_INTERPRET=1``), in float32, bfloat16 or float16, with rows of at most 1024 elements, and Triton is
    installed."""
    on_triton_device = x.device.type == 'cuda' or x.device.type == 'cpu' and os.environ.get('TRITON_INTERPRET') == '1'
    if x.shape[-1] > _MAX_WIDTH or x.dtype not in _TRITON_DTYPES or not on_triton_device:
        return False
    return _kernels() is not None


@functools.cache
def _kernels() -> SimpleNamespace | None:
    """The Triton kernels, compiled on first use (Triton is imported only then: it is large, and CPU-only processes
    never need it); None without Triton (it ships with torch's CUDA builds on Linux)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def forward(x_ptr, y_ptr, squared_norm_ptr, rows, size1, size2, stride0, stride1, stride2, width, eps_squared,
                scale, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # ROWS rows a program: a head's row is 32 to 128 elements, far too little work for a program of its own
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        # rows of x are indexed by three leading dimensions of any strides (a head's view of a qkv projection)
        i2 = row % size2
        i1 = (row // size2) % size1
        i0 = row // (size2 * size1)
        columns = tl.arange(0, BLOCK)
        in_rows = row < rows
        inside = in_rows[:, None] & (columns < width)[None, :]
        start = i0 * stride0 + i1 * stride1 + i2 * stride2
        x = tl.load(x_ptr + start[:, None] + columns[None, :], mask=inside, other=0.0).to(tl.float32)
        squared_norm = tl.maximum(tl.sum(x * x, axis=1), eps_squared)
        y = x * (tl.rsqrt(squared_norm) * scale)[:, None]
        tl.store(y_ptr + row[:, None] * width + columns[None, :], y.to(y_ptr.dtype.element_ty), mask=inside)
        tl.store(squared_norm_ptr + row, squared_norm, mask=in_rows)

    @triton.jit
    def backward(grad_ptr, y_ptr, squared_norm_ptr, grad_x_ptr, rows, width, eps_squared, scale, ROWS: tl.constexpr,
                 BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        columns = tl.arange(0, BLOCK)
        in_rows = row < rows
        inside = in_rows[:, None] & (columns < width)[None, :]
        offsets = row[:, None] * width + columns[None, :]
        grad = tl.load(grad_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        squared_norm = tl.load(squared_norm_ptr + row, mask=in_rows, other=1.0)
        unclamped = (squared_norm > eps_squared).to(tl.float32)
        radial = tl.sum(grad * y, axis=1) / scale * unclamped
        grad_x = (grad * scale - y * radial[:, None]) * tl.rsqrt(squared_norm)[:, None]
        tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=inside)

    return SimpleNamespace(forward=forward, backward=backward, block=triton.next_power_of_2, cdiv=triton.cdiv)


def _rows_per_program(block: int) -> int:
    """Rows a program normalises: a tile of about :data:`_TILE` elements."""
    return max(_TILE // block, 1)


def _three_leading_dims(x: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]] | None:
    """x (or a copy) with its leading dimensions as three (size, stride) pairs over unit-stride rows, or None where
    they do not merge into three."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    sizes, strides = [], []
    for size, stride in zip(x.shape[:-1], x.stride()[:-1]):
        if size == 1:
            continue
        if sizes and strides[-1] == stride * size:  # merges with the dimension before it
            sizes[-1] *= size
            strides[-1] = stride
        else:
            sizes.append(size)
            strides.append(stride)
    if len(sizes) > 3:
        x = x.contiguous()
        sizes, strides = [x.shape[:-1].numel()], [x.shape[-1]]
    pad = 3 - len(sizes)
    return x, [1] * pad + sizes, [0] * pad + strides


def _norm_dtype(x: torch.Tensor) -> torch.dtype:
    """r^2's dtype: at least float32, so that float16 squares cannot overflow."""
    return torch.promote_types(x.dtype, torch.float32)


def _squared_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x.to(_norm_dtype(x)).square().sum(-1, keepdim=True).clamp_min(eps * eps)


def _plain(x: torch.Tensor, eps: float, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    squared_norm = _squared_norm(x, eps)
    # multiplied in r^2's dtype, as the kernel: s / r overflows float16 for a zero row (s / eps), and 0 * inf is NaN
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return torch.mul(x, squared_norm.rsqrt() * scale, out=y), squared_norm


@torch.library.custom_op('lipsformer::l2_normalize', mutates_args=())
def _l2_normalize(x: torch.Tensor, eps: float, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not l2_normalize_kernels_run_on(x) or x.numel() == 0:
        return _plain(x, eps, scale)
    x, sizes, strides = _three_leading_dims(x)
    width = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    squared_norm = torch.empty((*x.shape[:-1], 1), dtype=_norm_dtype(x), device=x.device)
    rows = sizes[0] * sizes[1] * sizes[2]
    kernels = _kernels()
    block = kernels.block(width)
    rows_per_program = _rows_per_program(block)
    kernels.forward[(kernels.cdiv(rows, rows_per_program),)](
        x, y, squared_norm, rows, sizes[1], sizes[2], strides[0], strides[1], strides[2], width, eps * eps, scale,
        ROWS=rows_per_program, BLOCK=block)
    return y, squared_norm


@_l2_normalize.register_fake
def _(x: torch.Tensor, eps: float, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            x.new_empty((*x.shape[:-1], 1), dtype=_norm_dtype(x)))


@torch.library.custom_op('lipsformer::l2_normalize_backward', mutates_args=())
def _l2_normalize_backward(grad: torch.Tensor, y: torch.Tensor, squared_norm: torch.Tensor, eps: float,
                           scale: float) -> torch.Tensor:
    grad = grad.contiguous()
    if not l2_normalize_kernels_run_on(y) or y.numel() == 0:
        unclamped = squared_norm > eps * eps
        radial = (grad * y).sum(-1, keepdim=True, dtype=squared_norm.dtype) / scale * unclamped
        return (grad * scale).addcmul_(y, -radial.to(y.dtype)).mul_(squared_norm.rsqrt())
    grad_x = torch.empty_like(y)
    width, rows = y.shape[-1], y[..., 0].numel()
    kernels = _kernels()
    block = kernels.block(width)
    rows_per_program = _rows_per_program(block)
    kernels.backward[(kernels.cdiv(rows, rows_per_program),)](
        grad, y, squared_norm, grad_x, rows, width, eps * eps, scale, ROWS=rows_per_program, BLOCK=block)
    return grad_x


@_l2_normalize_backward.register_fake
def _(grad: torch.Tensor, y: torch.Tensor, squared_norm: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
    return torch.empty_like(y)


def _setup_context(ctx, inputs, output) -> None:
    _, eps, scale = inputs
    y, squared_norm = output
    ctx.eps, ctx.scale = eps, scale
    ctx.set_materialize_grads(False)  # r^2 has no gradient unless a caller used it: None, not zeros
    ctx.save_for_backward(y, squared_norm)


def _backward(ctx, grad, grad_squared_norm):
    y, squared_norm = ctx.saved_tensors
    eps, scale = ctx.eps, ctx.scale
    if grad is not None and grad_squared_norm is None and not torch.is_grad_enabled():
        return _l2_normalize_backward(grad, y, squared_norm, eps, scale), None, None
    # A recorded backward, or one through r^2: differentiable PyTorch in y and r^2 (whose gradients this gives).
    unclamped = squared_norm > eps * eps
    inverse_norm = squared_norm.rsqrt()
    grad_x = None
    if grad is not None:
        radial = (grad * y).sum(-1, keepdim=True, dtype=squared_norm.dtype) / scale * unclamped
        grad_x = ((grad * scale - y * radial.to(y.dtype)) * inverse_norm).to(y.dtype)
    if grad_squared_norm is not None:
        radial_norm = (grad_squared_norm * unclamped * 2.0 / (scale * inverse_norm)).to(y.dtype)
        grad_x = y * radial_norm if grad_x is None else grad_x + y * radial_norm
    return grad_x, None, None


_l2_normalize.register_autograd(_backward, setup_context=_setup_context)


def l2_normalize_op(x: torch.Tensor, eps: float, scale: float = 1.0) -> torch.Tensor:
    """``scale * x / max(||x||, eps)`` over the last dimension through the custom op (one kernel forward and one
    backward where :func:`l2_normalize_kernels_run_on`): contiguous on the CPU, elsewhere dense with its leading
    dimensions laid out in the order of x's strides.

    Off the CPU the output is laid out as x, as an elementwise op's would be: a (N, heads, L, C) view of a
    (N, L, heads * C) projection normalises into (N, L, heads, C) memory, fused attention writes its output in that
    layout, and merging the heads back is a view, not a copy. On the CPU the op serves training steps, whose attention
    is the explicit product (``lipsformer.layers.softmax_attention``): a batched product reads each head contiguous,
    and would copy (and keep for backward) a head laid out otherwise.
    """
    order = list(range(x.dim()))
    if x.device.type != 'cpu':
        order = sorted(range(x.dim() - 1), key=lambda dim: -x.stride(dim)) + [x.dim() - 1]
    if order == list(range(x.dim())):
        return torch.ops.lipsformer.l2_normalize(x, eps, scale)[0]
    y = torch.ops.lipsformer.l2_normalize(x.permute(order), eps, scale)[0]
    return y.permute([order.index(dim) for dim in range(x.dim())])


def l2_normalize(x: torch.Tensor, eps: float, scale: float = 1.0) -> torch.Tensor:
    """``scale * x / max(||x||, eps)`` over the last dimension (``F.normalize`` times ``scale``), the norm and the
    product taken in at least float32 (so that a zero row is zero in float16 too, where ``scale / eps`` overflows).

    The custom op where its Triton kernels run, or on the CPU where a backward will run (the op keeps the output and
    the squared norms for it, not x); the plain expression elsewhere, and for ``scale=0`` (the op's backward divides
    by the scale).
    """
    if scale != 0.0 and (l2_normalize_kernels_run_on(x) or lean_backward(x)):
        return l2_normalize_op(x, eps, scale)
    return (x * (_squared_norm(x, eps).rsqrt() * scale)).to(x.dtype)
