"""Full model and optimizer states from a model that may be wrapped (DDP, torch.compile) or sharded (FSDP).

Optimizer states are keyed by parameter name (``torch.distributed.checkpoint.state_dict``), so a checkpoint does not
depend on the order in which parameters were handed to the optimizer, nor on how the model was sharded.
"""
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..checkpoint import CheckpointError, check_state_dict


def is_sharded(accelerator: Any) -> bool:
    """Whether the model is sharded over processes (FSDP), so that full states must be gathered."""
    return str(accelerator.distributed_type) in ('DistributedType.FSDP', 'FSDP')


def model_state_dict(accelerator: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict with plain parameter names (call on every process: FSDP gathers)."""
    if is_sharded(accelerator):
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return accelerator.unwrap_model(model, keep_torch_compile=False).state_dict()


def set_model_state(accelerator: Any, model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a full state dict into the (possibly wrapped or sharded) model; mismatches raise CheckpointError."""
    if is_sharded(accelerator):
        set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))
        return
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    check_state_dict(unwrapped, state_dict, source='checkpoint model.safetensors')
    unwrapped.load_state_dict(state_dict)


def optimizer_state_dict(accelerator: Any, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """The optimizer's full state keyed by parameter name (call on every process: FSDP gathers)."""
    sharded = is_sharded(accelerator)
    owner = model if sharded else accelerator.unwrap_model(model, keep_torch_compile=False)
    return get_optimizer_state_dict(owner, getattr(optimizer, 'optimizer', optimizer),
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=sharded))


def set_optimizer_state(accelerator: Any, model: torch.nn.Module, optimizer: Any, state_dict: dict[str, Any]) -> None:
    """Load what :func:`optimizer_state_dict` returned; a state for other parameters raises CheckpointError."""
    owner = model if is_sharded(accelerator) else accelerator.unwrap_model(model, keep_torch_compile=False)
    try:
        set_optimizer_state_dict(owner, getattr(optimizer, 'optimizer', optimizer), state_dict,
                                 options=StateDictOptions(full_state_dict=True))
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f'the optimizer state does not fit this model / optimizer ({e}); was the checkpoint '
                              f'saved with another model or optimizer.name?') from e
