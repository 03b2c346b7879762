"""``torch.compile`` in training, evaluation and the benchmark: whether a model compiles, how, and with which shapes.

- ``model.compile``: ``auto`` compiles where the run trains on a CUDA device and not on the CPU (where inductor's
  first step of a full-size model takes minutes); ``true`` / ``false`` decide for any device. Accelerate's
  dynamo plugin compiles the model in ``accelerator.prepare``, in the order DDP and FSDP2 need; the launcher's
  ``--dynamo_backend`` does not override the config.
- ``model.compile_scope``: ``regional`` (the default) compiles each LipsFormer block in place
  (:func:`compile_regions`): blocks of one shape share one compiled graph, so a stage of 21 blocks compiles its block
  once (PyTorch's regional compilation recipe); the stem, the patch merges and the head stay eager. ``whole`` compiles
  the whole model through Accelerate's dynamo plugin, which compiles in ``accelerator.prepare`` in the order DDP and
  FSDP2 need. A model without LipsFormer blocks (a timm model) compiles whole, and the log says so. Regional
  compilation is the package's own (:func:`compile_regions`, as Accelerate's ``use_regional_compilation`` from 1.7 does
  for ``ModuleList`` blocks, which these models' ``nn.Sequential`` stages are not).
- ``model.compile_mode``: inductor's mode. The modes that record CUDA graphs (:data:`CUDA_GRAPH_MODES`) replay one
  graph per input shape, so they compile with static shapes: training batches are always whole (the loader drops an
  epoch's last partial batch) and evaluation batches are padded to the evaluation batch size (padding is labelled -1
  and not scored). A CUDA graph's outputs live in a memory pool its next replay overwrites, so their runs keep the
  gradients in buffers of their own, zeroed between updates instead of freed: a gradient taken over from the pool
  would be overwritten by the next micro-batch of an accumulation window.
  On a device without CUDA graphs these modes compile as their modes without graphs (:func:`effective_mode`, what
  the records give), still with static shapes.
- The first training micro-batch of each start of a compiled run (forward, backward and the compilation they
  trigger) is timed; the log and ``summary.json`` (``compile``) give it, and the epoch's ``images_per_s`` leaves it
  out (a resumed epoch's checkpoint carries the earlier start's).
"""
import logging
import os

import torch
from accelerate.utils import TorchDynamoPlugin
from timm.layers import DropPath
from torch import nn

from .config import Config

__all__ = ['COMPILE_SCOPES', 'CUDA_GRAPH_MODES', 'CompiledDropPath', 'compile_model', 'compile_regions', 'compiles',
           'dynamo_plugin', 'effective_mode', 'keep_own_gradients', 'say_compilation', 'static_shapes',
           'whole_model_plugin']

_logger = logging.getLogger(__name__)

CUDA_GRAPH_MODES = ('reduce-overhead', 'max-autotune')
COMPILE_SCOPES = ('regional', 'whole')
# What a CUDA-graph mode compiles as where there are no CUDA graphs (inductor skips them for other devices).
_WITHOUT_CUDA_GRAPHS = {'reduce-overhead': 'default', 'max-autotune': 'max-autotune-no-cudagraphs'}
# Compiled variants one block's code may have before dynamo gives up on it (and runs it eager), per stage: training
# and evaluation, Swin's shifted and unshifted windows, an evaluation's last partial batch, a recompute under
# gradient checkpointing. dynamo's default (8) is for one region of one shape.
_VARIANTS_PER_STAGE = 16


def compiles(config: Config, cpu: bool) -> bool:
    """Whether the run compiles its model: ``model.compile``, with ``auto`` meaning a run on a CUDA device.

    Args:
        config: The run's config.
        cpu: Whether the run trains on the CPU although an accelerator may be present (``train.device=cpu``).
    """
    if config.model.compile == 'auto':
        return not cpu and torch.cuda.is_available()
    return bool(config.model.compile)


def effective_mode(mode: str, device_type: str) -> str:
    """The mode inductor compiles in on ``device_type``: a CUDA-graph mode (:data:`CUDA_GRAPH_MODES`) without CUDA
    is its mode without graphs."""
    return mode if device_type == 'cuda' else _WITHOUT_CUDA_GRAPHS.get(mode, mode)


def dynamo_plugin(config: Config, cpu: bool) -> TorchDynamoPlugin:
    """Accelerate's dynamo plugin for the run: inductor in ``model.compile_mode`` for ``model.compile_scope=whole``,
    else no compilation by Accelerate (regional compilation is :func:`compile_regions`'s, before ``prepare``)."""
    launcher = os.environ.get('ACCELERATE_DYNAMO_BACKEND', 'no').lower()
    if not compiles(config, cpu):
        if launcher not in ('no', ''):
            _logger.warning('the launcher asks for dynamo backend %s; model.compile=%s (on %s) does not compile, set '
                            'model.compile=true to compile', launcher, config.model.compile, 'cpu' if cpu else 'the '
                            'device Accelerate picks')
        return TorchDynamoPlugin(backend='no')
    if config.model.compile_scope != 'whole':
        return TorchDynamoPlugin(backend='no')
    return whole_model_plugin(config, 'cpu' if cpu or not torch.cuda.is_available() else 'cuda')


def whole_model_plugin(config: Config, device_type: str) -> TorchDynamoPlugin:
    """Accelerate's dynamo plugin that compiles the whole model with inductor in ``model.compile_mode``."""
    mode = effective_mode(config.model.compile_mode, device_type)
    return TorchDynamoPlugin(backend='inductor', mode=mode, dynamic=False if static_shapes(config) else None)


def static_shapes(config: Config) -> bool:
    """Whether the model compiles with static shapes: a CUDA-graph ``model.compile_mode`` (on any device)."""
    return config.model.compile_mode in CUDA_GRAPH_MODES


def say_compilation(config: Config, device: torch.device, scope: str | None) -> None:
    """Log how the model is compiled, or that a ``model.compile_mode`` is not used by a run that does not compile
    (``scope`` None), once the run's log file is open."""
    mode = config.model.compile_mode
    if scope is None:
        if mode != 'default':
            _logger.warning('model.compile_mode %s is not used: model.compile=%s does not compile on %s (summary.json '
                            'records compile null); set model.compile=true (--torchcompile) to compile', mode,
                            config.model.compile, device.type)
        return
    static = static_shapes(config)
    ran = effective_mode(mode, device.type)
    _logger.info('the model is compiled with inductor, scope %s, mode %s%s; its first step compiles', scope, ran,
                 ' (static shapes)' if static else '')
    if ran != mode:
        _logger.warning('model.compile_mode %s records CUDA graphs, which need a CUDA device; on %s it compiles as '
                        'mode %s with static shapes', mode, device.type, ran)


class CompiledDropPath(nn.Module):
    """timm's ``DropPath`` with its rate in a tensor, for a compiled block: dynamo compiles a float attribute as a
    constant, so blocks of a stage, whose stochastic-depth rates all differ, would each compile a graph of their own.

    The same function as ``DropPath(drop_prob, scale_by_keep)``, its random draws aside: each sample's branch is kept
    with probability ``1 - drop_prob`` (and scaled by its inverse) in training, the identity in evaluation.
    """

    def __init__(self, drop_prob: float, scale_by_keep: bool = True, device: torch.device | None = None) -> None:
        super().__init__()
        self.drop_prob = drop_prob  # shown, never read by forward
        self.scale_by_keep = scale_by_keep
        self.register_buffer('keep_prob', torch.tensor(1.0 - drop_prob, device=device), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)
        keep = (torch.rand(shape, device=x.device) < self.keep_prob).float()
        if self.scale_by_keep:  # a rate of 1 keeps nothing and scales nothing, as timm's DropPath
            keep = keep / self.keep_prob.clamp_min(torch.finfo(self.keep_prob.dtype).tiny)
        return x * keep.to(x.dtype)

    def extra_repr(self) -> str:
        return f'drop_prob={self.drop_prob:0.3f}'


def compile_regions(model: nn.Module, mode: str | None = 'default', dynamic: bool | None = False,
                    backend: str = 'inductor') -> int:
    """Compile each LipsFormer block of ``model`` in place (``nn.Module.compile``); blocks of one shape share a graph.

    The blocks' ``DropPath`` modules become :class:`CompiledDropPath` where any rate is above 0, and dynamo's
    recompilation limit is raised to :data:`_VARIANTS_PER_STAGE` a stage. The model's state dict is unchanged (no
    wrapper prefix), so checkpoints, the EMA and exports see a plain model. Call it after the EMA copies the model.

    Args:
        model: The model, on its device.
        mode: inductor's mode (:func:`effective_mode` for the device).
        dynamic: ``torch.compile``'s ``dynamic``: False (static shapes: a graph per stage shape and batch size).
        backend: ``torch.compile``'s backend (``aot_eager`` captures the same graphs without inductor's code).

    Returns:
        How many blocks were compiled (0: the model has no LipsFormer blocks, nothing was compiled).
    """
    from ..models._base import LipsFormerBlock  # the models import this package's neighbours
    blocks = [module for module in model.modules() if isinstance(module, LipsFormerBlock)]
    if not blocks:
        return 0
    if any(isinstance(module, DropPath) and module.drop_prob > 0 for block in blocks for module in block.modules()):
        for block in blocks:
            _replace_drop_paths(block)
    stages = {id(parent) for parent in model.modules() for child in parent.children() if child in blocks}
    limit_name = 'recompile_limit' if hasattr(torch._dynamo.config, 'recompile_limit') else 'cache_size_limit'
    limit = max(getattr(torch._dynamo.config, limit_name), _VARIANTS_PER_STAGE * len(stages))
    setattr(torch._dynamo.config, limit_name, limit)
    for block in blocks:
        block.compile(backend=backend, mode=mode if backend == 'inductor' else None, dynamic=dynamic)
    return len(blocks)


def _replace_drop_paths(block: nn.Module) -> None:
    device = next(block.parameters()).device
    for name, module in list(block.named_modules()):
        if type(module) is DropPath:
            parent_name, _, child_name = name.rpartition('.')
            setattr(block.get_submodule(parent_name), child_name,
                    CompiledDropPath(module.drop_prob, module.scale_by_keep, device=device))


def compile_model(model: nn.Module, scope: str, mode: str | None, device_type: str,
                  backend: str = 'inductor') -> tuple[nn.Module, str]:
    """``model`` compiled: its blocks (:func:`compile_regions`) or the whole model (``torch.compile``).

    Args:
        model: The model, on its device.
        scope: ``regional`` or ``whole``.
        mode: ``torch.compile``'s mode, None for its default (a CUDA-graph mode compiles with static shapes).
        device_type: The device the model runs on (:func:`effective_mode`).
        backend: ``torch.compile``'s backend.

    Returns:
        The model to call (the same module for regional compilation) and the scope that was compiled: ``whole``
        where a regional compilation found no LipsFormer blocks (logged).
    """
    if scope not in COMPILE_SCOPES:
        raise ValueError(f'compile scope {scope!r}: use one of {", ".join(COMPILE_SCOPES)}')
    ran = effective_mode(mode or 'default', device_type) if backend == 'inductor' else None
    if scope == 'regional':
        if compile_regions(model, ran, dynamic=False, backend=backend):
            return model, 'regional'
        _logger.info('%s has no LipsFormer blocks to compile one by one: it is compiled whole', type(model).__name__)
    return torch.compile(model, backend=backend, mode=ran, dynamic=False if mode in CUDA_GRAPH_MODES else None), 'whole'


def keep_own_gradients(model: torch.nn.Module) -> None:
    """Give every trainable parameter a zeroed gradient buffer of its own, so that backward adds into it instead of
    taking over a CUDA graph's output (see the module docstring); zero it with ``zero_grad(set_to_none=False)``."""
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)

