"""Kernels, bytes and dispatched ops of one eager CUDA step, counted without a GPU.

Example (the table of ``docs/performance.md``)::

    python -m lipsformer.instruments.kernel_count --models 'swin_tiny_patch4_window7_224,lipsformer_swin_tiny' \\
        --batch-size 128

The model is built on the meta device and its parameters and buffers are replaced by fake CUDA tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``: shapes, dtypes and devices, no storage and no compute), so the
model's code takes the branches it takes on a GPU (``x.device.type == 'cuda'``), and ``torch.autocast('cuda')`` runs
with CUDA's op lists. One step runs as the benchmark's (:func:`lipsformer.instruments.benchmark._make_step`) does: for
``train`` a forward under autocast, the loss, a backward and the AdamW step as the benchmark builds it; for ``infer`` a
forward without gradients. A ``TorchDispatchMode`` under the fake mode records every aten op that reaches a backend.

What is counted (the rules, also in ``docs/performance.md``):

- **dispatched ops**: every aten op the dispatch mode sees, views, allocations and host-side ops included.
- **kernels**: ops that launch GPU work. An op launches nothing if none of its tensors is on CUDA (the optimizer's
  step counters live on the host), if it only makes a view (every return aliases an input without writing it:
  ``view``, ``transpose``, ``expand``, ``split``, ``detach``, ...), or if it only allocates or reinterprets
  (:data:`NON_KERNEL_OPS`: ``empty``, ``empty_strided``, ``_unsafe_view``, ...). A multi-tensor ``_foreach_*`` or
  fused optimizer op counts the launches that CUDA's ``multi_tensor_apply`` makes for its tensor lists
  (:func:`multi_tensor_launches`); every other op counts one kernel.
- **bytes moved by non-matmul ops**: the sizes of every input and output tensor of a kernel (an in-place op's tensor
  once read and once written) other than the matmul, convolution and attention ops of :data:`MATMUL_OPS`, whose
  traffic depends on tiling: the elementwise, reduction, copy and normalisation traffic that a fusion would remove.
- **backward**: run by a small engine here, since autograd's own engine needs a real CUDA device: the graph's nodes
  are called in autograd's dependency order, gradients for one input summed (one add each), and each gradient cast
  or summed to the shape and dtype its input recorded, as the engine's ``validate_outputs`` does.
- **parts**: a forward op belongs to the innermost module of the model on the Python stack when it dispatched (no
  hooks: hooks would make the package's fast path step aside); a backward op to the forward part whose op created
  the autograd node being run (by its sequence number); the loss, the optimizer, the gradient accumulation into
  ``.grad`` and the weights cast together for autocast (``lipsformer.training.weight_casts``, as the training step
  casts them unless a spec says ``grouped_weight_casts=False``) are parts of their own.
- **convolution layouts**: each convolution's kind (depthwise, pointwise, dense) and the memory layout of its image
  input and output (:func:`convolution_layout`), as a GPU of compute capability 8.0 or more lays them out
  (:func:`cuda_convolution_layout`).
"""

import argparse
import contextlib
import dataclasses
import math
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from timm.optim import create_optimizer_v2
from torch import nn

try:  # torch < 2.7 names it without the suffix
    from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense
except ImportError:
    from torch._prims_common import is_non_overlapping_and_dense
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from lipsformer.fastpath import set_fast_path, use_fast_path
from lipsformer.instruments.complexity import build_model
from lipsformer.instruments.model_specs import (
    MODES,
    PRECISIONS,
    ModelSpec,
    add_step_arguments,
    check_report_path,
    parse_model_specs,
    rejected_argument_message,
    step_loss,
    step_modes,
    write_json_report,
)
from lipsformer.training.weight_casts import GroupedWeightCasts
from lipsformer.utils.cli import command_name, usage_error

__all__ = ['CONVOLUTION_OPS', 'MATMUL_OPS', 'NON_KERNEL_OPS', 'StepCount', 'compiled_spec_reason',
           'convolution_layout', 'count_models', 'count_step', 'cuda_convolution_layout', 'cuda_sdp_choice',
           'format_count_json_table', 'format_count_table', 'format_layouts', 'group_of', 'multi_tensor_launches',
           'main']

_aten = torch.ops.aten
# Ops whose traffic depends on their tiling (matmuls, convolutions, attention): no bytes are counted for them. The
# package's depthwise convolution op counts as the convolutions it stands in for, so that the two paths compare.
MATMUL_OPS = frozenset({
    'mm', 'addmm', 'bmm', 'baddbmm', 'addbmm', '_addmm_activation', '_scaled_mm', 'convolution',
    'convolution_backward', 'cudnn_convolution', 'cudnn_convolution_transpose', '_convolution',
    'depthwise_conv2d', 'depthwise_conv2d_backward',
    '_scaled_dot_product_flash_attention', '_scaled_dot_product_flash_attention_backward',
    '_scaled_dot_product_efficient_attention', '_scaled_dot_product_efficient_attention_backward',
    '_scaled_dot_product_cudnn_attention', '_scaled_dot_product_cudnn_attention_backward',
    '_flash_attention_forward', '_flash_attention_backward', '_efficient_attention_forward',
    '_efficient_attention_backward', '_scaled_dot_product_fused_attention_overrideable',
    '_scaled_dot_product_fused_attention_overrideable_backward',
})
SDPA_OPS = frozenset(name for name in MATMUL_OPS if 'attention' in name)
# Ops that allocate or reinterpret memory without launching a kernel (views are found from their schemas).
NON_KERNEL_OPS = frozenset({
    'empty', 'empty_strided', 'empty_like', 'new_empty', 'new_empty_strided', '_unsafe_view', 'lift_fresh',
    'resize_', 'set_', 'record_stream', '_local_scalar_dense', 'sym_size', 'sym_stride', 'sym_numel',
    'sym_storage_offset', 'is_same_size', '_has_compatible_shallow_copy_type', 'is_pinned', '_fused_sdp_choice',
})
# CUDA's multi_tensor_apply (ATen/native/cuda/MultiTensorApply.cuh): tensors and blocks per launch, by the number
# of tensor lists; every tensor is cut into chunks of 65536 elements, one block each.
_MAX_TENSORS = (110, 64, 48, 36, 30)
_MAX_TENSORS_SCALAR_LIST = (96, 64, 48, 36, 30)
_MAX_BLOCKS = 320
_CHUNK = 65536


def multi_tensor_launches(numels: list[int], depth: int, scalar_list: bool = False) -> int:
    """Kernels that CUDA's ``multi_tensor_apply`` launches for ``depth`` tensor lists of tensors of ``numels``.

    A launch takes up to a depth-dependent number of tensors and up to 320 chunks of 65536 elements; it is launched
    when either is full, and once more for what is left at the end.
    """
    max_tensors = (_MAX_TENSORS_SCALAR_LIST if scalar_list else _MAX_TENSORS)[min(depth, 5) - 1]
    launches = tensors = blocks = 0
    for numel in numels:
        if numel == 0:
            continue
        tensors += 1
        chunks = math.ceil(numel / _CHUNK)
        for chunk in range(chunks):
            blocks += 1
            tensors_full = tensors == max_tensors and chunk == chunks - 1
            if tensors_full or blocks == _MAX_BLOCKS:
                launches += 1
                blocks = 0
                # A tensor cut between two launches starts the next one.
                tensors = 0 if chunk == chunks - 1 else 1
    return launches + (blocks > 0)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _is_view(func: torch._ops.OpOverload) -> bool:
    """Every return aliases an input without writing it (``view``, ``split``, ``detach``...)."""
    returns = func._schema.returns
    return bool(returns) and all(ret.alias_info is not None and not ret.alias_info.is_write for ret in returns)


def _op_kernels(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any) -> int:
    """GPU kernels one dispatched op launches (the rules of the module docstring)."""
    name = func._schema.name.split('::')[-1]
    inputs = _tensors((args, kwargs))
    if not any(tensor.device.type == 'cuda' for tensor in inputs + _tensors(out)):
        return 0
    if name in NON_KERNEL_OPS or _is_view(func):
        return 0
    if name.startswith('_foreach_') or name.startswith('_fused_'):
        lists = [arg for arg in args if isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], torch.Tensor)]
        if not lists:
            return 1
        in_place = name.endswith('_') or name.startswith('_fused_')
        depth = len(lists) + (0 if in_place else 1)
        scalar_list = any(isinstance(arg, (list, tuple)) and arg and not isinstance(arg[0], torch.Tensor)
                          for arg in args)
        return multi_tensor_launches([tensor.numel() for tensor in lists[0]], depth, scalar_list)
    return 1


def _op_bytes(func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: Any) -> int:
    """Bytes read and written by a non-matmul kernel: its input and output tensors (an in-place op's once each)."""
    inputs, outputs = _tensors((args, kwargs)), _tensors(out)
    return sum(_nbytes(tensor) for tensor in inputs + outputs if tensor.device.type == 'cuda')


CONVOLUTION_OPS = frozenset({'convolution', 'convolution_backward', 'depthwise_conv2d', 'depthwise_conv2d_backward'})


def _layout(tensor: torch.Tensor) -> str:
    """``channels-last`` or ``channels-first``: the memory format PyTorch's convolution dispatch reads from a 4-D
    tensor (``suggest_memory_format``), which for a depthwise convolution on CUDA decides between cuDNN and PyTorch's
    own kernels."""
    return 'channels-last' if torch._prims_common.suggest_memory_format(tensor) == torch.channels_last \
        else 'channels-first'


def cuda_convolution_layout(func: torch._ops.OpOverload, args: tuple, out: Any) -> Any:
    """A fake CUDA convolution's (or its backward's) outputs in the memory layout a GPU of compute capability 8.0 or
    more gives them.

    Fake tensors have no device to ask, and PyTorch sends a bfloat16 convolution to cuDNN only where the device says
    it supports bfloat16 convolutions (``supportsBFloat16ConvolutionWithCuDNNv8``, compute capability >= 8.0): without
    one it picks its slow im2col kernels, whose outputs are channels-first whatever the input's layout. On an A100,
    H100 or H200 cuDNN takes them, as it takes float16 ones, and keeps a channels-last input's layout; the backend
    is chosen here as for float16 tensors of the same shapes and strides, and the outputs given its layout.
    """
    image, weight = (args[0], args[1]) if func is _aten.convolution.default else (args[1], args[2])
    if image.device.type != 'cuda' or torch.bfloat16 not in (image.dtype, weight.dtype) or image.dim() != 4:
        return out
    stand_ins = [torch.empty_strided(tensor.shape, tensor.stride(), dtype=torch.float16, device=tensor.device)
                 for tensor in (image, weight)]
    if func is _aten.convolution.default:
        bias, options = args[2], args[3:9]
        backend = torch._C._select_conv_backend(*stand_ins, None if bias is None else bias.half(), *options, None)
    else:
        backend = torch._C._select_conv_backend(*stand_ins, None, *args[4:10], args[3])
    memory_format = torch._C._conv_determine_backend_memory_format(*stand_ins, backend)

    def laid_out(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return tensor if tensor is None or tensor.dim() != 4 else tensor.contiguous(memory_format=memory_format)

    if func is _aten.convolution.default:
        return laid_out(out)
    return laid_out(out[0]), laid_out(out[1]), out[2]


def convolution_layout(name: str, args: tuple, out: Any) -> str:
    """What kind of 2-D convolution a convolution op is and the memory layout of its image input and output:
    ``'depthwise channels-last -> channels-last'``. Kinds: ``depthwise`` (a group a channel), ``pointwise`` (1x1, one
    group: a product over channels a GEMM computes without a convolution kernel), ``dense`` (the others). The
    package's ``depthwise_conv2d`` op takes and returns NHWC maps, channels-last by construction; a backward's output
    is its input gradient (none where only the weight's is asked for)."""
    if name.startswith('depthwise_conv2d'):
        return 'depthwise channels-last -> channels-last'
    if name == 'convolution':
        image, weight, groups, result = args[0], args[1], args[8], out
    else:  # convolution_backward(grad_output, input, weight, ..., groups, output_mask)
        image, weight, groups, result = args[1], args[2], args[9], out[0]
    if image.dim() != 4:
        return f'{image.dim() - 2}-d convolution'
    if groups > 1 and groups == image.shape[1]:
        kind = 'depthwise'
    elif groups == 1 and all(size == 1 for size in weight.shape[2:]):
        kind = 'pointwise'
    else:
        kind = 'dense'
    produced = _layout(result) if isinstance(result, torch.Tensor) else 'none'
    return f'{kind} {_layout(image)} -> {produced}'


def _sdp_priority_order() -> list[int]:
    """torch's order of preference among the SDPA kernels (settable since torch 2.7; before, this fixed one)."""
    if hasattr(torch._C, '_get_sdp_priority_order'):
        return [int(backend) for backend in torch._C._get_sdp_priority_order()]
    backends = torch._C._SDPBackend
    return [int(backend) for backend in (backends.FLASH_ATTENTION, backends.EFFICIENT_ATTENTION, backends.MATH,
                                         backends.CUDNN_ATTENTION)]


def cuda_sdp_choice(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                    scale: float | None = None, enable_gqa: bool = False) -> int:
    """The SDPA backend that ``scaled_dot_product_attention`` picks on a CUDA GPU of compute capability 8.0 or more
    (A100, H100, H200), as ``torch._C._SDPBackend``'s value: the first of torch's priority order
    (``torch._C._get_sdp_priority_order()``: flash, memory-efficient, math, cuDNN) that is enabled and takes the
    inputs. Without a GPU, torch itself would answer math.

    Flash takes fp16 or bf16 inputs without a mask, head dims equal, at most 256 and a multiple of 8; the
    memory-efficient kernel also takes fp32 and a mask (no grouped-query attention), head dims a multiple of 8
    (of 4 in fp32); both need the last dimension contiguous.
    """
    tensors = (query, key, value)
    dense = all(tensor.dim() == 4 and tensor.stride(-1) == 1 for tensor in tensors)
    same_dtype = len({tensor.dtype for tensor in tensors}) == 1
    head_dim, value_dim = query.shape[-1], value.shape[-1]
    half = query.dtype in (torch.float16, torch.bfloat16)
    fits = {
        int(torch._C._SDPBackend.FLASH_ATTENTION): (
            torch.backends.cuda.flash_sdp_enabled() and dense and same_dtype and half and attn_mask is None
            and head_dim == key.shape[-1] == value_dim and head_dim <= 256 and head_dim % 8 == 0),
        int(torch._C._SDPBackend.EFFICIENT_ATTENTION): (
            torch.backends.cuda.mem_efficient_sdp_enabled() and dense and same_dtype and not enable_gqa
            and (half or query.dtype == torch.float32) and head_dim == key.shape[-1]
            and head_dim % (8 if half else 4) == 0 and value_dim % (8 if half else 4) == 0),
        int(torch._C._SDPBackend.MATH): torch.backends.cuda.math_sdp_enabled(),
    }
    for backend in _sdp_priority_order():
        if fits.get(int(backend), False):
            return int(backend)
    return int(torch._C._SDPBackend.MATH)


def _preprocess_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The mask as the memory-efficient kernel takes it (``preprocess_mask`` of ATen's ``attention.cpp``): boolean
    masks as additive float masks, expanded to four dimensions, the last padded to a multiple of 16, made contiguous
    where a stride is not a multiple of 16 (a broadcast mask becomes a full-size copy)."""
    if mask.dtype == torch.bool:
        mask = torch.where(mask.logical_not(), -math.inf, torch.scalar_tensor(0.0, dtype=query.dtype,
                                                                               device=mask.device))
    mask = mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    if mask.stride(-2) % 16:
        length = mask.shape[-1]
        mask = F.pad(mask, (0, 16 - length % 16))[..., :length]
    if any(stride % 16 or stride == 0 for stride in mask.stride()):
        mask = mask.contiguous()
    return mask


def cuda_scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                      is_causal: bool = False, scale: float | None = None,
                                      enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as it runs on a CUDA GPU, for fake CUDA tensors.

    Without a GPU, torch's choice of kernel (a CUDA function called directly, not an op a mode could answer) is
    math; this runs the kernel :func:`cuda_sdp_choice` picks, with CUDA autocast's casts and the composite's
    preparation of the mask.
    """
    if torch.is_autocast_enabled('cuda'):  # scaled_dot_product_attention is on autocast's lower-precision list
        dtype = torch.get_autocast_dtype('cuda')

        def cast(tensor: torch.Tensor | None) -> torch.Tensor | None:
            eligible = tensor is not None and tensor.is_floating_point() and tensor.dtype not in (dtype, torch.float64)
            return tensor.to(dtype) if eligible else tensor
        query, key, value, attn_mask = cast(query), cast(key), cast(value), cast(attn_mask)
    with torch.autocast('cuda', enabled=False):
        choice = cuda_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        if choice == int(torch._C._SDPBackend.FLASH_ATTENTION):
            return _aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                             scale=scale)[0]
        if choice == int(torch._C._SDPBackend.EFFICIENT_ATTENTION):
            if attn_mask is not None:
                attn_mask = _preprocess_mask(attn_mask, query, key)
            log_sumexp = torch.is_grad_enabled() and any(tensor.requires_grad for tensor in (query, key, value))
            return _aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, log_sumexp, dropout_p,
                                                                 is_causal, scale=scale)[0]
        return F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                              enable_gqa=enable_gqa)


class _CudaAttention(TorchFunctionMode):
    """Runs ``F.scaled_dot_product_attention`` through :func:`cuda_scaled_dot_product_attention`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch._C._nn.scaled_dot_product_attention:
            return cuda_scaled_dot_product_attention(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def collapse(name: str) -> str:
    """A module name with its stage and block indices replaced by ``*`` (``stages.*.blocks.*.attn.qkv``)."""
    return re.sub(r'(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)', '*', name)


# Coarse groups, by the collapsed module name (first match wins); the loss and the optimizer are named directly.
GROUPS = (
    ('attention kernel', r'#sdpa$'),
    ('q/k normalisation (attention kernel module)', r'\.attn(\.branches\.\*)?\.kernel$'),
    ('conv shortcuts', r'conv_shortcuts'),
    ('qkv', r'\.qkv$'),
    ('proj', r'\.attn\.proj(_drop)?$'),
    ('LePE / stripes', r'\.attn\.branches'),
    ('attention (other)', r'\.attn(\.|$)'),
    ('mlp', r'\.mlp(\.|$)'),
    ('norms', r'\.norm\d?$|^norm$'),
    ('residual / alpha', r'\.(alpha\d?|drop_path\d?)$|blocks\.\*$'),
    ('downsample', r'downsample'),
    ('stem', r'^patch_embed'),
    ('head', r'^head|^fc$|^global_pool'),
)


def group_of(part: str) -> str:
    """The coarse group of a part (a collapsed module name, ``loss``, ``optimizer``); ``#sdpa`` marks the attention
    op itself."""
    if part in ('loss', 'optimizer', 'grad accumulation', 'weight casts'):
        return part
    for group, pattern in GROUPS:
        if re.search(pattern, part):
            return group
    return 'other' if part else 'model (top level)'


@dataclasses.dataclass
class Tally:
    """Counts of one part or phase."""

    ops: int = 0
    kernels: int = 0
    bytes: int = 0

    def add(self, ops: int, kernels: int, nbytes: int) -> None:
        self.ops += ops
        self.kernels += kernels
        self.bytes += nbytes


@dataclasses.dataclass
class StepCount:
    """What one step dispatched: totals, by phase, by part and by coarse group, and the SDPA ops called."""

    model: str
    mode: str
    batch_size: int
    img_size: int
    precision: str
    fast_path: bool
    total: Tally = dataclasses.field(default_factory=Tally)
    phases: dict[str, Tally] = dataclasses.field(default_factory=lambda: defaultdict(Tally))
    parts: dict[str, Tally] = dataclasses.field(default_factory=lambda: defaultdict(Tally))
    groups: dict[str, Tally] = dataclasses.field(default_factory=lambda: defaultdict(Tally))
    op_kernels: Counter = dataclasses.field(default_factory=Counter)
    sdpa: Counter = dataclasses.field(default_factory=Counter)
    conv_layouts: Counter = dataclasses.field(default_factory=Counter)
    seconds: float = 0.0

    def to_json(self) -> dict:
        """A JSON-ready dict (the tallies as dicts of ops, kernels, bytes)."""
        def tallies(table: dict[str, Tally]) -> dict:
            return {key: dataclasses.asdict(value) for key, value in
                    sorted(table.items(), key=lambda item: -item[1].kernels)}
        return {'model': self.model, 'mode': self.mode, 'batch_size': self.batch_size, 'img_size': self.img_size,
                'precision': self.precision, 'fast_path': self.fast_path, 'ops': self.total.ops,
                'kernels': self.total.kernels, 'non_matmul_bytes': self.total.bytes,
                'phases': tallies(self.phases), 'groups': tallies(self.groups), 'parts': tallies(self.parts),
                'op_kernels': dict(self.op_kernels.most_common()), 'sdpa': dict(self.sdpa),
                'conv_layouts': dict(sorted(self.conv_layouts.items())), 'seconds': self.seconds}


class _Recorder(TorchDispatchMode):
    """Records every dispatched op into a :class:`StepCount`, attributed to the part ``locate()`` names."""

    def __init__(self, count: StepCount, locate: Callable[[list[torch.Tensor]], tuple[str, str]],
                 owners: '_ParameterOwners') -> None:
        super().__init__()
        self.count, self.locate, self.owners = count, locate, owners

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ('prim', 'profiler'):  # a subclass's metadata query (prim::device), a profiler range
            return func(*args, **kwargs)
        if func is _aten._fused_sdp_choice.default:
            out = cuda_sdp_choice(*args, **kwargs)
        else:
            out = func(*args, **kwargs)
        if func in (_aten.convolution.default, _aten.convolution_backward.default):
            out = cuda_convolution_layout(func, args, out)
        name = func._schema.name.split('::')[-1]
        kernels = _op_kernels(func, args, kwargs, out)
        nbytes = _op_bytes(func, args, kwargs, out) if kernels and name not in MATMUL_OPS else 0
        inputs = _tensors((args, kwargs))
        phase, part = self.locate(inputs)
        self.owners.propagate(inputs, _tensors(out))
        if name in SDPA_OPS and kernels:
            self.count.sdpa[f'{phase}: {name}'] += 1
            part += '#sdpa'
        if name in CONVOLUTION_OPS and kernels:
            self.count.conv_layouts[f'{phase}: {convolution_layout(name, args, out)}'] += 1
        for table, key in ((self.count.phases, phase), (self.count.parts, part),
                           (self.count.groups, group_of(part))):
            table[key].add(1, kernels, nbytes)
        self.count.total.add(1, kernels, nbytes)
        if kernels:
            self.count.op_kernels[name] += kernels
        return out


class _GradFnRecorder(TorchFunctionMode):
    """Maps each autograd node the forward creates (by sequence number) to the part whose op created it."""

    def __init__(self, part_of: Callable[[list[torch.Tensor]], str], node_parts: dict[int, str]) -> None:
        super().__init__()
        self.part_of, self.node_parts = part_of, node_parts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        _record_nodes(out, self.node_parts, lambda: self.part_of(_tensors((args, kwargs))))
        return out


def _record_nodes(out: Any, node_parts: dict[int, str], part: Callable[[], str]) -> list[int]:
    """Record the part of the nodes of ``out`` not yet recorded (``part()`` is asked once, if needed); returns their
    sequence numbers."""
    recorded, name = [], None
    for tensor in _tensors(out):
        node = tensor.grad_fn
        if node is not None and node._sequence_nr() not in node_parts:
            name = part() if name is None else name
            node_parts[node._sequence_nr()] = name
            recorded.append(node._sequence_nr())
    return recorded


class _ParameterOwners:
    """The module of the model each parameter belongs to, and the casts and views of parameters (ops of one tensor
    input) after them: an op a function runs on a submodule's weights, called from an enclosing module's code
    (the fast path's functions take a block and use its layers' weights), belongs to that submodule."""

    def __init__(self, model: nn.Module) -> None:
        self.owners = WeakIdKeyDictionary()
        for name, param in model.named_parameters():
            self.owners[param] = collapse(name.rpartition('.')[0])

    def refine(self, part: str, tensors: list[torch.Tensor]) -> str:
        """``part`` narrowed to the submodule of it whose parameter one of ``tensors`` is (or is made from)."""
        for tensor in tensors:
            owner = self.owners.get(tensor)
            if owner is not None and owner != part and (part == '' or owner.startswith(part + '.')):
                return owner
        return part

    def propagate(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        if len(inputs) == 1 and (owner := self.owners.get(inputs[0])) is not None:
            for output in outputs:
                self.owners[output] = owner


# ``ctx.set_materialize_grads(value)`` of the Function nodes of a counted step, by id (the node has no getter).
_MATERIALIZE_GRADS: dict[int, bool] = {}


@contextlib.contextmanager
def _function_apply_recorded(node_parts: dict[int, str], part_of: Callable[[list[torch.Tensor]], str],
                             tensor_positions: dict[int, list[int]]) -> Iterator[None]:
    """``torch.autograd.Function.apply`` records the node it creates (function modes do not see it) and which of
    its arguments were tensors (the backward returns a gradient for every argument, the graph has edges only for
    tensors)."""
    original = torch.autograd.Function.__dict__['apply']  # a C classmethod

    def apply(cls, *args, **kwargs):
        out = original.__get__(None, cls)(*args, **kwargs)
        positions = [index for index, arg in enumerate(args) if isinstance(arg, torch.Tensor)]
        for sequence_nr in _record_nodes(out, node_parts, lambda: part_of(_tensors((args, kwargs)))):
            tensor_positions[sequence_nr] = positions
        return out

    def set_materialize_grads(ctx: Any, value: bool) -> None:
        _MATERIALIZE_GRADS[id(ctx)] = value
        ctx.materialize_grads = value

    _MATERIALIZE_GRADS.clear()
    with mock.patch.object(torch.autograd.Function, 'apply', classmethod(apply)), \
            mock.patch.object(torch.autograd.function.FunctionCtx, 'set_materialize_grads', set_materialize_grads):
        yield


@contextlib.contextmanager
def _cuda_autocast_without_a_gpu() -> Iterator[None]:
    """Let ``torch.autocast('cuda', ...)`` switch autocast on without a GPU: it only sets thread-local flags, but
    refuses when no device is present."""
    with mock.patch('torch.cuda.amp.common.amp_definitely_not_available', return_value=False), \
            mock.patch('torch.cuda.is_bf16_supported', return_value=True):
        yield


def _fakify(model: nn.Module, fake_mode: FakeTensorMode, device: torch.device) -> None:
    """Replace every parameter and buffer of a meta-built model by a fake tensor on ``device``."""
    with fake_mode:
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None:
                    fake = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=device)
                    module._parameters[name] = nn.Parameter(fake, requires_grad=param.requires_grad)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = torch.empty_strided(buffer.shape, buffer.stride(), dtype=buffer.dtype,
                                                                device=device)


def _backward(loss: torch.Tensor, run_node: Callable[[Any, Callable[[], Any]], Any],
              tensor_positions: dict[int, list[int]]) -> None:
    """Autograd's backward of ``loss``, run node by node here (the engine itself needs a real CUDA device).

    Nodes run when all their gradients have arrived, the most recently created first (as the engine's queue orders
    them); gradients arriving at one input are summed; each gradient is summed to its input's shape and cast to its
    dtype where they differ, as ``validate_outputs`` does.
    """
    import heapq

    root = loss.grad_fn
    dependencies: Counter = Counter()
    seen, stack = {id(root)}, [root]
    nodes = {id(root): root}
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            dependencies[id(child)] += 1
            if id(child) not in seen:
                seen.add(id(child))
                nodes[id(child)] = child
                stack.append(child)
    buffers: dict[int, list] = {id(root): [torch.ones_like(loss, memory_format=torch.preserve_format)]}
    ready = [(-root._sequence_nr(), 0, id(root))]
    order = 1
    with torch.no_grad():
        while ready:
            _, _, key = heapq.heappop(ready)
            node = nodes[key]
            grads = buffers.pop(key)
            if type(node).__name__ == 'AccumulateGrad':
                shared = any(grads[0] is other for slots in buffers.values() for other in slots)
                run_node(node, lambda node=node, grads=grads, shared=shared: _accumulate_grad(
                    node.variable, grads[0], shared))
                continue
            outputs = run_node(node, lambda node=node, grads=grads: _call_node(node, grads, tensor_positions))
            for (child, input_nr), grad in zip(node.next_functions, outputs):
                if child is None:
                    continue
                child_key = id(child)
                slots = buffers.setdefault(child_key, [None] * len(child._input_metadata))
                if grad is not None:
                    grad = run_node(node, lambda grad=grad, child=child, input_nr=input_nr: _validate(
                        grad, child._input_metadata[input_nr]))
                    slots[input_nr] = grad if slots[input_nr] is None else run_node(
                        child, lambda old=slots[input_nr], grad=grad: old + grad)
                dependencies[child_key] -= 1
                if dependencies[child_key] == 0:
                    heapq.heappush(ready, (-child._sequence_nr(), order, child_key))
                    order += 1


def _accumulate_grad(param: torch.Tensor, grad: torch.Tensor | None, shared: bool) -> None:
    """``AccumulateGrad``: the first gradient is stolen (a ``detach``) when nothing else holds it and its strides are
    the parameter's, else copied into the parameter's layout; later ones are added in place. (Called from Python,
    the node itself would always copy: the call holds a reference of its own.)"""
    if grad is None:
        return
    if param.grad is not None:
        param.grad += grad
    elif not shared and _obeys_layout_contract(grad, param):
        param.grad = grad.detach()
    elif is_non_overlapping_and_dense(param):
        param.grad = grad.new_empty_strided(param.shape, param.stride()).copy_(grad)
    else:
        param.grad = grad.clone(memory_format=torch.contiguous_format)


def _obeys_layout_contract(grad: torch.Tensor, param: torch.Tensor) -> bool:
    """autograd's ``obeys_layout_contract``: the gradient has the parameter's strides (where a size is not 1), or is
    contiguous for a parameter that is not dense."""
    if not is_non_overlapping_and_dense(param):
        return grad.is_contiguous()
    return all(size == 1 or grad_stride == param_stride
               for size, grad_stride, param_stride in zip(param.shape, grad.stride(), param.stride()))


def _validate(grad: torch.Tensor, metadata: Any) -> torch.Tensor:
    shape = tuple(metadata.shape)
    if tuple(grad.shape) != shape and not shape:  # at::sum_to: one sum over the broadcast dimensions
        grad = grad.sum()
    elif tuple(grad.shape) != shape:
        lead = grad.dim() - len(shape)
        dims = [*range(lead), *(lead + index for index, size in enumerate(shape)
                                if size == 1 and grad.shape[lead + index] != 1)]
        grad = grad.sum(dims, keepdim=True).view(shape)
    if grad.dtype != metadata.dtype:
        grad = grad.to(metadata.dtype)
    return grad


def _call_node(node: Any, grads: list, tensor_positions: dict[int, list[int]]) -> tuple:
    """One node's backward on its gradients: C++ nodes are called; a Python ``autograd.Function`` node runs its
    ``backward`` with missing gradients as zeros (``ctx.materialize_grads``) and its gradients of non-tensor
    arguments dropped."""
    if callable(node):
        outputs = node(*grads)  # one tensor for a node of one output, else a tuple
        return (outputs,) if outputs is None or isinstance(outputs, torch.Tensor) else tuple(outputs)
    if _MATERIALIZE_GRADS.get(id(node), True):
        grads = [torch.zeros(metadata.shape, dtype=metadata.dtype, device=metadata.device) if grad is None else grad
                 for grad, metadata in zip(grads, node._input_metadata)]
    outputs = node.apply(*grads)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    positions = tensor_positions.get(node._sequence_nr())
    if positions is not None and len(outputs) != len(node.next_functions):
        outputs = tuple(outputs[index] for index in positions)
    return outputs


def _module_names(model: nn.Module) -> dict[int, str]:
    return {id(module): name for name, module in model.named_modules()}


def _stack_part(module_names: dict[int, str], outside: str) -> str:
    """The collapsed name of the innermost module of the model on the Python stack, or ``outside``."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == 'self':
            name = module_names.get(id(frame.f_locals.get('self')))
            if name is not None:
                return collapse(name)
        frame = frame.f_back
    return outside


def _build_fake(spec: ModelSpec, img_size: int, fake_mode: FakeTensorMode, device: torch.device) -> nn.Module:
    kwargs = {key: value for key, value in spec.kwargs.items() if key != 'img_size'}
    model = spec.in_form(build_model(spec.factory(), img_size=img_size, device='meta', **kwargs), device.type)
    _fakify(model, fake_mode, device)
    return model


# Fake CUDA tensors on a machine without a CUDA device: verified with torch 2.14; torch 2.6 initialises CUDA for some
# of them (indexing a fake CUDA tensor aborts the process).
MIN_TORCH_WITHOUT_A_GPU = (2, 14)


def unsupported_reason() -> str | None:
    """Why this process cannot count (a torch older than :data:`MIN_TORCH_WITHOUT_A_GPU` and no CUDA device), or
    None."""
    release = tuple(int(part) for part in torch.__version__.split('+')[0].split('.')[:2])
    if release >= MIN_TORCH_WITHOUT_A_GPU or torch.cuda.is_available():
        return None
    needed = '.'.join(map(str, MIN_TORCH_WITHOUT_A_GPU))
    return (f'counting CUDA kernels without a GPU needs torch >= {needed} (this is {torch.__version__}, whose fake '
            f'CUDA tensors initialise CUDA); install a newer torch or count on a machine with a GPU')


def count_step(spec: ModelSpec | str, mode: str = 'train', batch_size: int = 128, img_size: int | None = None,
               precision: str = 'bf16') -> StepCount:
    """Count the ops, kernels and non-matmul bytes of one eager CUDA step of a model, on fake CUDA tensors.

    Args:
        spec: a model spec as the benchmark parses them (``lipsformer_swin_tiny[fast_path=False]``), or one parsed.
        mode: ``train`` (forward, loss, backward, AdamW step) or ``infer`` (forward without gradients).
        batch_size: images per step.
        img_size: input height and width (default: the spec's ``img_size``, else 224).
        precision: ``bf16`` or ``fp16`` autocast, or ``fp32``.

    Returns:
        The counts, by phase, part and group.
    """
    if mode not in MODES:
        raise ValueError(f'unknown mode {mode!r}; choose from {MODES}')
    reason = unsupported_reason()
    if reason:
        raise RuntimeError(reason)
    if precision not in PRECISIONS:
        raise ValueError(f'unknown precision {precision!r}; choose from {sorted(PRECISIONS)}')
    spec = parse_model_specs(spec)[0] if isinstance(spec, str) else spec
    if spec.compile:
        raise ValueError(compiled_spec_reason(spec))
    img_size = spec.kwargs.get('img_size', img_size or 224)
    begin = time.perf_counter()
    device = torch.device('cuda', 0)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = _build_fake(spec, img_size, fake_mode, device)
    module_names = _module_names(model)
    fast_path = use_fast_path('cuda') if spec.fast_path is None else spec.fast_path  # None: CUDA's default
    count = StepCount(spec.text, mode, batch_size, img_size, precision, fast_path)
    state = {'phase': 'forward', 'part': None}
    node_parts: dict[int, str] = {}
    tensor_positions: dict[int, list[int]] = {}

    owners = _ParameterOwners(model)

    def part_of(tensors: list[torch.Tensor]) -> str:
        if state['part'] == 'weight casts':
            return 'weight casts'
        return owners.refine(_stack_part(module_names, 'loss'), tensors)

    def locate(tensors: list[torch.Tensor]) -> tuple[str, str]:
        if state['part'] is not None:
            return state['phase'], state['part']
        return state['phase'], part_of(tensors)

    dtype = PRECISIONS[precision]
    with fake_mode:
        in_chans = spec.kwargs.get('in_chans', (getattr(model, 'pretrained_cfg', None) or {}).get(
            'input_size', (3,))[0])
        inputs = torch.empty(batch_size, in_chans, img_size, img_size, device=device)
    optimizer = None
    with fake_mode:  # drawn once, outside the step, as the benchmark draws them
        labels = torch.zeros(batch_size, dtype=torch.long, device=device)
    if mode == 'train':
        model.train()
        optimizer = _steady_optimizer(model, fake_mode)
    else:
        model.eval()
    with _cuda_autocast_without_a_gpu(), fake_mode, set_fast_path(spec.fast_path), \
            _Recorder(count, locate, owners), _CudaAttention():
        autocast = torch.autocast('cuda', dtype=dtype, enabled=dtype != torch.float32)
        if mode == 'infer':
            with torch.no_grad(), autocast:
                model(inputs)
        else:
            with _GradFnRecorder(part_of, node_parts), \
                    _function_apply_recorded(node_parts, part_of, tensor_positions), autocast, \
                    contextlib.ExitStack() as casts:
                if spec.grouped_weight_casts is not False:
                    state['part'] = 'weight casts'
                    casts.enter_context(GroupedWeightCasts(model).applied('cuda'))
                    state['part'] = None
                output = model(inputs)
                state['part'] = 'loss'
                loss = _benchmarkstep_loss(output, labels)
            _record_nodes(loss, node_parts, lambda: 'loss')
            state['phase'] = 'backward'
            params = {param: collapse(name.rpartition('.')[0]) for name, param in model.named_parameters()}

            def run_node(node: Any, call: Callable[[], Any]) -> Any:
                if type(node).__name__ == 'AccumulateGrad':
                    state['part'] = params.get(node.variable, 'grad accumulation')
                else:
                    state['part'] = node_parts.get(node._sequence_nr(), state['part'] or 'loss')
                return call()
            _backward(loss, run_node, tensor_positions)
            state['phase'] = state['part'] = 'optimizer'
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    count.seconds = time.perf_counter() - begin
    return count


def _benchmarkstep_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """The benchmark's loss (:func:`lipsformer.instruments.model_specs.step_loss`) with its labels given."""
    return step_loss(output, {'labels': labels})


def _steady_optimizer(model: nn.Module, fake_mode: FakeTensorMode) -> torch.optim.Optimizer:
    """The benchmark's AdamW (``create_optimizer_v2``) with its state as after the first step, so that one counted
    step is a steady one: moments on the device, step counters on the host (CUDA's default without ``capturable``),
    and the multi-tensor (``foreach``) implementation that torch picks for CUDA parameters (it cannot tell fake
    CUDA tensors from others)."""
    optimizer = create_optimizer_v2(model, opt='adamw', lr=1e-4, weight_decay=0.05)
    for group in optimizer.param_groups:
        if group.get('foreach') is None and not group.get('fused'):
            group['foreach'] = True
        for param in group['params']:
            with fake_mode:  # the host's step counter as a fake tensor that keeps its value (.item() works)
                optimizer.state[param] = {'step': torch.tensor(1.0), 'exp_avg': torch.zeros_like(param),
                                          'exp_avg_sq': torch.zeros_like(param)}
    return optimizer


def format_count_table(counts: list[StepCount], markdown: bool = False) -> str:
    """Kernels, non-matmul GB and dispatched ops per model and mode, with ratios to the first model of each mode."""
    return format_count_json_table([count.to_json() for count in counts], markdown)


def format_count_json_table(rows: list[dict], markdown: bool = False) -> str:
    """:func:`format_count_table` of counts as :meth:`StepCount.to_json` gives them (a report's ``kernel_counts``)."""
    header = ['model', 'mode', 'kernels', 'ratio', 'non-matmul GB', 'ratio', 'ops', 'ratio', 'SDPA']
    firsts: dict[str, dict] = {}
    lines = []
    for row in rows:
        first = firsts.setdefault(row['mode'], row)
        sdpa = ', '.join(sorted({key.split(': ')[1].removeprefix('_scaled_dot_product_')
                                 for key in row['sdpa'] if key.startswith('forward')})) or 'none'
        lines.append([row['model'], row['mode'], str(row['kernels']), f'{row["kernels"] / first["kernels"]:.2f}x',
                      f'{row["non_matmul_bytes"] / 1e9:.1f}',
                      f'{row["non_matmul_bytes"] / first["non_matmul_bytes"]:.2f}x' if first['non_matmul_bytes']
                      else '-', str(row['ops']), f'{row["ops"] / first["ops"]:.2f}x', sdpa])
    if markdown:
        return '\n'.join(['| ' + ' | '.join(header) + ' |', '|---|---|' + '---:|' * (len(header) - 3) + '---|'] +
                          ['| ' + ' | '.join(line) + ' |' for line in lines])
    widths = [max(len(line[col]) for line in [header] + lines) for col in range(len(header))]
    return '\n'.join('  '.join(cell.ljust(width) if col in (0, 1, 8) else cell.rjust(width)
                                for col, (cell, width) in enumerate(zip(line, widths))) for line in [header] + lines)


def format_parts(count: StepCount, top: int = 12, by: str = 'groups') -> str:
    """The ``top`` groups (or parts) of one count by kernels: kernels, GB, ops."""
    table = getattr(count, by)
    rows = sorted(table.items(), key=lambda item: -item[1].kernels)[:top]
    width = max(len(key) for key, _ in rows) if rows else 0
    return '\n'.join(f'  {key.ljust(width)}  {tally.kernels:6d} kernels  {tally.bytes / 1e9:6.1f} GB  '
                     f'{tally.ops:6d} ops' for key, tally in rows)


def format_layouts(count: StepCount) -> str:
    """The step's convolutions by phase, kind and memory layout (:func:`convolution_layout`), one line each."""
    return '\n'.join(f'  {number:4d}  {key}' for key, number in sorted(count.conv_layouts.items()))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=command_name('lipsformer.instruments.kernel_count'),
        description='Kernels, bytes moved by non-matmul ops and dispatched ops of one eager CUDA step, counted on '
                    'fake CUDA tensors (no GPU needed), with ratios to the first model.')
    add_step_arguments(parser, batch_size=128, precision='bf16')  # without fast_path=, CUDA's default
    parser.add_argument('--parts', type=int, default=8, help='groups to list per model and mode (0: none)')
    parser.add_argument('--json', type=Path, help='write every count, by phase, part and group, here')
    parser.add_argument('--markdown', action='store_true', help='print the table as Markdown')
    return parser


def compiled_spec_reason(spec: ModelSpec) -> str:
    """Why a spec that compiles its model is not counted: the count is of the eager step."""
    return (f'{spec.text!r}: the counts are of one eager step (the ops it dispatches), not of what torch.compile '
            f'runs; count the model without compile= (time the compiled one with lipsformer-benchmark)')


def count_models(specs: list[ModelSpec], modes: list[str], batch_size: int, img_size: int,
                 precision: str) -> list[StepCount]:
    """:func:`count_step` for every mode and model, modes outermost (the order of the benchmark's rows)."""
    return [count_step(spec, mode, batch_size, img_size, precision) for mode in modes for spec in specs]


def main(argv: list[str] | None = None) -> list[StepCount]:
    parser = _parser()
    args = parser.parse_args(argv)
    modes = step_modes(parser, args)
    check_report_path(parser, args.json)
    reason = unsupported_reason()
    if reason:
        usage_error(parser, reason)
    try:
        specs = parse_model_specs(args.models)
    except (TypeError, ValueError) as error:
        usage_error(parser, str(error))
    compiled = [spec for spec in specs if spec.compile]
    if compiled:
        usage_error(parser, compiled_spec_reason(compiled[0]))
    try:
        counts = count_models(specs, modes, args.batch_size, args.img_size, args.precision)
    except ValueError as error:  # a model's own refusal of the input (LipsFormer: a multiple of 32)
        usage_error(parser, f'--img-size {args.img_size}: {error}')
    except TypeError as error:  # a constructor's refusal of a spec's argument
        message = rejected_argument_message(error, specs)
        if message is None:
            raise
        usage_error(parser, f'--models: {message}')
    print(format_count_table(counts, markdown=args.markdown))
    if args.parts:
        for count in counts:
            print(f'\n{count.model} {count.mode}: top groups by kernels')
            print(format_parts(count, args.parts))
            if count.conv_layouts:
                print(f'{count.model} {count.mode}: convolutions by kind and memory layout (input -> output)')
                print(format_layouts(count))
    if args.json is not None:
        write_json_report(parser, args.json, [count.to_json() for count in counts])
    return counts


if __name__ == '__main__':
    main()
