"""LipsFormer-CSwin.

A timm implementation of LipsFormer-CSwin from `LipsFormer: Introducing Lipschitz Continuity to Vision Transformers`
(Qi et al., ICLR 2023) - https://arxiv.org/abs/2304.09856, following the authors' code (IDEA-Research/LipsFormer,
commit 00acb80, models/cswin.py) on the CSWin Transformer backbone (Dong et al., CVPR 2022): cross-shaped window
attention, half the heads in vertical and half in horizontal stripes, with scaled cosine attention (tau = 12),
locally-enhanced positional encoding (LePE), each branch divided by sqrt(its heads), one CenterNorm per block after
the MLP residual, alpha = 0.2, two conv shortcuts per block, spectral init, no final norm.
"""
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models import generate_default_cfgs, register_model

from ..layers import (
    depthwise_conv_nhwc,
    pad_to_multiple,
    padded_size,
    padding_key_mask,
    split_heads,
    window_partition,
    window_reverse,
)
from ._base import LipsFormer, MixerArgs, TokenMixer, build_lipsformer, check_checkpoint_depths, default_cfg

__all__ = ['ConvMerge', 'CrossStripeAttention', 'LipsFormerCSwin', 'StripeAttention', 'lepe_input', 'lepe_sum']


def _stripes_apart(x: torch.Tensor, dim: int, stripe: int) -> torch.Tensor:
    """A (B, H, W, C) map, its size along ``dim`` (1 or 2) a multiple of ``stripe``, with a line of zeros after each
    stripe: (B, H * (stripe + 1) / stripe, W, C) for ``dim=1``. A 3x3 convolution with zero padding over this map
    sees, at every token of a stripe, what it sees over that stripe alone."""
    x = x.unflatten(dim, [-1, stripe])
    return F.pad(x, [0, 0] * (x.dim() - dim - 2) + [0, 1]).flatten(dim, dim + 1)


def lepe_input(v: torch.Tensor, stripe_h: int, stripe_w: int) -> tuple[torch.Tensor, int, int]:
    """What LePE's convolution reads from a padded (B, H', W', C) v: the map with a line of zeros after each stripe
    (:func:`_stripes_apart`), the dimension the stripes divide (-1 where a stripe covers the map: v itself) and the
    stripe's size along it."""
    if stripe_h < v.shape[1]:
        return _stripes_apart(v, 1, stripe_h), 1, stripe_h
    if stripe_w < v.shape[2]:
        return _stripes_apart(v, 2, stripe_w), 2, stripe_w
    return v.contiguous(), -1, 1


def lepe_sum(attended: torch.Tensor, positional: torch.Tensor, apart: int, stripe: int, head_scale: float,
             height: int, width: int) -> torch.Tensor:
    """``(attended + positional) * head_scale`` cut to ``height`` x ``width``: ``positional`` LePE's convolution of
    :func:`lepe_input`'s map (``apart`` and ``stripe`` as it gives them), whose outputs at the zero lines are
    dropped (the sum reads the stripes' tokens in place)."""
    if apart < 0:
        x = (attended + positional).mul_(head_scale)
    else:
        x = attended.unflatten(apart, [-1, stripe]) + positional.unflatten(apart, [-1, stripe + 1]).narrow(
            apart + 1, 0, stripe)
        # scaled in place before any view of the sum is taken: its backward is then a product, not a copy
        x = x.mul_(head_scale).flatten(apart, apart + 1)
    return x[:, :height, :width]


class StripeAttention(nn.Module):
    """One CSwin branch: attention within stripe_h x stripe_w windows plus LePE, divided by sqrt(heads).

    Stripes cut by the map border are zero-padded and the padded keys masked, so any map size works and a cut
    stripe behaves as a narrower one. LePE, the authors' depthwise 3x3 convolution over v laid out as each stripe and
    zero-padded at the stripe's edges, is one convolution over the whole map with a line of zeros between the stripes
    (:meth:`add_positional`): the same sums, in one call on a map-sized input. With a ``tied_qkv`` kernel (Kim et
    al.'s L2 attention) the input holds one projection, used as queries, keys and values (and by LePE).
    """

    tied_qkv: torch.jit.Final[bool]

    def __init__(self, dim: int, num_heads: int, kernel: nn.Module, device=None, dtype=None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.tied_qkv = bool(getattr(kernel, 'tied_qkv', False))
        self.lepe = nn.Conv2d(dim, dim, 3, padding=1, groups=dim, device=device, dtype=dtype)
        self.kernel = kernel
        self.head_scale = num_heads ** -0.5

    def attend(self, q: torch.Tensor | None, k: torch.Tensor | None, v: torch.Tensor, stripe_h: int, stripe_w: int,
               height: int, width: int, num_heads: int) -> torch.Tensor:
        """Attention within the stripe_h x stripe_w windows of padded (B, H', W', C) q, k and v maps, any strides
        (``q=k=None``: v is used as all three), whose valid part is ``height`` x ``width``, ``num_heads`` heads (this
        branch's, or both branches' side by side): (B, H', W', C) out, the padded keys masked.

        v is read from its own copy in window order: attention and LePE keep it alone for backward, not the projection
        it was cut from (a partition into full-width stripes is a view). (B * stripes) stays -1 in every reshape:
        nothing here reads the batch size.
        """
        v = split_heads(window_partition(v, stripe_h, stripe_w).contiguous(), 1, num_heads)[0]
        if q is None or k is None:
            q = k = v
        else:
            q = split_heads(window_partition(q, stripe_h, stripe_w), 1, num_heads)[0]
            k = split_heads(window_partition(k, stripe_h, stripe_w), 1, num_heads)[0]
        mask = padding_key_mask(height, width, stripe_h, stripe_w, v.device, v.dtype)
        if mask is None:
            x = self.kernel(q, k, v, None)
        else:
            # The mask differs per stripe and is the same for every image: the (B * stripes) dimension is viewed as
            # (B, stripes), so that nothing depends on the batch size.
            stripes = mask.shape[0]
            q, k, v = q.unflatten(0, [-1, stripes]), k.unflatten(0, [-1, stripes]), v.unflatten(0, [-1, stripes])
            x = self.kernel(q, k, v, mask).flatten(0, 1)
        padded_h, padded_w = padded_size(height, width, stripe_h, stripe_w)
        return window_reverse(x.transpose(1, 2), stripe_h, stripe_w, padded_h, padded_w).flatten(3)

    def _lepe(self, v: torch.Tensor) -> torch.Tensor:
        """LePE's convolution of a contiguous (B, H, W, C) map, NHWC out."""
        if not torch.jit.is_scripting():
            return depthwise_conv_nhwc(self.lepe, v)
        return self.lepe(v.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)

    def add_positional(self, attended: torch.Tensor, v: torch.Tensor, stripe_h: int, stripe_w: int, height: int,
                       width: int) -> torch.Tensor:
        """``(attended + LePE(v)) / sqrt(heads)`` cut to ``height`` x ``width``, from (B, H', W', C) maps padded to
        multiples of the stripe (``attended``: the attention's output in map layout, any strides)."""
        positional_input, apart, stripe = lepe_input(v, stripe_h, stripe_w)
        return lepe_sum(attended, self._lepe(positional_input), apart, stripe, self.head_scale, height, width)

    def forward(self, qkv: torch.Tensor, stripe_h: int, stripe_w: int) -> torch.Tensor:
        """(B, H, W, 3, C) q, k, v (or (B, H, W, 1, C) with ``tied_qkv``), any strides -> (B, H, W, C)."""
        height, width = qkv.shape[1], qkv.shape[2]
        # Padded once and unbound rather than indexed: the backward stacks the three gradients into the projection's
        # layout in one copy, where indexing's adds zero-filled copies of the whole projection.
        qkv = pad_to_multiple(qkv, stripe_h, stripe_w)
        q: torch.Tensor | None = None
        k: torch.Tensor | None = None
        if self.tied_qkv:
            v = qkv.squeeze(3)
        else:
            q, k, v = qkv.unbind(3)
        attended = self.attend(q, k, v, stripe_h, stripe_w, height, width, self.num_heads)
        return self.add_positional(attended, v, stripe_h, stripe_w, height, width)


class CrossStripeAttention(TokenMixer):
    """Cross-shaped window attention with LePE on NHWC maps.

    With two branches, the first half of the channels (and heads) attends within vertical stripes (full height,
    ``split_size`` wide) and the second half within horizontal stripes; with one branch all channels attend over the
    whole map.

    On a square map the vertical stripes, transposed, are horizontal ones of the same size, so both branches run as
    one attention call over one set of stripes, the heads of both halves side by side (``one_call``, where the
    branches' kernels have no parameters of their own: the first branch's kernel then runs every head). Each branch's
    LePE is its own convolution on its half of v in the map's orientation.
    """

    two_branches: torch.jit.Final[bool]
    tied_qkv: torch.jit.Final[bool]
    one_call: torch.jit.Final[bool]

    def __init__(
            self,
            dim: int,
            num_heads: int,
            split_size: int,
            two_branches: bool,
            make_kernel: Callable[[int, int], nn.Module],
            qkv_bias: bool = True,
            proj_drop: float = 0.0,
            device=None,
            dtype=None,
    ) -> None:
        """
        Args:
            dim: Channels.
            num_heads: Attention heads in all (split evenly between the branches).
            split_size: Stripe width.
            two_branches: Vertical + horizontal stripes; else one global branch.
            make_kernel: Builds an attention kernel from the head dim and the heads of a branch.
            qkv_bias: Bias in the qkv projection.
            proj_drop: Dropout after the output projection.
            device, dtype: Where and in which dtype to create the parameters.
        """
        super().__init__()
        branches = 2 if two_branches else 1
        if num_heads % branches or dim % num_heads:
            raise ValueError(f'dim {dim} and num_heads {num_heads} must split evenly into {branches} branch(es)')
        dd = {'device': device, 'dtype': dtype}
        self.two_branches = two_branches
        self.split_size = split_size
        self.num_heads = num_heads
        kernels = [make_kernel(dim // num_heads, num_heads // branches) for _ in range(branches)]
        self.tied_qkv = bool(getattr(kernels[0], 'tied_qkv', False))
        # Kernels without parameters, made by one call of the same factory, are one function of q, k and v per head.
        self.one_call = two_branches and not any(True for kernel in kernels for _ in kernel.parameters())
        self.qkv = nn.Linear(dim, dim if self.tied_qkv else dim * 3, bias=qkv_bias, **dd)
        self.branches = nn.ModuleList([
            StripeAttention(dim // branches, num_heads // branches, kernel, **dd) for kernel in kernels])
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, W, C) -> (B, H, W, C), the attention before ``proj``."""
        height, width = x.shape[1], x.shape[2]
        # (B, H, W, projections, branches, C / branches): each branch reads its channels of q, k and v in place.
        qkv = self.project_qkv(x).unflatten(-1, (1 if self.tied_qkv else 3, 2 if self.two_branches else 1, -1))
        if self.one_call and height == width:
            return self._attend_square(qkv, height)
        if self.two_branches:
            vertical, horizontal = qkv.unbind(4)  # split, not indexing: its backward writes each gradient once
            return torch.cat([
                self.branches[0](vertical, height, self.split_size),
                self.branches[1](horizontal, self.split_size, width),
            ], dim=-1)
        return self.branches[0](qkv.squeeze(4), height, width)

    def stack_square(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A square (B, S, S, 3, 2, C / 2) map's q, k and v, each a contiguous (B, S', S, C) with S' padded to a
        multiple of the stripe: the vertical half transposed, so that its stripes are rows, beside the horizontal
        half. One copy for the three (views of it; a second where the stripes need padding), its backward one more,
        into the projection's layout."""
        vertical, horizontal = (half.movedim(3, 0) for half in qkv.unbind(4))
        stacked = torch.stack([vertical.transpose(2, 3), horizontal], dim=-2).flatten(-2)  # (3, B, S, S, C)
        # one pad of the three where the stripes need it: dims 1 and 2 of (3, B, S, S, C) are padded as a map's
        # height and width, the batch to a multiple of 1 (not at all), the rows to a multiple of the stripe
        q, k, v = pad_to_multiple(stacked, 1, self.split_size).unbind(0)
        return q, k, v

    def _attend_square(self, qkv: torch.Tensor, size: int) -> torch.Tensor:
        """Both branches on a square (B, S, S, 3, 2, C / 2) map in one attention call (:meth:`stack_square`), the
        heads of the horizontal half after those of the vertical one."""
        split = self.split_size
        q, k, v = self.stack_square(qkv)
        attended = self.branches[0].attend(q, k, v, split, size, size, size, self.num_heads)
        attended_vertical, attended_horizontal = attended.unflatten(-1, [2, -1]).unbind(3)
        # LePE reads each half of v from the stacked copy, the vertical one transposed back to the map's orientation.
        v_vertical, v_horizontal = v.unflatten(-1, [2, -1]).unbind(3)
        return torch.cat([
            self.branches[0].add_positional(attended_vertical.transpose(1, 2), v_vertical.transpose(1, 2), size,
                                            split, size, size),
            self.branches[1].add_positional(attended_horizontal, v_horizontal, split, size, size, size),
        ], dim=-1)


class ConvMerge(nn.Module):
    """CSwin's downsampling between stages: a 2x2 stride-2 conv, then a norm, on NHWC maps."""

    def __init__(self, dim: int, out_dim: int, norm_layer: Callable[..., nn.Module], device=None,
                 dtype=None) -> None:
        super().__init__()
        self.conv = nn.Conv2d(dim, out_dim, 2, stride=2, device=device, dtype=dtype)
        self.norm = norm_layer(out_dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1))


class LipsFormerCSwin(LipsFormer):
    """LipsFormer-CSwin: the LipsFormer trunk with cross-shaped stripe attention and conv merging."""

    def __init__(
            self,
            embed_dim: int = 64,
            depths: Sequence[int] = (1, 2, 21, 1),
            num_heads: Sequence[int] = (2, 4, 8, 16),
            split_size: Sequence[int] = (1, 2, 7, 7),
            tau: float = 12.0,
            alpha_init: float | None = None,
            drop_path_rate: float = 0.2,
            **kwargs: Any,
    ) -> None:
        """
        Args:
            num_heads: Attention heads per stage (even where the stage has two branches).
            split_size: Stripe width per stage. The last stage, and any stage whose map at ``img_size`` is
                ``split_size`` square, attends over the whole map in one branch.
            embed_dim, depths, tau, alpha_init, drop_path_rate: As the trunk's
                (:class:`~lipsformer.models._base.LipsFormer`), with the authors' CSwin defaults: tau 12 (as the
                paper), alpha_init None for 0.2.
            **kwargs: The trunk's other arguments: image size, head, attention kernel, conv shortcuts, norms,
                initialisation, dropouts, alphas, norm position.
        """
        num_heads, split_size = tuple(num_heads), tuple(split_size)
        if len(num_heads) != len(depths) or len(split_size) != len(depths):
            raise ValueError(f'num_heads {num_heads} and split_size {split_size} need one entry per stage of '
                             f'depths {tuple(depths)}')

        def make_mixer(args: MixerArgs) -> nn.Module:
            split = split_size[args.stage]
            two_branches = args.stage < len(depths) - 1 and args.feat_size != (split, split)
            return CrossStripeAttention(args.dim, num_heads[args.stage], split, two_branches, args.make_kernel,
                                        args.qkv_bias, args.proj_drop, device=args.device, dtype=args.dtype)

        super().__init__(
            make_mixer=make_mixer,
            make_downsample=ConvMerge,
            post_attn_norm=False,
            final_norm=False,
            alpha_init=0.2 if alpha_init is None else alpha_init,
            embed_dim=embed_dim, depths=depths, tau=tau, drop_path_rate=drop_path_rate, **kwargs)


# The authors' names (commit 00acb80, models/cswin.py) and ours.
_AUTHORS_KEYS = (
    (r'^stage1_conv_embed\.0\.', 'patch_embed.proj.'),
    (r'^stage1_conv_embed\.2\.', 'patch_embed.norm.'),
    (r'^merge(\d)\.', lambda m: f'stages.{m.group(1)}.downsample.'),
    (r'^stage(\d)\.(\d+)\.', lambda m: f'stages.{int(m.group(1)) - 1}.blocks.{m.group(2)}.'),
    (r'\.dwconv_layers\.0\.', '.conv_shortcuts.0.dw.'),
    (r'\.dwconv_layers\.1\.', '.conv_shortcuts.1.dw.'),
    (r'\.nin\.', '.conv_shortcuts.0.pw.'),
    (r'\.scale_layers\.(\d)\.scale$', r'.conv_shortcuts.\1.alpha.gamma'),
    (r'\.alpha(\d)\.scale$', r'.alpha\1.gamma'),
    (r'\.blocks\.(\d+)\.(qkv|proj)\.', r'.blocks.\1.attn.\2.'),
    (r'\.attns\.(\d)\.get_v\.', r'.attn.branches.\1.lepe.'),
    (r'^head\.', 'head.fc.'),
)


def checkpoint_filter_fn(state_dict: dict[str, Any], model: LipsFormerCSwin) -> dict[str, torch.Tensor]:
    """Map an authors' LipsFormer-CSwin checkpoint (the file's dict or its ``model`` entry) to this model's keys.

    The authors' blocks carry a ``norm1`` they never use; it is dropped. Checkpoints already in this package's
    layout pass through unchanged.

    Raises:
        CheckpointError: The checkpoint's blocks per stage differ from the model's.
    """
    state_dict = state_dict.get('model', state_dict.get('state_dict', state_dict))
    if 'stage1_conv_embed.0.weight' not in state_dict:
        return state_dict
    check_checkpoint_depths(state_dict, r'^stage(\d+)\.(\d+)\.', model)
    out = {}
    for key, value in state_dict.items():
        if re.match(r'^stage\d\.\d+\.norm1\.', key):
            continue
        for pattern, replacement in _AUTHORS_KEYS:
            key = re.sub(pattern, replacement, key)
        out[key] = value
    return out


def _create_lipsformer_cswin(variant: str, pretrained: bool, model_args: dict[str, Any], **kwargs: Any
                            ) -> LipsFormerCSwin:
    return build_lipsformer(LipsFormerCSwin, variant, pretrained, checkpoint_filter_fn, model_args, **kwargs)


default_cfgs = generate_default_cfgs({
    'lipsformer_cswin_tiny': default_cfg(),
    'lipsformer_cswin_small': default_cfg(),
    'lipsformer_cswin_base': default_cfg(),
    'lipsformer_cswin_base_384': default_cfg(input_size=(3, 384, 384), pool_size=(12, 12), crop_pct=1.0),
})


@register_model
def lipsformer_cswin_tiny(pretrained: bool = False, **kwargs: Any) -> LipsFormerCSwin:
    """LipsFormer-CSwin-T (paper: 83.5% top-1, 88.0% ReaL, 73.2% V2)."""
    model_args = dict(embed_dim=64, depths=(1, 2, 21, 1), num_heads=(2, 4, 8, 16), split_size=(1, 2, 7, 7),
                      drop_path_rate=0.2)
    return _create_lipsformer_cswin('lipsformer_cswin_tiny', pretrained, model_args, **kwargs)


@register_model
def lipsformer_cswin_small(pretrained: bool = False, **kwargs: Any) -> LipsFormerCSwin:
    """LipsFormer-CSwin-S (paper: 83.8% top-1)."""
    model_args = dict(embed_dim=64, depths=(2, 4, 32, 2), num_heads=(2, 4, 8, 16), split_size=(1, 2, 7, 7),
                      drop_path_rate=0.4)
    return _create_lipsformer_cswin('lipsformer_cswin_small', pretrained, model_args, **kwargs)


@register_model
def lipsformer_cswin_base(pretrained: bool = False, **kwargs: Any) -> LipsFormerCSwin:
    """LipsFormer-CSwin-B (paper: 84.6% top-1, 88.6% ReaL, 74.5% V2)."""
    model_args = dict(embed_dim=96, depths=(2, 4, 32, 2), num_heads=(4, 8, 16, 32), split_size=(1, 2, 7, 7),
                      drop_path_rate=0.5)
    return _create_lipsformer_cswin('lipsformer_cswin_base', pretrained, model_args, **kwargs)


@register_model
def lipsformer_cswin_base_384(pretrained: bool = False, **kwargs: Any) -> LipsFormerCSwin:
    """LipsFormer-CSwin-B at 384x384 with stripes (1, 2, 12, 12)."""
    model_args = dict(img_size=384, embed_dim=96, depths=(2, 4, 32, 2), num_heads=(4, 8, 16, 32),
                      split_size=(1, 2, 12, 12), drop_path_rate=0.5)
    return _create_lipsformer_cswin('lipsformer_cswin_base_384', pretrained, model_args, **kwargs)
