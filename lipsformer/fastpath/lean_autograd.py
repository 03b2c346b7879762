"""Lean autograd: the blocks' expressions with backwards that keep fewer activations (a fast path).

For each operation autograd keeps what that operation's own backward needs, so a chain keeps a tensor per link:

- ``F.linear(F.gelu(u), W)`` keeps u (GELU's derivative) and gelu(u) (the weight's gradient);
- ``x + alpha * gelu(z)`` keeps z and gelu(z) (alpha's gradient);
- ``F.linear(x, alpha[:, None] * W, alpha * b)`` keeps x and the scaled weight, a weight-sized tensor per call.

The Functions below compute the same values and gradients keeping one activation each: GELU is evaluated again
from its saved input in backward (one elementwise pass over a tensor the backward reads anyway) and the scaled weight
is formed again from the parameters. (SCSA's l2 normalisation, which keeps its output and not its input, is the
``lipsformer::l2_normalize`` op of :mod:`.l2_normalize_op` on every device.)

Each public function takes its Function only on the CPU and where a backward will run (grad enabled, an input requiring
grad); elsewhere it evaluates the plain expression, which is also what the tests compare it with. On a GPU a Function's
Python forward and backward cost host time on every call, which a step already bound by kernel launches cannot spare,
and its backward's extra passes cost kernels: there the plain expressions' kernels run, alpha still folded into the
weights (docs/performance.md counts both). GELU is the exact (erf) form, as ``nn.GELU()``. Every backward is itself
differentiable: when autograd records it (``create_graph=True``: gradient penalties, ``torch.autograd.functional.jvp`` /
``hvp``), it differentiates the plain expression again instead of running its in-place arithmetic, so second derivatives
are the plain expression's. Each Function runs its backward under the CPU autocast state of its forward
(``torch.amp.custom_fwd`` / ``custom_bwd``). ``torch.func`` transforms never reach these Functions: a fast form runs the
plain module graph under them (:mod:`.forms`).
"""
import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..layers.softmax_attention import needs_backward
from .onednn_linear import linear_backward, onednn_linear

__all__ = ['differentiate_plain', 'gelu_residual', 'lean_backward', 'lean_mlp', 'multiply_add', 'scaled_linear']


def lean_backward(x: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    """Whether an operation on ``x`` (and ``tensors``) takes its lean Function: on the CPU, where a backward will
    run."""
    return x.device.type == 'cpu' and needs_backward(x, *tensors)


def _cpu_autocast(function: Callable, backward: bool = False) -> Callable:
    """A Function's forward (``backward=True``: backward) under ``torch.amp.custom_fwd`` (``custom_bwd``) for the CPU,
    where the Functions run, with autocast's cast cache off: inside a Function grad mode is off, so a weight autocast
    casts there has no autograd history; cached, that cast would be what a later use of the same weight in the same
    autocast region gets, and its gradient would be lost."""

    @functools.wraps(function)
    def uncached(ctx, *args):
        if not torch.is_autocast_enabled('cpu'):
            return function(ctx, *args)
        with torch.autocast('cpu', dtype=torch.get_autocast_dtype('cpu'), cache_enabled=False):
            return function(ctx, *args)

    return (torch.amp.custom_bwd if backward else torch.amp.custom_fwd)(uncached, device_type='cpu')


def differentiate_plain(expression: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor | None],
                        needs: Sequence[bool], grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The vector-Jacobian product of ``expression(*inputs)`` with ``grad``, recorded by autograd: what a Function's
    backward returns when autograd records the backward itself (``create_graph=True``). ``needs`` says which inputs'
    gradients are wanted (None for the others)."""
    wanted = [tensor for tensor, need in zip(inputs, needs) if need]
    with torch.enable_grad():
        grads = iter(torch.autograd.grad(expression(*inputs), wanted, grad, create_graph=True, allow_unused=True))
    return tuple(next(grads) if need else None for need in needs)


def _gelu_backward_(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """GELU's backward written over ``grad``: grad * gelu'(x)."""
    return torch.ops.aten.gelu_backward.grad_input(grad, x, grad_input=grad)


def _scaled_weights(weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    if scale is None:
        return weight, bias
    # A weight already in a lower precision (autocast's weight casts made together, lipsformer.training.weight_casts)
    # is scaled in that precision, which the product then needs no cast into.
    scale = scale.to(weight.dtype)
    return weight * scale.unsqueeze(-1), bias * scale if bias is not None else None


def _plain_scaled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         scale: torch.Tensor | None, gelu: bool) -> torch.Tensor:
    weight, bias = _scaled_weights(weight, bias, scale)
    return F.linear(F.gelu(x) if gelu else x, weight, bias)


class _ScaledLinear(torch.autograd.Function):
    """linear(act(x), scale[:, None] W, scale b) keeping only x (and the parameters)."""

    @staticmethod
    @_cpu_autocast
    def forward(ctx, x, weight, bias, scale, gelu: bool):
        weight_scaled, bias_scaled = _scaled_weights(weight, bias, scale)
        out = onednn_linear(F.gelu(x) if gelu else x, weight_scaled, bias_scaled)
        ctx.gelu = gelu
        ctx.save_for_backward(x, weight, bias, scale)
        return out

    @staticmethod
    @functools.partial(_cpu_autocast, backward=True)
    def backward(ctx, grad):
        x, weight, bias, scale = ctx.saved_tensors
        need_x, need_weight, need_bias, need_scale, _ = ctx.needs_input_grad
        if torch.is_grad_enabled():
            return *differentiate_plain(lambda *inputs: _plain_scaled_linear(*inputs, ctx.gelu),
                                        (x, weight, bias, scale), ctx.needs_input_grad[:4], grad), None
        weight_scaled, _ = _scaled_weights(weight, None, scale)
        need_parameters = need_weight or need_bias or need_scale  # the scale's gradient needs the weight's
        act = F.gelu(x) if ctx.gelu and need_parameters else x  # GELU's output is the weight gradient's input
        grad_act, grad_weight_scaled, grad_bias_scaled = linear_backward(
            grad, act, weight_scaled, need_x, need_parameters, bias is not None and need_parameters)
        grad_x = grad_weight = grad_bias = grad_scale = None
        if need_x:
            grad_x = grad_act.to(x.dtype)
            if ctx.gelu:
                _gelu_backward_(grad_x, x)
        if need_parameters:
            grad_weight, grad_bias, grad_scale = _unscale(grad_weight_scaled, grad_bias_scaled, weight, bias, scale)
            # Under autocast the products ran in the lower precision; the parameters' gradients take their dtype.
            grad_weight = grad_weight.to(weight.dtype)
            grad_bias = grad_bias.to(bias.dtype) if bias is not None else None
            grad_scale = grad_scale.to(scale.dtype) if scale is not None else None
        return grad_x, grad_weight, grad_bias, grad_scale, None


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  scale: torch.Tensor | None = None, gelu: bool = False) -> torch.Tensor:
    """``F.linear(F.gelu(x) if gelu else x, scale[:, None] * weight, scale * bias)`` (``scale=None``: no scale).

    ``F.linear(x, weight, bias) * scale`` with the per-channel scale folded into the weight and bias (the weighted
    residual's alpha, see ``lipsformer.layers.residual_alpha``). The backward keeps x alone: not gelu(x), and not
    the scaled weight (formed again from the parameters).
    """
    if lean_backward(x, weight, bias, scale):
        return _ScaledLinear.apply(x, weight, bias, scale, gelu)
    weight, bias = _scaled_weights(weight, bias, scale)
    return onednn_linear(F.gelu(x) if gelu else x, weight, bias)


def _unscale(grad_weight_scaled: torch.Tensor, grad_bias_scaled: torch.Tensor | None, weight: torch.Tensor,
             bias: torch.Tensor | None, scale: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of weight, bias and scale from those of the scaled weight (scale[:, None] W) and bias (scale b)."""
    if scale is None:
        return grad_weight_scaled, grad_bias_scaled, None
    grad_scale = (grad_weight_scaled * weight).sum(-1)
    if bias is not None:
        grad_scale = grad_scale + grad_bias_scaled * bias
        grad_bias_scaled = grad_bias_scaled * scale
    return grad_weight_scaled * scale.unsqueeze(-1), grad_bias_scaled, grad_scale


def lean_mlp(x: torch.Tensor, weight1: torch.Tensor, bias1: torch.Tensor | None, weight2: torch.Tensor,
        bias2: torch.Tensor | None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(F.gelu(F.linear(x, weight1, bias1)), weight2, bias2) * scale`` (``scale=None``: no scale).

    fc1, then :func:`scaled_linear` with ``gelu=True``: the backward keeps x and fc1's output, not GELU's.
    """
    return scaled_linear(onednn_linear(x, weight1, bias1), weight2, bias2, scale, gelu=True)


class _GeluResidual(torch.autograd.Function):
    """x + scale * gelu(z) keeping only z (and scale)."""

    @staticmethod
    @_cpu_autocast
    def forward(ctx, x, z, scale):
        ctx.x_dtype = x.dtype
        ctx.save_for_backward(z, scale)
        branch = F.gelu(z)
        if x.dtype == branch.dtype == scale.dtype and x.shape == branch.shape:
            return torch.addcmul(x, branch, scale, out=branch)  # into GELU's output: one allocation, not two
        return torch.addcmul(x, branch, scale)

    @staticmethod
    @functools.partial(_cpu_autocast, backward=True)
    def backward(ctx, grad):
        z, scale = ctx.saved_tensors
        _, need_z, need_scale = ctx.needs_input_grad
        if torch.is_grad_enabled():
            return grad.to(ctx.x_dtype), *differentiate_plain(lambda z, scale: F.gelu(z) * scale, (z, scale),
                                                              (need_z, need_scale), grad)
        grad_z = grad_scale = None
        if need_z:
            grad_z = (grad * scale).to(z.dtype)
            _gelu_backward_(grad_z, z)
        if need_scale:
            grad_scale = F.gelu(z).mul_(grad).sum_to_size(scale.shape).to(scale.dtype)
        return grad.to(ctx.x_dtype), grad_z, grad_scale


def gelu_residual(x: torch.Tensor, z: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x + scale * F.gelu(z)``, scale broadcasting over z; the backward keeps z alone, not gelu(z)."""
    if lean_backward(x, z, scale):
        return _GeluResidual.apply(x, z, scale)
    return multiply_add(x, F.gelu(z), scale)


def multiply_add(x: torch.Tensor, branch: torch.Tensor, factor: torch.Tensor, value: float = 1.0) -> torch.Tensor:
    """``x + value * branch * factor`` in x's dtype or wider, factor broadcasting over branch.

    One ``addcmul`` where factor takes no gradient, run outside autocast, whose promotion of its operands would cast a
    low-precision branch to float32 first (the op reads mixed dtypes itself). Where factor's gradient is wanted, a
    product and a sum: autograd's formula for ``addcmul`` multiplies a whole operand by ``value`` (one pass more,
    whatever the value) for each gradient it gives.
    """
    if torch.is_grad_enabled() and factor.requires_grad:
        return x + branch * (factor * value if value != 1.0 else factor)
    device_type = x.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type, enabled=False):
            return torch.addcmul(x, branch, factor, value=value)
    return torch.addcmul(x, branch, factor, value=value)
