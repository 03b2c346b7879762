"""Fast paths: the same functions as the plain module graph, with faster kernels and fewer saved activations.

Everything that computes a model's layers other than through their modules is here, behind one switch:

- ``switch``: :func:`set_fast_path` / :func:`use_fast_path` (``LIPSFORMER_FAST_PATH=0`` turns it off; timm's
  exportable and scriptable layer configs do too), and the tests of where a fast path may run (:func:`active`: not
  under tracing, export, compilation, ``torch.func`` or forward AD; :func:`plain`: a module with no hooks,
  parametrization or wrapper);
- ``blocks``: the weighted residual, the token-wise linear layers with alpha folded in, timm's MLP, the conv shortcut;
- ``lean_autograd``: autograd Functions whose backwards keep fewer activations (twice differentiable, autocast-aware);
- ``onednn_linear``: token-wise products on CPU through oneDNN's 1x1 convolution;
- ``depthwise_conv``: the 7x7 depthwise conv with a faster CPU weight gradient; ``cpu_kernels.c``, the C kernels of
  the CPU backward (that weight gradient, the GELU residual's), built by ``native``;
- ``native``: the package's C kernels, compiled for the CPU on first use, cached and checked before loading
  (:func:`native_kernels`: which of them this process can use);
- CenterNorm through LayerNorm's fused kernel (:func:`center_norm`).

The modules in ``lipsformer.layers`` and ``lipsformer.models`` hold the plain path, which reads like the paper, and
call into here where ``active()`` and ``plain()`` allow. The tests compare the two paths' values and gradients.
"""
from .blocks import conv_shortcut, linear, mlp, mlp_is_plain, weighted_residual
from .center_norm import center_norm
from .lean_autograd import l2_normalize
from .native import native_kernels
from .switch import active, plain, set_fast_path, transformed, use_fast_path

__all__ = ['active', 'center_norm', 'conv_shortcut', 'l2_normalize', 'linear', 'mlp', 'mlp_is_plain', 'native_kernels',
           'plain', 'set_fast_path', 'transformed', 'use_fast_path', 'weighted_residual']
