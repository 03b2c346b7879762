"""Parameter and multiply-accumulate (MAC) counts of any timm model, without materialising its weights.

MACs are counted with ``torch.utils.flop_counter.FlopCounterMode``, which counts 2 FLOPs per MAC, so
``macs = flops / 2``. It counts matmuls, linear layers, convolutions (grouped and depthwise included, since the
formula uses the weight's per-group shape) and attention, whether written as explicit ``q @ k^T`` / ``attn @ v``
matmuls or as ``torch.nn.functional.scaled_dot_product_attention`` (on the meta device SDPA decomposes into two
``bmm``; every fused kernel it may dispatch to on CPU, CUDA, MPS or an out-of-tree backend is counted by one formula
of ours, ``SDPA_FLOP_FORMULAS``, so a model's count does not depend on the torch release or the kernel).
Element-wise ops, norms, softmax and pooling are not counted: the convention of the Swin, CSwin and LipsFormer
papers, whose "FLOPs" are MACs.

By default the model is built inside ``with torch.device('meta'):`` and run on a meta input, so no weight is ever
allocated: counting a billion-parameter model takes about a second and a few MB.

Example:
    >>> import lipsformer
    >>> from lipsformer.instruments.complexity import model_complexity
    >>> info = model_complexity('swin_tiny_patch4_window7_224')
    >>> round(info['params'] / 1e6, 2), round(info['gmacs'], 2)
    (28.29, 4.49)

Command line (the README model table is made with ``--markdown``)::

    python -m lipsformer.instruments.complexity --models 'lipsformer*' --markdown
"""
import argparse
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..utils.cli import command_name, usage_error
from ..weights.model_names import create_model, expand_model_names

__all__ = ['SDPA_FLOP_FORMULAS', 'build_model', 'complexity_table', 'count_macs', 'model_complexity']

ModelSource = str | nn.Module | Callable[..., nn.Module]

_aten = torch.ops.aten


def _attention_macs(query_shape: Sequence[int], key_shape: Sequence[int], value_shape: Sequence[int]) -> int:
    """MACs of softmax(q k^T) v: one (Lq x d_qk) @ (d_qk x Lk) and one (Lq x Lk) @ (Lk x d_v) product per head."""
    *batch_heads, len_q, dim_qk = query_shape
    len_k, dim_v = key_shape[-2], value_shape[-1]
    # Grouped-query attention broadcasts k and v over the query heads, so the query's leading dims count.
    return math.prod(batch_heads) * len_q * len_k * (dim_qk + dim_v)


def _attention_backward_macs(query_shape: Sequence[int], key_shape: Sequence[int], value_shape: Sequence[int]) -> int:
    """MACs of a fused SDPA backward: recompute q k^T, then dV = P^T dO, dP = dO V^T, dQ = dS K and dK = dS^T Q."""
    *batch_heads, len_q, dim_qk = query_shape
    len_k, dim_v = key_shape[-2], value_shape[-1]
    return math.prod(batch_heads) * len_q * len_k * (3 * dim_qk + 2 * dim_v)


def _sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * _attention_macs(query_shape, key_shape, value_shape)


def _sdpa_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * _attention_backward_macs(query_shape, key_shape, value_shape)


# The fused kernels that ``F.scaled_dot_product_attention`` dispatches to: CUDA flash, memory-efficient and cuDNN,
# the CPU flash kernel, the ``overrideable`` kernel of out-of-tree backends (XPU, HPU) and MPS's math kernel. All take
# (batch, heads, length, dim) q, k, v first; their backward kernels take the output's gradient before them.
_SDPA_KERNELS = ('flash_attention', 'flash_attention_for_cpu', 'efficient_attention', 'cudnn_attention',
                 'fused_attention_overrideable', 'attention_math_for_mps')


def _sdpa_formulas() -> dict:
    formulas = {}
    for kernel in _SDPA_KERNELS:
        for suffix, formula in (('', _sdpa_flops), ('_backward', _sdpa_backward_flops)):
            op = getattr(_aten, f'_scaled_dot_product_{kernel}{suffix}', None)  # each torch release has a subset
            if op is not None:
                formulas[op] = formula
    return formulas


# Passed to FlopCounterMode as ``custom_mapping``, so every kernel is counted by the formula above whatever the
# installed torch ships (torch 2.14's registry, for one, has none for the CPU and overrideable kernels), and
# torch's own registry is left as it is. Fused and explicit attention then count the same on every torch.
SDPA_FLOP_FORMULAS = _sdpa_formulas()


def build_model(source: str | Callable[..., nn.Module], img_size: int | tuple[int, int] | None = None,
                device: str | torch.device = 'meta', **create_kwargs: Any) -> nn.Module:
    """Build a model on ``device`` (meta by default: shapes only, no memory, no init cost).

    Args:
        source: a timm model name, or a callable returning an ``nn.Module`` (called with ``create_kwargs``).
        img_size: passed to the constructor as ``img_size`` so size-dependent parts (position embeddings, window
            masks) match the input; dropped for constructors that do not take it (CNNs).
        device: where the parameters are created.
        **create_kwargs: forwarded to :func:`lipsformer.weights.model_names.create_model` (``timm.create_model`` with
        its
            checks of ``local-dir:`` and ``hf-hub:`` names) or to the callable.

    Returns:
        The model in eval mode.
    """
    def create(**kwargs: Any) -> nn.Module:
        return create_model(source, **kwargs) if isinstance(source, str) else source(**kwargs)

    with torch.device(device):
        if img_size is None:
            return create(**create_kwargs).eval()
        try:
            return create(img_size=img_size, **create_kwargs).eval()
        except TypeError as error:
            if "'img_size'" not in str(error):
                raise
            return create(**create_kwargs).eval()


def count_macs(model: nn.Module, inputs: torch.Tensor, module_depth: int = 0) -> tuple[int, dict[str, int]]:
    """Count the MACs of one eval-mode forward of ``model`` on ``inputs``.

    Args:
        model: the model; its parameters and ``inputs`` must be on the same device (meta works).
        inputs: the input batch.
        module_depth: also return the MACs of every submodule up to this depth (0: none).

    Returns:
        Total MACs of the batch and a ``{submodule name: MACs}`` dict (names relative to the model, e.g.
        ``'layers.0.blocks.1.attn'``).
    """
    # Parameters that require grad make FlopCounterMode's module tracker install backward hooks, which fail when a
    # parameter is itself a submodule's input (attention-pool latents); a forward-only count needs no autograd.
    requires_grad = [parameter.requires_grad for parameter in model.parameters()]
    model.requires_grad_(False)
    try:
        with FlopCounterMode(display=False, custom_mapping=SDPA_FLOP_FORMULAS) as counter, torch.no_grad():
            model(inputs)
    finally:
        for parameter, flag in zip(model.parameters(), requires_grad):
            parameter.requires_grad_(flag)
    per_module = {}
    for name, counts in counter.get_flop_counts().items():
        parts = name.split('.')[1:]  # drop the root's class name ('Global' is dropped as a one-part name)
        if parts and len(parts) <= module_depth:
            per_module['.'.join(parts)] = sum(counts.values()) // 2
    return counter.get_total_flops() // 2, per_module


def _input_channels(model: nn.Module, create_kwargs: dict[str, Any]) -> int:
    if 'in_chans' in create_kwargs:
        return create_kwargs['in_chans']
    cfg = getattr(model, 'pretrained_cfg', None) or {}
    return cfg.get('input_size', (3,))[0]


def _model_device(model: nn.Module) -> torch.device:
    tensor = next(iter(model.parameters()), None)
    if tensor is None:
        tensor = next(iter(model.buffers()), None)
    return tensor.device if tensor is not None else torch.device('cpu')


def _display_name(source: ModelSource) -> str:
    if isinstance(source, str):
        return source
    if isinstance(source, nn.Module):
        return type(source).__name__
    return getattr(source, '__qualname__', repr(source))


def model_complexity(model_or_name: ModelSource, img_size: int | tuple[int, int] | None = 224, batch_size: int = 1,
                     device: str | torch.device = 'meta', module_depth: int = 0, **create_kwargs: Any) -> dict:
    """Parameter count and forward MACs of a model at one input size.

    Args:
        model_or_name: a timm model name (``lipsformer`` models included), a callable returning an ``nn.Module``, or
            a built ``nn.Module`` (counted where its parameters live, with a real input there if not on meta).
        img_size: input height and width (int or ``(H, W)``); None uses the model's default
            (``pretrained_cfg['input_size']``). For names it is also passed to the constructor (see ``build_model``).
        batch_size: images per counted forward; MACs are reported per image.
        device: where names and callables are built: ``'meta'`` (no memory) or a real device for models whose
            construction or forward is data-dependent (e.g. calls ``.item()``), which meta cannot run.
        module_depth: also report per-submodule GMACs per image up to this depth.
        **create_kwargs: forwarded to ``timm.create_model`` or to the callable (e.g. ``num_classes``,
            ``window_size``); ``in_chans`` also sets the input channels (default: ``pretrained_cfg``, else 3), and is
            the only one accepted with a built model.

    Returns:
        dict with ``model``, ``input_size`` (C, H, W), ``batch_size``, ``params`` (number of parameters, buffers
        excluded, as timm counts), ``macs`` (int, per image), ``gmacs`` (per image, 1e9 MACs), ``gflops``
        (2 x gmacs) and, if ``module_depth`` > 0, ``gmacs_by_module``.

    Raises:
        RuntimeError: the model cannot be built or run on the meta device; the message says to pass ``device='cpu'``.
    """
    if isinstance(model_or_name, nn.Module):
        if set(create_kwargs) - {'in_chans'}:
            raise TypeError(f'a built model cannot take constructor arguments {sorted(create_kwargs)}; pass its name '
                            'or a factory instead')
        model = model_or_name
        device = _model_device(model)
    else:
        model = _build_for_counting(model_or_name, img_size, device, create_kwargs)
    if img_size is None:
        img_size = (getattr(model, 'pretrained_cfg', None) or {}).get('input_size', (3, 224, 224))[1:]
    height, width = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
    input_size = (_input_channels(model, create_kwargs), height, width)
    inputs = torch.empty(batch_size, *input_size, device=device)
    was_training = model.training
    model.eval()
    try:
        macs, per_module = count_macs(model, inputs, module_depth)
    except (NotImplementedError, RuntimeError) as error:
        if torch.device(device).type != 'meta':
            raise
        raise RuntimeError(f'counting {_display_name(model_or_name)} on the meta device failed in its forward '
                           f'({type(error).__name__}: {error}); count it on a real device with device="cpu"') from error
    finally:
        model.train(was_training)
    result = {
        'model': _display_name(model_or_name),
        'input_size': input_size,
        'batch_size': batch_size,
        'params': sum(parameter.numel() for parameter in model.parameters()),
        'macs': macs // batch_size,
        'gmacs': macs / batch_size / 1e9,
        'gflops': 2 * macs / batch_size / 1e9,
    }
    if module_depth > 0:
        result['gmacs_by_module'] = {name: value / batch_size / 1e9 for name, value in per_module.items()}
    return result


def _build_for_counting(source: str | Callable[..., nn.Module], img_size: int | tuple[int, int] | None,
                        device: str | torch.device, create_kwargs: dict[str, Any]) -> nn.Module:
    try:
        return build_model(source, img_size=img_size, device=device, **create_kwargs)
    except (NotImplementedError, RuntimeError) as error:
        if torch.device(device).type != 'meta':
            raise
        raise RuntimeError(f'building {_display_name(source)} on the meta device failed ({type(error).__name__}: '
                           f'{error}); its constructor needs real tensors, count it with device="cpu"') from error


def complexity_table(rows: list[dict], markdown: bool = False) -> str:
    """Format ``model_complexity`` results as an aligned text table or a Markdown table."""
    header = ['model', 'input', 'params (M)', 'GMACs']
    lines = [[row['model'], 'x'.join(str(size) for size in row['input_size'][1:]), f'{row["params"] / 1e6:.2f}',
              f'{row["gmacs"]:.2f}'] for row in rows]
    if markdown:
        return '\n'.join(['| ' + ' | '.join(header) + ' |', '|---|---|---:|---:|'] +
                         ['| ' + ' | '.join(line) + ' |' for line in lines])
    widths = [max(len(line[col]) for line in [header] + lines) for col in range(len(header))]
    return '\n'.join('  '.join(cell.ljust(width) if col == 0 else cell.rjust(width)
                               for col, (cell, width) in enumerate(zip(line, widths))) for line in [header] + lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=command_name('lipsformer.instruments.complexity'),
                                     description='Parameters and GMACs (multiply-accumulates, attention included) '
                                                 'of timm models, counted on the meta device.')
    parser.add_argument('--models', required=True,
                        help="comma list of timm model names or wildcard patterns, e.g. 'lipsformer*'")
    parser.add_argument('--img-size', type=int, default=None,
                        help="input height and width (default: each model's own default input size)")
    parser.add_argument('--num-classes', type=int, default=None, help='classifier size (default: the model default)')
    parser.add_argument('--markdown', action='store_true', help='print a Markdown table')
    args = parser.parse_args(argv)
    try:
        names = expand_model_names(args.models)
    except ValueError as error:
        usage_error(parser, str(error))
    create_kwargs = {} if args.num_classes is None else {'num_classes': args.num_classes}
    rows = [model_complexity(name, img_size=args.img_size, **create_kwargs) for name in names]
    print(complexity_table(rows, markdown=args.markdown))


if __name__ == '__main__':
    main()
