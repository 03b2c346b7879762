"""A built LipsFormer model's fast form: the same function through faster kernels, given to the model once.

:func:`to_fast_form` gives a model's LipsFormer blocks (exactly ``LipsFormerBlock``) the class
:class:`FastLipsFormerBlock`, whose forward computes the block's function through :mod:`.blocks` (alpha folded into
the last linear layer of each branch, drop path and sum one multiply-add, CenterNorm through LayerNorm's kernel, the
conv shortcuts in one Function), its SCSA kernels a q/k normalisation that keeps only its output for backward, its
depthwise convolutions the ``lipsformer::depthwise_conv2d`` op where that kernel is switched on for the device
(:class:`DepthwiseConvOp`, which ``torch.compile`` and ``torch.export`` see too), and, for the CPU, its mixers' qkv
product through oneDNN.
:func:`to_plain_form` gives the classes back. Nothing else changes: parameters, buffers, state-dict keys, module
names and hooks are the model's own.

What may run is decided when the form is given, for the device type it is given for. On every call:

- dynamo (``torch.compile``, ``torch.export``), ``torch.jit.trace``, ``torch.func`` transforms and forward-mode AD
  see the plain block;
- a part of a block with a hook, a wrapper (PEFT's LoRA), a parametrization or a forward of its own is called as its
  module (a few dictionary reads a part);
- TorchScript refuses the fast form with a message naming :func:`to_plain_form`;
- timm's FX tracer keeps the block a leaf: the traced model runs the fast forward, the same values.
"""
import torch
import torch.nn as nn
from timm.layers import DropPath

from ..layers import CenterNorm, ConvShortcut, ResidualAlpha, ScaledCosineAttention, is_plain_module
from ..layers.scaled_cosine_attention import norm_floor
from ..layers.softmax_attention import transformed
from ..models._base import LipsFormerBlock, TokenMixer
from .blocks import conv_shortcut, linear, mlp, mlp_is_plain, weighted_residual
from .depthwise_conv_op import DepthwiseConvOp
from .fused_center_norm import center_norm
from .l2_normalize_op import l2_normalize
from .switch import kernel_enabled, use_fast_path

__all__ = ['DepthwiseConvOp', 'FastLipsFormerBlock', 'FastScaledCosineAttention', 'in_fast_form', 'to_fast_form',
           'to_plain_form']


def _plain_graph_only() -> bool:
    """Where a fast form runs the plain module graph: under dynamo (which sees the modules), ``torch.jit.trace``, and
    ``torch.func`` transforms and forward-mode AD (which the fast form's autograd Functions do not support)."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing() or transformed()


class FastLipsFormerBlock(LipsFormerBlock):
    """A LipsFormer block in its fast form (:func:`to_fast_form`): the same parameters and the same function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # a literal: TorchScript reads no global strings
            raise RuntimeError('a LipsFormer model in its fast form cannot be scripted: '
                               'lipsformer.fastpath.to_plain_form(model) gives it its plain module graph first')
        return self._forward_eager(x)

    @torch.jit.unused
    def _forward_eager(self, x: torch.Tensor) -> torch.Tensor:
        if _plain_graph_only():
            return LipsFormerBlock.forward(self, x)
        x = x.contiguous()  # a permuted view (timm's PatchEmbed output) would reach the convolutions channels-first
        for shortcut in self.conv_shortcuts:
            x = _conv_shortcut(shortcut, x)
        if self.pre_norm:
            x = _attention_residual(self, x, _norm(self.norm1, x))
            return _mlp_residual(self, x, _norm(self.norm2, x))
        x = _norm(self.norm1, _attention_residual(self, x, x))
        return _norm(self.norm2, _mlp_residual(self, x, x))


def _attention_residual(block: LipsFormerBlock, x: torch.Tensor, branch_input: torch.Tensor) -> torch.Tensor:
    """``x + drop_path1(alpha1(attn(branch_input)))`` with alpha folded into the attention's output projection, drop
    path and sum one multiply-add."""
    if not (is_plain_module(block.alpha1, ResidualAlpha) and is_plain_module(block.drop_path1, DropPath)):
        return x + block.drop_path1(block.alpha1(block.attn(branch_input)))
    attn = block.attn
    if isinstance(attn, TokenMixer) and is_plain_module(attn, type(attn)):
        branch = attn.proj_drop(linear(attn.proj, attn.attend(branch_input), block.alpha1.gamma))
        return weighted_residual(x, branch, None, block.drop_path1)
    return weighted_residual(x, attn(branch_input), block.alpha1.gamma, block.drop_path1)


def _mlp_residual(block: LipsFormerBlock, x: torch.Tensor, branch_input: torch.Tensor) -> torch.Tensor:
    """``x + drop_path2(alpha2(mlp(branch_input)))`` with alpha folded into fc2, GELU's output not kept, drop path and
    sum one multiply-add."""
    if not (is_plain_module(block.alpha2, ResidualAlpha) and is_plain_module(block.drop_path2, DropPath)):
        return x + block.drop_path2(block.alpha2(block.mlp(branch_input)))
    if mlp_is_plain(block.mlp):
        return weighted_residual(x, mlp(block.mlp, branch_input, block.alpha2.gamma), None, block.drop_path2)
    return weighted_residual(x, block.mlp(branch_input), block.alpha2.gamma, block.drop_path2)


def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A block's norm: CenterNorm through LayerNorm's fused kernel where it is a plain CenterNorm."""
    if is_plain_module(norm, CenterNorm):
        return center_norm(x, norm.weight, norm.bias, norm.scale)
    return norm(x)


def _exact_gelu(module: nn.Module) -> bool:
    return is_plain_module(module, nn.GELU) and module.approximate == 'none'


def _conv_shortcut(shortcut: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A conv shortcut through :func:`.blocks.conv_shortcut` where it and its parts are plain with exact GELUs, else
    called as its module."""
    if not is_plain_module(shortcut, ConvShortcut):
        return shortcut(x)
    pointwise_plain = (is_plain_module(shortcut.act2, nn.Identity) if shortcut.pw is None
                       else is_plain_module(shortcut.pw, nn.Conv2d) and _exact_gelu(shortcut.act2))
    dw_plain = is_plain_module(shortcut.dw, nn.Conv2d) or is_plain_module(shortcut.dw, DepthwiseConvOp)
    if (pointwise_plain and dw_plain and _exact_gelu(shortcut.act1)
            and is_plain_module(shortcut.alpha, ResidualAlpha) and is_plain_module(shortcut.drop_path, DropPath)):
        return conv_shortcut(x, shortcut.dw, shortcut.pw, shortcut.alpha.gamma, shortcut.drop_path)
    return shortcut(x)


def _is_depthwise(module: nn.Module) -> bool:
    return type(module) is nn.Conv2d and module.groups == module.in_channels == module.out_channels > 1


class FastScaledCosineAttention(ScaledCosineAttention):
    """SCSA in a fast form: q, k (and v) normalised keeping only their outputs for backward, tau folded into q's."""

    @torch.jit.unused  # the blocks of a fast form refuse TorchScript
    def normalize(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        if _plain_graph_only():
            return ScaledCosineAttention.normalize(self, q, k, v, scale)
        eps = norm_floor(self.eps, q.dtype)
        q, k = l2_normalize(q, eps, scale), l2_normalize(k, eps)
        return q, k, l2_normalize(v, eps) if self.v_norm else v, 1.0


class _OneDnnProjection:
    """A mixer whose qkv product on the CPU goes through oneDNN, with a backward that keeps x alone."""

    @torch.jit.unused  # the blocks of a fast form refuse TorchScript
    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        if _plain_graph_only():
            return self.qkv(x)
        return linear(self.qkv, x)

    def __reduce_ex__(self, protocol: int):
        """Pickled and copied as its family class made fast again on loading (a class made at run time has no name
        to import)."""
        _, _, *state = super().__reduce_ex__(protocol)
        return (_new_cpu_mixer, (_PLAIN_CLASSES[type(self)],), *state)


def _new_cpu_mixer(cls: type) -> nn.Module:
    return object.__new__(_cpu_mixer_class(cls))


_FAST_CLASSES: dict[type, type] = {LipsFormerBlock: FastLipsFormerBlock,
                                   ScaledCosineAttention: FastScaledCosineAttention}
_CPU_MIXER_CLASSES: dict[type, type] = {}
_PLAIN_CLASSES: dict[type, type] = {**{fast: plain for plain, fast in _FAST_CLASSES.items()},
                                    DepthwiseConvOp: nn.Conv2d}


def _cpu_mixer_class(cls: type) -> type:
    """The family mixer ``cls`` with :class:`_OneDnnProjection`'s ``project_qkv`` (one class per family, kept)."""
    if cls not in _CPU_MIXER_CLASSES:
        fast = type(cls.__name__, (_OneDnnProjection, cls), {'__module__': __name__, '__doc__': cls.__doc__})
        _CPU_MIXER_CLASSES[cls] = fast
        _PLAIN_CLASSES[fast] = cls
    return _CPU_MIXER_CLASSES[cls]


def _device_type(model: nn.Module) -> str:
    tensor = next(model.parameters(), None)
    return 'cpu' if tensor is None else tensor.device.type


def to_fast_form(model: nn.Module, device_type: str | None = None) -> nn.Module:
    """Give ``model``'s LipsFormer blocks their fast form for ``device_type`` (None: the device of the model's
    parameters), where the fast path is switched on for it (:func:`~.switch.use_fast_path`); ``model`` itself,
    changed in place, is returned. A model without LipsFormer layers is returned unchanged; a fast form's
    ``state_dict`` is the plain model's."""
    device_type = device_type or _device_type(model)
    if not use_fast_path(device_type):
        return model
    depthwise_op = kernel_enabled('depthwise_conv2d', device_type)
    for module in model.modules():
        cls = type(module)
        if cls in _FAST_CLASSES:
            module.__class__ = _FAST_CLASSES[cls]
        elif depthwise_op and _is_depthwise(module):
            module.__class__ = DepthwiseConvOp
        elif device_type == 'cpu' and isinstance(module, TokenMixer) and cls not in _PLAIN_CLASSES:
            module.__class__ = _cpu_mixer_class(cls)
    return model


def to_plain_form(model: nn.Module) -> nn.Module:
    """Give ``model`` back its plain module graph (undo :func:`to_fast_form`); ``model`` itself is returned."""
    for module in model.modules():
        plain = _PLAIN_CLASSES.get(type(module))
        if plain is not None:
            module.__class__ = plain
    return model


def in_fast_form(model: nn.Module) -> bool:
    """Whether any module of ``model`` is in a fast form."""
    return any(type(module) in _PLAIN_CLASSES for module in model.modules())
