"""The blocks' convolutions on NHWC maps, called through their ``nn.Conv2d`` modules (timm's Swin layout).

- :func:`depthwise_conv_nhwc`: the conv shortcuts' depthwise 7x7 and CSwin's LePE 3x3, the module on the map's NCHW
  view (channels-last in memory: no copy).
- :func:`pointwise_conv_nhwc`: a 1x1 convolution as the product over channels it is (ConvNeXt's ``nn.Linear`` on
  NHWC maps), which GPUs run as a GEMM instead of a convolution kernel, read from the module's parameters where
  nothing could tell the difference (:func:`is_plain_module`, no tracing), the module called where a tool could: a
  hook, a wrapper (PEFT's LoRA), a parametrization or a quantized replacement, ``torch.jit.trace`` or FX.

TorchScript cannot take a module as an argument: scripted callers call the module themselves
(``if torch.jit.is_scripting()``).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ['depthwise_conv_nhwc', 'is_plain_module', 'pointwise_conv_nhwc']


def is_plain_module(module: nn.Module | None, cls: type[nn.Module]) -> bool:
    """Whether ``module`` is exactly a ``cls`` whose parameters may be read instead of calling it: no subclass or
    wrapper (a parametrized module is a subclass), no hooks, no forward set on the instance."""
    return (type(module) is cls and not module._forward_hooks and not module._forward_pre_hooks
            and not module._backward_hooks and not module._backward_pre_hooks and 'forward' not in module.__dict__)


def _nchw_call(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return conv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)


def depthwise_conv_nhwc(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``conv``, a stride-1 depthwise ``nn.Conv2d`` with 'same' padding, on the NHWC map ``x``; NHWC out."""
    return _nchw_call(conv, x)


def pointwise_conv_nhwc(conv: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``conv``, a 1x1 ``nn.Conv2d`` (stride 1, one group), on the NHWC map ``x`` as a linear layer over channels
    where ``x`` is contiguous (a map laid out channels-first, as PyTorch's own depthwise kernel leaves it, would be
    copied first: the convolution takes it as it is); NHWC out."""
    if (is_plain_module(conv, nn.Conv2d) and tuple(conv.kernel_size) == (1, 1) and tuple(conv.stride) == (1, 1)
            and conv.groups == 1 and not torch.jit.is_tracing() and not isinstance(x, torch.fx.Proxy)
            and x.is_contiguous()):
        return F.linear(x, conv.weight.flatten(1), conv.bias)
    return _nchw_call(conv, x)
