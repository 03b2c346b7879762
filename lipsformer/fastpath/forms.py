"""A built LipsFormer model's fast form: the same function through faster kernels, given to the model once.

:func:`to_fast_form` gives a model's LipsFormer blocks (exactly ``LipsFormerBlock``) the class
:class:`FastLipsFormerBlock`, whose forward computes the block's function through :mod:`.blocks` (alpha folded into
the last linear layer of each branch, drop path and sum one multiply-add, the conv shortcuts in one Function); its
CenterNorms (:class:`FastCenterNorm`, in blocks, merges and stems) run LayerNorm's kernel, its SCSA kernels a q/k
normalisation that keeps only its output for backward, CSwin's attention on a square map both branches' LePE as one
convolution (:class:`FastCrossStripeAttention`), and, for the CPU, its mixers' qkv product goes through oneDNN.
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
import torch.nn.functional as F
from timm.layers import DropPath

from ..layers import CenterNorm, ConvShortcut, ResidualAlpha, ScaledCosineAttention, is_plain_module
from ..layers.scaled_cosine_attention import norm_floor
from ..layers.softmax_attention import transformed
from ..models._base import LipsFormerBlock, TokenMixer
from ..models.lipsformer_cswin import CrossStripeAttention, StripeAttention, lepe_input, lepe_sum
from .blocks import conv_shortcut, linear, mlp, mlp_is_plain, weighted_residual
from .fused_center_norm import center_norm
from .l2_normalize_op import l2_normalize
from .switch import use_fast_path

__all__ = ['FastCenterNorm', 'FastCrossStripeAttention', 'FastLipsFormerBlock', 'FastScaledCosineAttention',
           'alpha_folds', 'in_fast_form', 'to_fast_form', 'to_plain_form']


def _plain_graph_only() -> bool:
    """Where a fast form runs the plain module graph: under dynamo (which sees the modules), ``torch.jit.trace``, and
    ``torch.func`` transforms and forward-mode AD (which the fast form's autograd Functions do not support)."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing() or transformed()


class _NotScripted:
    """A fast-form module class whose forward is its ``_forward_eager``: TorchScript, which compiles the stem's norm
    before any block, is refused with a message naming :func:`to_plain_form`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():  # a literal: TorchScript reads no global strings
            raise RuntimeError('a LipsFormer model in its fast form cannot be scripted: '
                               'lipsformer.fastpath.to_plain_form(model) gives it its plain module graph first')
        return self._forward_eager(x)


class FastLipsFormerBlock(_NotScripted, LipsFormerBlock):
    """A LipsFormer block in its fast form (:func:`to_fast_form`): the same parameters and the same function."""

    @torch.jit.unused
    def _forward_eager(self, x: torch.Tensor) -> torch.Tensor:
        if _plain_graph_only():
            return LipsFormerBlock.forward(self, x)
        x = x.contiguous()  # a permuted view (timm's PatchEmbed output) would reach the convolutions channels-first
        for shortcut in self.conv_shortcuts:
            x = _conv_shortcut(shortcut, x)
        if self.pre_norm:
            x = _attention_residual(self, x, self.norm1(x))
            return _mlp_residual(self, x, self.norm2(x))
        x = self.norm1(_attention_residual(self, x, x))
        return self.norm2(_mlp_residual(self, x, x))


def _attention_residual(block: LipsFormerBlock, x: torch.Tensor, branch_input: torch.Tensor) -> torch.Tensor:
    """``x + drop_path1(alpha1(attn(branch_input)))`` with alpha folded into the attention's output projection, drop
    path and sum one multiply-add."""
    if not _residual_is_plain(block.alpha1, block.drop_path1):
        return x + block.drop_path1(block.alpha1(block.attn(branch_input)))
    attn = block.attn
    if _mixer_is_plain(attn):
        branch = attn.proj_drop(linear(attn.proj, attn.attend(branch_input), block.alpha1.gamma))
        return weighted_residual(x, branch, None, block.drop_path1)
    return weighted_residual(x, attn(branch_input), block.alpha1.gamma, block.drop_path1)


def _mlp_residual(block: LipsFormerBlock, x: torch.Tensor, branch_input: torch.Tensor) -> torch.Tensor:
    """``x + drop_path2(alpha2(mlp(branch_input)))`` with alpha folded into fc2, GELU's output not kept, drop path and
    sum one multiply-add."""
    if not _residual_is_plain(block.alpha2, block.drop_path2):
        return x + block.drop_path2(block.alpha2(block.mlp(branch_input)))
    if mlp_is_plain(block.mlp):
        return weighted_residual(x, mlp(block.mlp, branch_input, block.alpha2.gamma), None, block.drop_path2)
    return weighted_residual(x, block.mlp(branch_input), block.alpha2.gamma, block.drop_path2)


def _residual_is_plain(alpha: nn.Module, drop_path: nn.Module) -> bool:
    return is_plain_module(alpha, ResidualAlpha) and is_plain_module(drop_path, DropPath)


def _mixer_is_plain(attn: nn.Module) -> bool:
    return isinstance(attn, TokenMixer) and is_plain_module(attn, type(attn))


def alpha_folds(block: nn.Module) -> list[tuple[ResidualAlpha, nn.Linear]]:
    """The alphas that ``block``, a LipsFormer block in its fast form, folds into the weight and bias of a plain linear
    layer (attention's output projection, the MLP's fc2), each with that layer; none for a block in its plain form or
    any other module. The block folds an alpha whose ``gamma`` is set; where ``gamma`` is None the layer's weight and
    bias are taken as folded already (under autocast the package's training step folds them into the weights' casts:
    ``lipsformer.training.weight_casts``)."""
    if type(block) is not FastLipsFormerBlock:
        return []
    folds = []  # where _attention_residual and _mlp_residual fold
    if (_residual_is_plain(block.alpha1, block.drop_path1) and _mixer_is_plain(block.attn)
            and is_plain_module(block.attn.proj, nn.Linear)):
        folds.append((block.alpha1, block.attn.proj))
    if _residual_is_plain(block.alpha2, block.drop_path2) and mlp_is_plain(block.mlp):
        folds.append((block.alpha2, block.mlp.fc2))
    return folds


def _exact_gelu(module: nn.Module) -> bool:
    return is_plain_module(module, nn.GELU) and module.approximate == 'none'


def _conv_shortcut(shortcut: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A conv shortcut through :func:`.blocks.conv_shortcut` where it and its parts are plain with exact GELUs, else
    called as its module."""
    if not is_plain_module(shortcut, ConvShortcut):
        return shortcut(x)
    pointwise_plain = (is_plain_module(shortcut.act2, nn.Identity) if shortcut.pw is None
                       else is_plain_module(shortcut.pw, nn.Conv2d) and _exact_gelu(shortcut.act2))
    if (pointwise_plain and is_plain_module(shortcut.dw, nn.Conv2d) and _exact_gelu(shortcut.act1)
            and is_plain_module(shortcut.alpha, ResidualAlpha) and is_plain_module(shortcut.drop_path, DropPath)):
        return conv_shortcut(x, shortcut.dw, shortcut.pw, shortcut.alpha.gamma, shortcut.drop_path)
    return shortcut(x)


class FastCenterNorm(_NotScripted, CenterNorm):
    """CenterNorm in a fast form: through LayerNorm's fused kernel, one pass forward and one backward
    (:func:`.fused_center_norm.center_norm`)."""

    @torch.jit.unused
    def _forward_eager(self, x: torch.Tensor) -> torch.Tensor:
        if _plain_graph_only():
            return CenterNorm.forward(self, x)
        return center_norm(x, self.weight, self.bias, self.scale)


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


def _lepe_merges(branches: nn.ModuleList) -> bool:
    """Whether two CSwin branches' LePE convolutions can run as one: plain branches with plain depthwise 3x3
    convolutions (``nn.Conv2d``, 'same' zero padding, stride 1) of one dtype, with biases or without, and the same
    head scale."""
    for branch in branches:
        lepe = branch.lepe
        if not (is_plain_module(branch, StripeAttention) and is_plain_module(lepe, nn.Conv2d)
                and lepe.groups == lepe.in_channels == lepe.out_channels and tuple(lepe.kernel_size) == (3, 3)
                and tuple(lepe.stride) == (1, 1) and tuple(lepe.padding) == (1, 1)
                and tuple(lepe.dilation) == (1, 1) and lepe.padding_mode == 'zeros'):
            return False
    first, second = branches[0], branches[1]
    return (first.lepe.weight.dtype == second.lepe.weight.dtype and first.head_scale == second.head_scale
            and (first.lepe.bias is None) == (second.lepe.bias is None))


class FastCrossStripeAttention(CrossStripeAttention):
    """CSwin's attention in a fast form: on a square map, where both branches' LePE convolutions are plain
    (:func:`_lepe_merges`), the two are one depthwise convolution over the stacked v, the vertical half's kernel
    transposed as its map is. The same sums: each branch's kernel over its own channels, zeros at the stripes'
    borders (for stripes one token wide, the kernels' middle rows over v itself: a 1x3 convolution)."""

    @torch.jit.unused  # the blocks of a fast form refuse TorchScript
    def _attend_square(self, qkv: torch.Tensor, size: int) -> torch.Tensor:
        if _plain_graph_only() or not _lepe_merges(self.branches):
            return CrossStripeAttention._attend_square(self, qkv, size)
        split = self.split_size
        q, k, v = self.stack_square(qkv)
        if torch.is_grad_enabled():  # q and k normalised keep only their outputs: v alone, not its stack, is kept
            v = v.clone()
        attended = self.branches[0].attend(q, k, v, split, size, size, size, self.num_heads)
        vertical, horizontal = self.branches[0].lepe, self.branches[1].lepe
        weight = torch.cat([vertical.weight.transpose(2, 3), horizontal.weight])
        bias = None if vertical.bias is None else torch.cat([vertical.bias, horizontal.bias])
        one_token = split == 1  # with a zero line beside every row, the kernels' middle rows alone add up
        if one_token:
            positional_input, apart, stripe, weight = v, -1, 1, weight[:, :, 1:2]
        else:
            positional_input, apart, stripe = lepe_input(v, split, size)
        positional = F.conv2d(positional_input.permute(0, 3, 1, 2), weight, bias, padding=(0, 1) if one_token else 1,
                              groups=weight.shape[0]).permute(0, 2, 3, 1)
        x = lepe_sum(attended, positional, apart, stripe, self.branches[0].head_scale, size, size)
        x_vertical, x_horizontal = x.unflatten(-1, [2, -1]).unbind(3)
        return torch.cat([x_vertical.transpose(1, 2), x_horizontal], dim=-1)


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
    return object.__new__(_cpu_mixer_class(_FAST_CLASSES.get(cls, cls)))


_FAST_CLASSES: dict[type, type] = {LipsFormerBlock: FastLipsFormerBlock, CenterNorm: FastCenterNorm,
                                   CrossStripeAttention: FastCrossStripeAttention,
                                   ScaledCosineAttention: FastScaledCosineAttention}
_CPU_MIXER_CLASSES: dict[type, type] = {}
_PLAIN_CLASSES: dict[type, type] = {fast: plain for plain, fast in _FAST_CLASSES.items()}


def _cpu_mixer_class(cls: type) -> type:
    """The family mixer ``cls`` (or its fast form) with :class:`_OneDnnProjection`'s ``project_qkv`` (one class per
    family, kept)."""
    if cls not in _CPU_MIXER_CLASSES:
        fast = type(cls.__name__, (_OneDnnProjection, cls), {'__module__': __name__, '__doc__': cls.__doc__})
        _CPU_MIXER_CLASSES[cls] = fast
        _PLAIN_CLASSES[fast] = _PLAIN_CLASSES.get(cls, cls)
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
    for module in model.modules():
        cls = type(module)
        fast = _FAST_CLASSES.get(cls)
        if device_type == 'cpu' and isinstance(module, TokenMixer) and cls not in _PLAIN_CLASSES:
            fast = _cpu_mixer_class(fast or cls)
        if fast is not None:
            module.__class__ = fast
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
