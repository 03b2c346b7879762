"""Autocast's weight casts made together: one multi-tensor copy for a group of layers instead of one cast a weight.

Under autocast, each weight of a layer that autocast runs in low precision (linear layers and convolutions) is cast to
bfloat16 or float16 where it is used, one kernel a weight, and its gradient cast back to float32 in backward, another:
on a GPU over a quarter of a LipsFormer training step's launches (docs/performance.md). :class:`GroupedWeightCasts`
casts the weights of each group of layers (a stage, the stem, the head) with one ``torch._foreach_copy_`` before the
forward, which CUDA runs as a few multi-tensor launches, and their gradients back with another, as FSDP2's mixed
precision casts a unit's parameters together. The layers then find their weights in autocast's dtype, which autocast
leaves as they are. A group also casts the alphas that its blocks, in their fast form, fold into those weights
(:func:`lipsformer.fastpath.folded_alphas`, asked on entry): the fold multiplies a weight in autocast's dtype, so it
would cast each alpha there itself, one kernel forward and one backward.

The values are autocast's: the same rounding of the same float32 weights, the same float32 gradients arriving at the
parameters, the optimizer's state untouched. The casts are autograd's: gradients reach each parameter through the
group's backward, so accumulation, clipping, DDP's gradient hooks and the optimizer see the parameters as before (the
group's gradients arrive together, once its last layer's backward has run).

A forward with the casts applied sees, for the duration of the ``with`` block, each cast weight where the module's
parameter was (``module.weight`` is a bfloat16 tensor with a gradient history, not an ``nn.Parameter``). Grouped casts
are for a training step the package runs, eager and under autocast: :func:`refusal_reason` says why they cannot apply
to a model (gradient checkpointing, whose recomputation would see the parameters again; sharded parameters).
"""
import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn

from ..fastpath import folded_alphas
from ..models._base import LipsFormerBlock

__all__ = ['GroupedWeightCasts', 'refusal_reason']

# Layers whose weights autocast casts to its lower precision (their ops are on autocast's lower-precision lists).
LOW_PRECISION_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class _CastTogether(torch.autograd.Function):
    """Float32 tensors to ``dtype`` in one ``_foreach_copy_``, their gradients back in another."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.dtypes = [weight.dtype for weight in weights]
        ctx.set_materialize_grads(False)
        casts = [torch.empty_like(weight, dtype=dtype) for weight in weights]
        torch._foreach_copy_(casts, list(weights))
        return tuple(casts)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        wanted = [index for index, grad in enumerate(grads) if grad is not None and ctx.needs_input_grad[index + 1]]
        results: list[torch.Tensor | None] = [None] * len(grads)
        if wanted:
            sources = [grads[index] for index in wanted]
            targets = [torch.empty_like(source, dtype=ctx.dtypes[index]) for index, source in zip(wanted, sources)]
            torch._foreach_copy_(targets, sources)
            for index, target in zip(wanted, targets):
                results[index] = target
        return None, *results


def _groups(model: nn.Module) -> list[nn.Module]:
    """The model's top-level children, a sequence's (``stages``, ``layers``) item by item."""
    groups = []
    for child in model.children():
        groups.extend(child.children() if isinstance(child, (nn.Sequential, nn.ModuleList)) else [child])
    return groups or [model]


def refusal_reason(model: nn.Module) -> str | None:
    """Why grouped casts cannot apply to ``model``'s training step, or None where they can: they step aside for
    gradient checkpointing (a recomputed forward would see the parameters, not the casts) and for sharded parameters
    (FSDP's modules hold their parameters only during their own forward, and cast them themselves)."""
    for module in model.modules():
        if getattr(module, 'grad_checkpointing', False):
            return 'gradient checkpointing recomputes the forward with the parameters themselves'
        if hasattr(module, '_fsdp_wrapped_module') or type(module).__name__.startswith('FSDP'):
            return 'the parameters are sharded (FSDP casts them itself)'
    return None


class GroupedWeightCasts:
    """The float32 weights and biases of ``model``'s linear layers and convolutions, in groups that are cast
    together under autocast (:meth:`applied`), and the alphas the group's blocks fold into them in their fast form.

    Args:
        model: The model itself, not a wrapper (DDP's): a wrapper's forward reaches these layers all the same.
    """

    def __init__(self, model: nn.Module) -> None:
        seen: set[int] = set()
        self.groups: list[list[tuple[nn.Module, str, nn.Parameter]]] = []
        self.blocks: list[list[nn.Module]] = []  # each group's LipsFormer blocks, asked for their folded alphas
        for group in _groups(model):
            members = []
            for module in group.modules():
                if not isinstance(module, LOW_PRECISION_LAYERS):
                    continue
                for name, param in module.named_parameters(recurse=False):
                    if param.dtype == torch.float32 and id(param) not in seen:
                        seen.add(id(param))
                        members.append((module, name, param))
            if members:
                self.groups.append(members)
                self.blocks.append([module for module in group.modules() if isinstance(module, LipsFormerBlock)])

    def __len__(self) -> int:
        return sum(len(group) for group in self.groups)

    @contextlib.contextmanager
    def applied(self, device_type: str) -> Iterator[None]:
        """Within the block, each weight is its cast to autocast's dtype for ``device_type`` (cast group by group on
        entry), and so is each alpha that a block folds into a weight; outside autocast, or without gradients,
        nothing changes."""
        if not self.groups or not torch.is_autocast_enabled(device_type) or not torch.is_grad_enabled():
            yield
            return
        dtype = torch.get_autocast_dtype(device_type)
        swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
        try:
            for group, blocks in zip(self.groups, self.blocks):
                members = group + [(alpha, 'gamma', alpha.gamma) for block in blocks for alpha in folded_alphas(block)
                                   if isinstance(alpha.gamma, nn.Parameter) and alpha.gamma.dtype == torch.float32]
                casts = _CastTogether.apply(dtype, *(param for _, _, param in members))
                for (module, name, param), cast in zip(members, casts):
                    module._parameters[name] = cast  # type: ignore[assignment]  # a tensor for this forward
                    swapped.append((module, name, param))
            yield
        finally:
            for module, name, param in swapped:
                module._parameters[name] = param
