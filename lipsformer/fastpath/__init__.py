"""Fast paths: the same functions as the plain module graph, with faster kernels and fewer saved activations.

Everything that computes a model's layers other than through their modules is here, behind one switch:

- ``switch``: :func:`set_fast_path` / :func:`use_fast_path` (on by default for :data:`DEFAULT_DEVICES`;
  ``LIPSFORMER_FAST_PATH=0`` turns it off, ``1`` on everywhere; timm's exportable and scriptable layer configs turn it
  off), and the tests of where a fast path may run (:func:`active`: not under tracing, export, compilation,
  ``torch.func`` or forward AD; :func:`plain`: a module with no hooks, parametrization or wrapper; :func:`engaged`:
  inside a block's fast form);
- ``blocks``: the weighted residual, the token-wise linear layers with alpha folded in, timm's MLP, the conv shortcut;
- ``lean_autograd``: autograd Functions whose backwards keep fewer activations (twice differentiable, autocast-aware);
- ``l2_normalize_op``: SCSA's q/k normalisation as the ``lipsformer::l2_normalize`` custom op, one Triton kernel a
  direction on a GPU (a tile of rows a program), PyTorch elsewhere;
- ``onednn_linear``: token-wise products on CPU through oneDNN's 1x1 convolution;
- ``triton_device``: where the Triton kernels run (a GPU, or the CPU under Triton's interpreter);
- ``depthwise_conv_op``: the blocks' depthwise convolutions (the conv shortcuts' 7x7, CSwin's LePE 3x3) as the
  ``lipsformer::depthwise_conv2d`` custom op, one Triton kernel a pass on a GPU, in the plain module graph too where
  its switch (``KERNEL_DEFAULT_DEVICES``) is on (:func:`depthwise_kernel_applies`);
- ``depthwise_conv``: the 7x7 depthwise conv with a faster CPU weight gradient (oneDNN's forward kernel, an image
  at a time);
- CenterNorm through LayerNorm's fused kernel (:func:`center_norm`).

The modules in ``lipsformer.layers`` and ``lipsformer.models`` hold the plain path, which reads like the paper. The
trunk's block (``lipsformer.models._base.LipsFormerBlock``) decides once per call whether its fast form runs
(``active()`` for the input's device) and calls into here for each part that ``plain()`` allows; the model families
know nothing of it. The tests compare the two paths' values and gradients.
"""
from .blocks import conv_shortcut, linear, mlp, mlp_is_plain, weighted_residual
from .depthwise_conv_op import depthwise_conv2d_op, depthwise_kernel_applies
from .fused_center_norm import center_norm
from .lean_autograd import l2_normalize
from .switch import (
    DEFAULT_DEVICES,
    KERNEL_DEFAULT_DEVICES,
    active,
    engage,
    engaged,
    kernel_enabled,
    plain,
    set_fast_path,
    traced,
    transformed,
    use_fast_path,
)

__all__ = ['DEFAULT_DEVICES', 'KERNEL_DEFAULT_DEVICES', 'active', 'center_norm', 'conv_shortcut',
           'depthwise_conv2d_op', 'depthwise_kernel_applies', 'engage', 'engaged', 'kernel_enabled', 'l2_normalize',
           'linear', 'mlp', 'mlp_is_plain', 'plain', 'set_fast_path', 'traced', 'transformed', 'use_fast_path',
           'weighted_residual']
