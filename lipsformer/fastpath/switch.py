"""The one switch for the package's fast paths, and the tests that decide where a fast path may run.

A fast path computes what the plain module graph computes, the same function of the same parameters, with kernels
that are faster or keep fewer activations for backward. It runs only where nothing can tell the difference:

- the switch is on for the device the block runs on: by default on the devices in :data:`DEFAULT_DEVICES`, where the
  benchmark measures the fast path faster than the plain module graph (docs/performance.md);
  :func:`set_fast_path` (or ``LIPSFORMER_FAST_PATH`` at import: ``1`` on every device, ``0`` on none, ``auto`` or
  unset the defaults) overrides them, and timm's ``set_layer_config(exportable=True)`` or ``scriptable=True`` turns it
  off;
- nothing traces or transforms the model: TorchScript, FX, ``torch.jit.trace`` (the legacy ONNX exporter), dynamo
  (``torch.compile``, ``torch.export``, the dynamo ONNX exporter), ``torch.func`` transforms and forward-mode AD all
  see the plain module graph (:func:`active`);
- every module a fast path would stand in for is exactly its class, with no hooks, no parametrization and no forward
  of its own: a PEFT LoRA wrapper, a quantized replacement, ``parametrize`` (spectral norm, weight norm), a forward
  or backward hook, an Accelerate hook all make it step aside, and the module is called (:func:`plain`).

The decision is taken once per block (``LipsFormerBlock``): the block runs its fast form, and the layers that have a
faster kernel of their own (SCSA's normalisation, the explicit attention product) ask :func:`engaged`, which is true
only inside that block's fast form.
"""
import os
import threading

import torch
import torch.nn as nn
from timm.layers import is_exportable, is_scriptable
from torch.autograd import forward_ad
from torch.fx import _symbolic_trace
from torch.nn.modules import module as torch_module

__all__ = ['DEFAULT_DEVICES', 'KERNEL_DEFAULT_DEVICES', 'active', 'engage', 'engaged', 'kernel_enabled', 'plain',
           'set_fast_path', 'traced', 'transformed', 'use_fast_path']

_ENVIRONMENT_VARIABLE = 'LIPSFORMER_FAST_PATH'
_ON, _OFF, _AUTO = ('1', 'true', 'on', 'yes'), ('0', 'false', 'off', 'no'), ('auto', '')

# The device types on which the fast path is on unless switched: those where docs/performance.md measures it faster
# than the plain module graph (on CUDA: in training for both families, in inference for LipsFormer-Swin).
DEFAULT_DEVICES = frozenset({'cpu', 'cuda'})
# The custom-op kernels that a layer runs in place of its module in the plain module graph as well as in a block's
# fast form (so that torch.compile and torch.export see them), each with the device types where docs/performance.md
# measures it faster than the module's own kernels; set_fast_path(True) runs each wherever it has a kernel.
KERNEL_DEFAULT_DEVICES: dict[str, frozenset[str]] = {
    'depthwise_conv2d': frozenset(),  # lipsformer::depthwise_conv2d's Triton kernels: not yet timed on a GPU
}


def _from_environment() -> bool | None:
    value = os.environ.get(_ENVIRONMENT_VARIABLE, 'auto').strip().lower()
    if value not in _ON + _OFF + _AUTO:
        raise ValueError(f'{_ENVIRONMENT_VARIABLE}={os.environ[_ENVIRONMENT_VARIABLE]!r} is neither on {_ON}, off '
                         f'{_OFF} nor auto; set it to 0 to run the plain module graph, or unset it')
    return None if value in _AUTO else value in _ON


_enabled: bool | None = _from_environment()  # None: on for DEFAULT_DEVICES
# torch >= 2.8 names the FX-only test apart from export's (its is_fx_tracing warns that it covers both)
_fx_tracing = getattr(_symbolic_trace, 'is_fx_symbolic_tracing', _symbolic_trace.is_fx_tracing)


def traced() -> bool:
    """Whether FX's symbolic tracer or ``torch.jit.trace`` records the call (both see modules, not their kernels)."""
    return torch.jit.is_tracing() or _fx_tracing()


class set_fast_path:  # noqa: N801 (a function that is also a context manager, as timm's set_layer_config)
    """Turn the fast paths on or off: ``set_fast_path(False)`` for the rest of the process, or
    ``with set_fast_path(False): ...`` for a block, after which the previous state returns.

    ``True`` turns them on for every device (the kernels of :data:`KERNEL_DEFAULT_DEVICES` included, wherever they
    run), ``False`` off for every device, ``None`` back to the defaults (on for :data:`DEFAULT_DEVICES`, each kernel
    on its own default devices).
    """

    def __init__(self, enable: bool | None = True) -> None:
        global _enabled
        self.previous = _enabled
        _enabled = None if enable is None else bool(enable)

    def __enter__(self) -> 'set_fast_path':
        return self

    def __exit__(self, *exc_info: object) -> None:
        global _enabled
        _enabled = self.previous


def use_fast_path(device_type: str = 'cpu') -> bool:
    """Whether the fast paths are switched on for ``device_type`` (:func:`set_fast_path` or the defaults, and timm's
    layer config not exportable or scriptable)."""
    enabled = device_type in DEFAULT_DEVICES if _enabled is None else _enabled
    return enabled and not is_exportable() and not is_scriptable()


def _global_module_hooks() -> bool:
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks
                or torch_module._global_backward_hooks or torch_module._global_backward_pre_hooks)


def transformed() -> bool:
    """Whether a ``torch.func`` transform (vmap, grad, jvp, jacrev, ...) or forward-mode AD is running (outside
    dynamo, which reads nothing after its ``is_compiling()``)."""
    return not torch.compiler.is_compiling() and (torch._C._functorch.peek_interpreter_stack() is not None
                                                  or getattr(forward_ad, '_current_level', -1) >= 0)


def active(device_type: str = 'cpu') -> bool:
    """Whether a fast path may run now on ``device_type``: switched on, nothing tracing or transforming the call, no
    global module hooks.

    Callers test ``torch.jit.is_scripting()`` first, in a branch of its own, so that TorchScript never compiles this.
    """
    # dynamo folds is_compiling() to True and reads nothing after it
    return (not torch.compiler.is_compiling() and use_fast_path(device_type) and not torch.jit.is_tracing()
            and not _fx_tracing() and not transformed() and not _global_module_hooks())


def kernel_enabled(name: str, device_type: str) -> bool:
    """Whether the custom-op kernel ``name`` (a key of :data:`KERNEL_DEFAULT_DEVICES`) stands in for its module on
    ``device_type``: switched on there (by default on the kernel's own devices), and nothing but dynamo tracing the
    call (TorchScript, FX and ``torch.jit.trace`` see the module; so do ``torch.func`` transforms, forward-mode AD and
    global module hooks). Unlike :func:`active`, true under ``torch.compile`` and ``torch.export``, which see the op."""
    enabled = device_type in KERNEL_DEFAULT_DEVICES[name] if _enabled is None else _enabled
    return (enabled and not is_exportable() and not is_scriptable() and not traced() and not transformed()
            and not _global_module_hooks())


_state = threading.local()


def engaged() -> bool:
    """Whether the calling code runs inside a block's fast form (:class:`engage`); False under dynamo."""
    return not torch.compiler.is_compiling() and getattr(_state, 'engaged', False)


class engage:  # noqa: N801 (a context manager named for what it does)
    """Mark the code inside as part of a block's fast form, which the block decided once (:func:`engaged`)."""

    def __enter__(self) -> None:
        self.previous = getattr(_state, 'engaged', False)
        _state.engaged = True

    def __exit__(self, *exc_info: object) -> None:
        _state.engaged = self.previous


def plain(module: nn.Module | None, cls: type[nn.Module]) -> bool:
    """Whether ``module`` is exactly a ``cls`` that a fast path may read the parameters of instead of calling it: no
    subclass or wrapper (a parametrized module is a subclass), no hooks, no forward set on the instance."""
    return (type(module) is cls and not module._forward_hooks and not module._forward_pre_hooks
            and not module._backward_hooks and not module._backward_pre_hooks and 'forward' not in module.__dict__)
