"""``torch.compile`` in training: whether a run compiles, how, and with which shapes.

- ``model.compile``: ``auto`` compiles where the run trains on a CUDA device and not on the CPU (where inductor's
  first step of a full-size model takes minutes); ``true`` / ``false`` decide for any device. Accelerate's
  dynamo plugin compiles the model in ``accelerator.prepare``, in the order DDP and FSDP2 need; the launcher's
  ``--dynamo_backend`` does not override the config.
- ``model.compile_mode``: inductor's mode. The modes that record CUDA graphs (:data:`CUDA_GRAPH_MODES`) replay one
  graph per input shape, so they compile with static shapes: training batches are always whole (the loader drops an
  epoch's last partial batch) and evaluation batches are padded to the evaluation batch size (padding is labelled -1
  and not scored). A CUDA graph's outputs live in a memory pool its next replay overwrites, so their runs keep the
  gradients in buffers of their own, zeroed between updates instead of freed: a gradient taken over from the pool
  would be overwritten by the next micro-batch of an accumulation window.
- The first training micro-batch of a compiled run (forward, backward and the compilation they trigger) is timed;
  the log and ``summary.json`` (``compile``) give it.
"""
import logging
import os

import torch
from accelerate.utils import TorchDynamoPlugin

from .config import Config

__all__ = ['CUDA_GRAPH_MODES', 'compiles', 'dynamo_plugin', 'keep_own_gradients', 'say_compilation']

_logger = logging.getLogger(__name__)

CUDA_GRAPH_MODES = ('reduce-overhead', 'max-autotune')


def compiles(config: Config, cpu: bool) -> bool:
    """Whether the run compiles its model: ``model.compile``, with ``auto`` meaning a run on a CUDA device.

    Args:
        config: The run's config.
        cpu: Whether the run trains on the CPU although an accelerator may be present (``train.device=cpu``).
    """
    if config.model.compile == 'auto':
        return not cpu and torch.cuda.is_available()
    return bool(config.model.compile)


def dynamo_plugin(config: Config, cpu: bool) -> TorchDynamoPlugin:
    """Accelerate's dynamo plugin for the run: inductor in ``model.compile_mode``, or no compilation."""
    launcher = os.environ.get('ACCELERATE_DYNAMO_BACKEND', 'no').lower()
    if not compiles(config, cpu):
        if launcher not in ('no', ''):
            _logger.warning('the launcher asks for dynamo backend %s; model.compile=%s (on %s) does not compile, set '
                            'model.compile=true to compile', launcher, config.model.compile, 'cpu' if cpu else 'the '
                            'device Accelerate picks')
        return TorchDynamoPlugin(backend='no')
    mode = config.model.compile_mode
    return TorchDynamoPlugin(backend='inductor', mode=mode, dynamic=False if mode in CUDA_GRAPH_MODES else None)


def say_compilation(config: Config, device: torch.device) -> None:
    """Log how the model is compiled (once the run's log file is open)."""
    mode = config.model.compile_mode
    static = mode in CUDA_GRAPH_MODES
    _logger.info('the model is compiled with inductor, mode %s%s; its first step compiles', mode,
                 ' (static shapes)' if static else '')
    if static and device.type != 'cuda':
        _logger.warning('model.compile_mode %s records CUDA graphs, which need a CUDA device; on %s it compiles as '
                        'mode default with static shapes', mode, device.type)


def keep_own_gradients(model: torch.nn.Module) -> None:
    """Give every trainable parameter a zeroed gradient buffer of its own, so that backward adds into it instead of
    taking over a CUDA graph's output (see the module docstring); zero it with ``zero_grad(set_to_none=False)``."""
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)

