"""Fast paths: a built model's fast form, the same function as its plain module graph with faster kernels and fewer
saved activations, given once and taken back (``to_fast_form`` / ``to_plain_form``).

This room stands above the models: they know nothing of it.

- ``forms``: the fast form of a LipsFormer block, of CenterNorm, of SCSA, of CSwin's attention on a square map, of a
  mixer's qkv product on the CPU, and the calls that give and take it back;
- ``switch``: :func:`set_fast_path` / :func:`use_fast_path`, the device types on which the package gives its models
  their fast form (on by default for :data:`DEFAULT_DEVICES`; ``LIPSFORMER_FAST_PATH=0`` turns it off, ``1`` on
  everywhere; timm's exportable and scriptable layer configs turn it off);
- ``blocks``: the weighted residual, the token-wise linear layers with alpha folded in, timm's MLP, the conv shortcut;
- ``lean_autograd``: autograd Functions whose backwards keep fewer activations (twice differentiable, autocast-aware);
- ``l2_normalize_op``: SCSA's q/k normalisation as the ``lipsformer::l2_normalize`` custom op, one Triton kernel a
  direction on a GPU (a tile of rows a program), PyTorch elsewhere;
- ``onednn_linear``: token-wise products on CPU through oneDNN's 1x1 convolution;
- ``depthwise_conv_op``: the conv shortcuts' depthwise convolutions on the CPU as the ``lipsformer::depthwise_conv2d``
  custom op, whose weight gradient runs through oneDNN's forward kernel;
- ``fused_center_norm``: CenterNorm through LayerNorm's fused kernel (:func:`center_norm`).
"""
from .blocks import conv_shortcut, linear, mlp, mlp_is_plain, weighted_residual
from .depthwise_conv_op import depthwise_conv2d_op
from .forms import (
    FastCenterNorm,
    FastCrossStripeAttention,
    FastLipsFormerBlock,
    FastScaledCosineAttention,
    alpha_folds,
    in_fast_form,
    to_fast_form,
    to_plain_form,
)
from .fused_center_norm import center_norm
from .l2_normalize_op import l2_normalize
from .switch import DEFAULT_DEVICES, set_fast_path, use_fast_path

__all__ = ['DEFAULT_DEVICES', 'FastCenterNorm', 'FastCrossStripeAttention', 'FastLipsFormerBlock',
           'FastScaledCosineAttention', 'alpha_folds', 'center_norm', 'conv_shortcut', 'depthwise_conv2d_op',
           'in_fast_form', 'l2_normalize', 'linear', 'mlp', 'mlp_is_plain', 'set_fast_path', 'to_fast_form',
           'to_plain_form', 'use_fast_path', 'weighted_residual']
