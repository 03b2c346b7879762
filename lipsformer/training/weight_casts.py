"""Autocast's weight casts made together: one multi-tensor copy for a group of layers instead of one cast a weight.

Under autocast, each weight of a layer that autocast runs in low precision (linear layers and convolutions) is cast to
bfloat16 or float16 where it is used, one kernel a weight, and its gradient cast back to float32 in backward, another:
on a GPU over a quarter of a LipsFormer training step's launches (docs/performance.md). :class:`GroupedWeightCasts`
casts the weights of each group of layers (a stage, the stem, the head) with one ``torch._foreach_copy_`` before the
forward, which CUDA runs as a few multi-tensor launches, and their gradients back with another, as FSDP2's mixed
precision casts a unit's parameters together. The layers then find their weights in autocast's dtype, which autocast
leaves as they are.

A block in its fast form folds its alphas into the weight and bias of a linear layer (attention's projection, the
MLP's fc2; :func:`lipsformer.fastpath.alpha_folds`, asked on entry), in the weight's dtype: a product for the weight
and one for the bias forward, and six kernels for their gradients and alpha's, for each fold. A group makes those folds
itself, on the casts: the layers of one shape (a stage's projections, its fc2s) stacked, their alphas multiplied in
with one product for the weights and one for the biases, and their gradients likewise, a few kernels a shape and not
eight a layer; the block then finds its alphas folded (``gamma`` is None for the forward) and its layers' weights
scaled.

The values are autocast's: the same rounding of the same float32 weights, the same float32 gradients arriving at the
parameters, the optimizer's state untouched (the folds' products are the block's own fold's, in autocast's dtype,
and their gradients agree with its to that dtype's rounding). The casts are autograd's: gradients reach each
parameter through the group's backward, so accumulation, clipping, DDP's gradient hooks and the optimizer see the
parameters as before (the group's gradients arrive together, once its last layer's backward has run).

A forward with the casts applied sees, for the duration of the ``with`` block, each cast weight where the module's
parameter was (``module.weight`` is a bfloat16 tensor with a gradient history, not an ``nn.Parameter``). Grouped casts
are for an eager training step the package runs under autocast: :func:`refusal_reason` says why they cannot apply
to a model (gradient checkpointing, whose recomputation would see the parameters again; sharded parameters).
"""
import contextlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn as nn

from ..fastpath import alpha_folds
from ..models._base import LipsFormerBlock

__all__ = ['GroupedWeightCasts', 'refusal_reason']

# Layers whose weights autocast casts to its lower precision (their ops are on autocast's lower-precision lists).
LOW_PRECISION_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


class _Folds(NamedTuple):
    """Linear layers of one shape whose alphas are folded into their casts: indices of the cast tensors."""
    weights: tuple[int, ...]
    biases: tuple[int, ...] | None  # None: layers without biases
    alphas: tuple[int, ...]


def _stacked(tensors: list[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
    """``tensors`` stacked as ``like`` (zeros for None); a single tensor as a view."""
    if len(tensors) == 1 and tensors[0] is not None:
        return tensors[0].unsqueeze(0)
    return torch.stack([torch.zeros_like(like[0]) if tensor is None else tensor for tensor in tensors])


class _CastTogether(torch.autograd.Function):
    """Float32 tensors to ``dtype`` in one ``_foreach_copy_``, their gradients back in another; for each of ``folds``,
    the casts of the layers' weights and biases times their alphas, in one product a stack."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, folds: tuple[_Folds, ...], *tensors: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        ctx.dtypes = [tensor.dtype for tensor in tensors]
        ctx.folds = folds
        ctx.set_materialize_grads(False)
        casts: list[torch.Tensor | None] = [None] * len(tensors)
        stacks = []  # each fold's (weights, biases, alphas), cast into stacks that the copy fills
        for fold in folds:
            stack = []
            for indices in fold:
                if indices is None:
                    stack.append(None)
                    continue
                first = tensors[indices[0]]
                stack.append(first.new_empty((len(indices), *first.shape), dtype=dtype))
                for position, index in enumerate(indices):
                    casts[index] = stack[-1][position]
            stacks.append(stack)
        casts = [torch.empty_like(tensor, dtype=dtype) if cast is None else cast
                 for tensor, cast in zip(tensors, casts)]
        torch._foreach_copy_(casts, list(tensors))
        outputs = list(casts)
        for fold, (weights, biases, alphas) in zip(folds, stacks):
            _scatter(outputs, fold.weights, weights * alphas.unsqueeze(-1))
            if biases is not None:
                _scatter(outputs, fold.biases, biases * alphas)
        ctx.save_for_backward(*(stack for fold_stacks in stacks for stack in fold_stacks if stack is not None))
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        grads = list(grads)
        saved = iter(ctx.saved_tensors)
        for fold in ctx.folds:
            weights, biases, alphas = next(saved), None if fold.biases is None else next(saved), next(saved)
            # a layer the forward did not reach gets no gradient, as autocast's casts give none
            reached = [grads[index] is not None for index in fold.weights]
            if not any(reached):
                continue
            need_alphas = any(ctx.needs_input_grad[index + 2] for index in fold.alphas)  # not fixed alphas
            grad_scaled = _stacked([grads[index] for index in fold.weights], weights)
            grad_alphas = (grad_scaled * weights).sum(-1) if need_alphas else None
            _scatter(grads, fold.weights, grad_scaled * alphas.unsqueeze(-1), reached)
            if fold.biases is not None:
                grad_scaled = _stacked([grads[index] for index in fold.biases], biases)
                grad_alphas = torch.addcmul(grad_alphas, grad_scaled, biases) if need_alphas else None
                _scatter(grads, fold.biases, grad_scaled * alphas, reached)
            if need_alphas:
                _scatter(grads, fold.alphas, grad_alphas, reached)
        wanted = [index for index, grad in enumerate(grads) if grad is not None and ctx.needs_input_grad[index + 2]]
        results: list[torch.Tensor | None] = [None] * len(grads)
        if wanted:
            sources = [grads[index] for index in wanted]
            targets = [torch.empty_like(source, dtype=ctx.dtypes[index]) for index, source in zip(wanted, sources)]
            torch._foreach_copy_(targets, sources)
            for index, target in zip(wanted, targets):
                results[index] = target
        return None, None, *results


def _scatter(tensors: list[torch.Tensor | None], indices: tuple[int, ...], stack: torch.Tensor,
             reached: list[bool] | None = None) -> None:
    """``tensors[indices[i]] = stack[i]``, or None where ``reached[i]`` is False."""
    for position, index in enumerate(indices):
        tensors[index] = stack[position] if reached is None or reached[position] else None


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
        self.blocks: list[list[nn.Module]] = []  # each group's LipsFormer blocks, asked for their alpha folds
        self.positions: list[dict[int, int]] = []  # each group's parameters by id: their places in the group
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
                self.positions.append({id(param): position for position, (_, _, param) in enumerate(members)})
                self.blocks.append([module for module in group.modules() if isinstance(module, LipsFormerBlock)])

    def __len__(self) -> int:
        return sum(len(group) for group in self.groups)

    @contextlib.contextmanager
    def applied(self, device_type: str) -> Iterator[None]:
        """Within the block, each weight is its cast to autocast's dtype for ``device_type`` (cast group by group on
        entry), the weight and bias of each linear layer into which a block in its fast form folds an alpha are
        their casts times that alpha, and the alpha's ``gamma`` is None; outside autocast, or without gradients,
        nothing changes."""
        if not self.groups or not torch.is_autocast_enabled(device_type) or not torch.is_grad_enabled():
            yield
            return
        dtype = torch.get_autocast_dtype(device_type)
        swapped: list[tuple[dict[str, torch.Tensor | None], str, torch.Tensor]] = []
        try:
            for group, positions, blocks in zip(self.groups, self.positions, self.blocks):
                members, folds = _with_folds(group, positions, blocks)
                casts = _CastTogether.apply(dtype, folds, *(tensor for _, _, tensor in members))
                for position, ((module, name, tensor), cast) in enumerate(zip(members, casts)):
                    slots = module._parameters if name in module._parameters else module._buffers
                    # past the group's own members, the folded alphas: each is in its layer's cast
                    slots[name] = cast if position < len(group) else None
                    swapped.append((slots, name, tensor))
            yield
        finally:
            for slots, name, tensor in swapped:
                slots[name] = tensor


def _with_folds(group: list[tuple[nn.Module, str, torch.Tensor]], positions: dict[int, int], blocks: list[nn.Module]
                ) -> tuple[list[tuple[nn.Module, str, torch.Tensor]], tuple[_Folds, ...]]:
    """A group's members followed by the float32 alphas its blocks fold into its float32 linear layers (``positions``:
    the members' places by id), and those folds by the layers' shape."""
    members = list(group)
    by_shape: dict[tuple[tuple[int, ...], bool], list[tuple[int, int | None, int]]] = {}
    for block in blocks:
        for alpha, linear in alpha_folds(block):
            weight, bias, gamma = positions.get(id(linear.weight)), linear.bias, alpha.gamma
            bias_position = None if bias is None else positions.get(id(bias))
            if (weight is None or (bias is not None and bias_position is None) or gamma is None
                    or gamma.dtype != torch.float32 or gamma.shape != linear.weight.shape[:1]):
                continue
            members.append((alpha, 'gamma', gamma))
            key = (tuple(linear.weight.shape), bias is not None)
            by_shape.setdefault(key, []).append((weight, bias_position, len(members) - 1))
    folds = tuple(_Folds(tuple(weight for weight, _, _ in layers),
                         tuple(bias for _, bias, _ in layers) if has_bias else None,
                         tuple(alpha for _, _, alpha in layers))
                  for (_, has_bias), layers in by_shape.items())
    return members, folds
