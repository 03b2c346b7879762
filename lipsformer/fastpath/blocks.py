"""The fast paths of the blocks' compositions, computed from their modules' parameters.

Each function computes what calling the modules would, in fewer passes and keeping fewer activations:

- :func:`weighted_residual`: ``x + DropPath(scale (.) branch)``, the keep mask drawn exactly as timm's ``drop_path``
  draws it (the same seed drops the same samples), mask and scale one small factor, the sum one multiply-add
  (:func:`.lean_autograd.multiply_add`);
- :func:`linear`: a token-wise ``nn.Linear`` (through oneDNN on CPU), optionally times a per-channel scale folded
  into its weight and bias (alpha of a weighted residual whose branch ends in that layer);
- :func:`mlp`: timm's ``Mlp`` with exact GELU, alpha folded into fc2, keeping fc1's input and output but not GELU's;
- :func:`conv_shortcut`: ``x + DropPath(alpha (.) GELU(PW(GELU(DW(x)))))`` keeping x, DW(x) and PW(GELU(DW(x))).

The callers (:mod:`.forms`) decide that a fast path applies (``is_plain_module`` for every module read here); these
functions only compute.
"""
import torch
import torch.nn as nn
from timm.layers import DropPath, Mlp

from ..layers import is_plain_module
from . import lean_autograd
from .depthwise_conv_op import cpu_weight_grad_applies, depthwise_conv2d_op
from .onednn_linear import onednn_linear

__all__ = ['conv_shortcut', 'linear', 'mlp', 'mlp_is_plain', 'weighted_residual']


def _keep_mask(x: torch.Tensor, branch: torch.Tensor, drop_path: DropPath) -> torch.Tensor | None:
    """The keep mask timm's ``drop_path`` draws for the residual ``x + drop_path(branch)``: (B, 1, ..., 1), 0 or 1 (not
    yet scaled by 1 / keep probability), drawn by the same call on a tensor of the dtype the plain graph draws it in
    (that of ``x`` and ``branch`` together: under autocast the float32 stream's); None where no path is dropped."""
    if not (drop_path.training and drop_path.drop_prob > 0.0):
        return None
    dtype = torch.promote_types(x.dtype, branch.dtype)
    return branch.new_empty([branch.shape[0]] + [1] * (branch.dim() - 1), dtype=dtype).bernoulli_(
        1.0 - drop_path.drop_prob)


def _kept_path_factor(drop_path: DropPath) -> float:
    """What timm's ``drop_path`` multiplies a kept path by."""
    keep_prob = 1.0 - drop_path.drop_prob
    return 1.0 / keep_prob if keep_prob > 0.0 and drop_path.scale_by_keep else 1.0


def _residual_scale(x: torch.Tensor, branch: torch.Tensor, scale: torch.Tensor, drop_path: DropPath) -> torch.Tensor:
    """The factor ``drop_path(branch * scale)`` multiplies ``branch`` by: ``scale`` times, in training, the keep mask
    over the keep probability."""
    mask = _keep_mask(x, branch, drop_path)
    if mask is None:
        return scale
    if _kept_path_factor(drop_path) != 1.0:
        mask = mask / (1.0 - drop_path.drop_prob)  # as timm divides it
    return mask * scale


def weighted_residual(x: torch.Tensor, branch: torch.Tensor, scale: torch.Tensor | None,
                      drop_path: DropPath) -> torch.Tensor:
    """``x + drop_path(branch * scale)`` (``scale=None``: no scale, as where alpha was folded into the branch)."""
    if scale is not None:
        return lean_autograd.multiply_add(x, branch, _residual_scale(x, branch, scale, drop_path))
    mask = _keep_mask(x, branch, drop_path)
    if mask is None:
        return x + branch
    return lean_autograd.multiply_add(x, branch, mask, _kept_path_factor(drop_path))


def linear(module: nn.Linear, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``module(x) * scale`` (``scale=None``: ``module(x)``), read from the module where it is a plain ``nn.Linear``,
    called as a module where it is not (a LoRA wrapper, a hook, a parametrization)."""
    if is_plain_module(module, nn.Linear):
        if scale is None and not lean_autograd.lean_backward(x, module.weight, module.bias):
            return onednn_linear(x, module.weight, module.bias)
        return lean_autograd.scaled_linear(x, module.weight, module.bias, scale)
    x = module(x)
    return x if scale is None else x * scale


def mlp_is_plain(module: nn.Module) -> bool:
    """Whether ``module`` is a plain timm ``Mlp`` with exact GELU and nothing between GELU and fc2 that trains."""
    return (is_plain_module(module, Mlp) and is_plain_module(module.fc1, nn.Linear)
            and is_plain_module(module.fc2, nn.Linear) and is_plain_module(module.act, nn.GELU)
            and module.act.approximate == 'none' and is_plain_module(module.norm, nn.Identity)
            and is_plain_module(module.drop1, nn.Dropout) and (module.drop1.p == 0.0 or not module.training)
            and is_plain_module(module.drop2, nn.Dropout))


def mlp(module: Mlp, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """``module(x) * scale`` for a module that :func:`mlp_is_plain` accepts (dropout commutes with the scale)."""
    return module.drop2(lean_autograd.lean_mlp(x, module.fc1.weight, module.fc1.bias, module.fc2.weight,
                                               module.fc2.bias, scale))


def conv_shortcut(x: torch.Tensor, dw: nn.Conv2d, pw: nn.Conv2d | None, scale: torch.Tensor,
                  drop_path: DropPath) -> torch.Tensor:
    """``x + drop_path(scale (.) GELU(pw(GELU(dw(x)))))`` on an NHWC map (``pw=None``: ``GELU(dw(x))``), exact
    GELUs, dw a stride-1 depthwise conv with 'same' padding and pw a 1x1 conv. The depthwise conv is the
    ``lipsformer::depthwise_conv2d`` op where its CPU weight gradient applies (``cpu_weight_grad_applies``),
    PyTorch's convolution of the channels-last view otherwise."""
    if cpu_weight_grad_applies(x, dw.weight):
        z = depthwise_conv2d_op(x, dw.weight, dw.bias)
    else:
        z = dw(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    if pw is not None:
        z = lean_autograd.scaled_linear(z, pw.weight.flatten(1), pw.bias, gelu=True)
    return lean_autograd.gelu_residual(x, z, _residual_scale(x, z, scale, drop_path))
