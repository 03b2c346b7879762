"""LipsFormer-Swin.

A timm implementation of LipsFormer-Swin from `LipsFormer: Introducing Lipschitz Continuity to Vision Transformers`
(Qi et al., ICLR 2023) - https://arxiv.org/abs/2304.09856, following the authors' released code
(https://github.com/IDEA-Research/LipsFormer, models/lipsformer_swin.py) so that their checkpoints load and reproduce
their logits: Swin windows without shifting, scaled cosine attention with tau = 10 and the relative-position bias,
CenterNorm after the attention and after the MLP residuals, alpha = 1 / sum(depths), two conv shortcuts per block,
spectral init. The paper's variants (shifted windows, l2-normalised v with nu, other tau and alpha) are options.
"""
import re
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import resize_rel_pos_bias_table, trunc_normal_
from timm.models import generate_default_cfgs, register_model
from timm.models.swin_transformer import PatchMerging, get_relative_position_index

from ..layers import pad_to_multiple, padded_size, padding_key_mask, split_heads, window_partition, window_reverse
from ._base import LipsFormer, MixerArgs, TokenMixer, build_lipsformer, check_checkpoint_depths, default_cfg

__all__ = ['LipsFormerSwin', 'WindowAttention']


class WindowAttention(TokenMixer):
    """Multi-head attention inside (optionally shifted) windows with Swin's relative-position bias, on NHWC maps.

    Where the map is not a multiple of the window, its q, k and v are zero-padded at the bottom and right and the
    padded keys masked, as CSwin's stripes: a window cut by the border attends over its valid tokens alone, so any
    input size works with the window size the relative-position table was built for. (timm's and the authors' Swin
    pad the input of the projection and attend to the padded keys.) A kernel with ``tied_qkv`` (Kim et al.'s L2
    attention) gets one projection as its queries, keys and values.
    """

    tied_qkv: torch.jit.Final[bool]

    def __init__(
            self,
            dim: int,
            num_heads: int,
            window_size: tuple[int, int],
            shift_size: tuple[int, int],
            kernel: nn.Module,
            qkv_bias: bool = True,
            proj_drop: float = 0.0,
            device=None,
            dtype=None,
    ) -> None:
        """
        Args:
            dim: Channels.
            num_heads: Attention heads.
            window_size: (height, width) of a window.
            shift_size: Cyclic shift before partitioning (0, 0 for none).
            kernel: The attention kernel (see ``lipsformer.layers.create_attention_kernel``).
            qkv_bias: Bias in the qkv projection.
            proj_drop: Dropout after the output projection.
            device, dtype: Where and in which dtype to create parameters and buffers.
        """
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'dim {dim} is not divisible by num_heads {num_heads}')
        dd = {'device': device, 'dtype': dtype}
        self.num_heads = num_heads
        self.window_size = window_size
        self.shift_size = shift_size
        self.tied_qkv = bool(getattr(kernel, 'tied_qkv', False))
        self.qkv = nn.Linear(dim, dim if self.tied_qkv else dim * 3, bias=qkv_bias, **dd)
        self.relative_position_bias_table = nn.Parameter(
            torch.empty((2 * window_size[0] - 1) * (2 * window_size[1] - 1), num_heads, **dd))
        area = window_size[0] * window_size[1]
        # Each row of the bias padded to a multiple of 16 entries (pads index entry 0 and are sliced off): the layout
        # PyTorch's memory-efficient attention takes without padding a copy of the bias in every call.
        self.padded_area = -(-area // 16) * 16
        self.register_buffer('relative_position_index',
                             torch.empty(area * self.padded_area, device=device, dtype=torch.long), persistent=False)
        self.kernel = kernel
        self.proj = nn.Linear(dim, dim, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The relative-position table (truncated normal, std 0.02, as the authors' and timm's Swin) and the
        index buffer."""
        trunc_normal_(self.relative_position_bias_table, std=0.02)
        self.init_non_persistent_buffers()

    def init_non_persistent_buffers(self) -> None:
        """Fill the relative-position index, which state dicts do not hold (after ``to_empty`` of a model built on
        the meta device; timm's ``reinit_non_persistent_buffers`` calls this)."""
        with torch.no_grad():
            index = get_relative_position_index(*self.window_size, device=self.relative_position_index.device)
            self.relative_position_index.copy_(F.pad(index, (0, self.padded_area - index.shape[1])).view(-1))

    def relative_position_bias(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """(heads, window area, window area) bias gathered from the table, in ``dtype`` (the queries': attention
        takes its bias in their dtype), each row a view into a row padded to a multiple of 16 entries."""
        area = self.window_size[0] * self.window_size[1]
        table = self.relative_position_bias_table
        if dtype is not None:
            table = table.to(dtype)
        bias = table.t().index_select(1, self.relative_position_index).view(-1, area, self.padded_area)
        return bias[:, :, :area]

    def shift_mask(self, height: int, width: int, device: torch.device) -> torch.Tensor:
        """Swin's (num_windows, 1, area, area) mask for a height x width map rolled by the shift and then padded to
        whole windows: -100 between the tokens the roll wrapped around (the last ``shift_size`` rows or columns of the
        map) and the others in a window.

        Two regions a dimension, split where the wrapped tokens begin; Swin's third region boundary, one window before
        the map's end, falls between windows where no padding is needed, and inside a window where it is (it would
        mask tokens that were neighbours before the roll). The padded rows and columns are hidden by
        :func:`~lipsformer.layers.padding_key_mask`.
        """
        padded_h, padded_w = padded_size(height, width, self.window_size[0], self.window_size[1])
        rows = (torch.arange(padded_h, device=device) >= height - self.shift_size[0]).float()
        columns = (torch.arange(padded_w, device=device) >= width - self.shift_size[1]).float()
        region = (2.0 * rows[:, None] + columns[None, :])[None, :, :, None]
        region = window_partition(region, self.window_size[0], self.window_size[1]).squeeze(-1)
        mask = region.unsqueeze(1) - region.unsqueeze(2)
        return mask.masked_fill(mask != 0, -100.0).unsqueeze(1)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, W, C) -> (B, H, W, C), the attention before ``proj``."""
        height, width = x.shape[1], x.shape[2]
        window_h, window_w = self.window_size
        shifted = self.shift_size[0] > 0 or self.shift_size[1] > 0
        if shifted:
            x = torch.roll(x, shifts=(-self.shift_size[0], -self.shift_size[1]), dims=(1, 2))
        padded_h, padded_w = padded_size(height, width, window_h, window_w)
        padded = padded_h != height or padded_w != width
        if padded:
            # The map is projected first and its q, k and v padded with zeros, as CSwin's stripes: padded tokens
            # depend on no parameter, and their keys are masked below, so they add nothing to any output or gradient
            # (a zero q or k normalises to zero in every dtype, see ScaledCosineAttention).
            qkv = pad_to_multiple(self.project_qkv(x), window_h, window_w)
            tokens = window_partition(qkv, window_h, window_w)
        else:
            tokens = self.project_qkv(window_partition(x, window_h, window_w))
        projections = split_heads(tokens, 1 if self.tied_qkv else 3, self.num_heads)
        q = k = v = projections[0]
        if not self.tied_qkv:
            k, v = projections[1], projections[2]
        attn_bias = self.relative_position_bias(q.dtype)
        mask = padding_key_mask(height, width, window_h, window_w, x.device, attn_bias.dtype) if padded else None
        if shifted:
            shift_mask = self.shift_mask(height, width, x.device).to(attn_bias.dtype)
            mask = shift_mask if mask is None else shift_mask + mask
        if mask is not None:
            # The mask differs per window and is the same for every image: the windows' (B * num_windows) dimension
            # is viewed as (B, num_windows), so that nothing depends on the batch size.
            num_windows = mask.shape[0]
            q, k, v = q.unflatten(0, (-1, num_windows)), k.unflatten(0, (-1, num_windows)), v.unflatten(
                0, (-1, num_windows))
            x = self.kernel(q, k, v, attn_bias + mask).flatten(0, 1)
        else:
            x = self.kernel(q, k, v, attn_bias)
        # (windows, heads, area, head_dim) -> (B, H, W, heads, head_dim) in one copy, the padding cut off.
        x = window_reverse(x.transpose(1, 2), window_h, window_w, height, width).flatten(3)
        if shifted:
            x = torch.roll(x, shifts=(self.shift_size[0], self.shift_size[1]), dims=(1, 2))
        return x


class LipsFormerSwin(LipsFormer):
    """LipsFormer-Swin: the LipsFormer trunk with (by default unshifted) window attention and patch merging."""

    def __init__(
            self,
            embed_dim: int = 96,
            depths: Sequence[int] = (2, 2, 6, 2),
            num_heads: Sequence[int] = (3, 6, 12, 24),
            window_size: int = 7,
            shift_windows: bool = False,
            tau: float = 10.0,
            alpha_init: float | None = None,
            drop_path_rate: float = 0.2,
            **kwargs: Any,
    ) -> None:
        """
        Args:
            num_heads: Attention heads per stage.
            window_size: Window side; a stage smaller than the window at ``img_size`` uses its own size.
            shift_windows: Shift every other block's windows by half a window (Swin v1). The authors never shift.
            embed_dim, depths, tau, alpha_init, drop_path_rate: As the trunk's
                (:class:`~lipsformer.models._base.LipsFormer`), with the authors' Swin defaults: tau 10 (the paper
                says 12), alpha_init None for 1 / sum(depths).
            **kwargs: The trunk's other arguments: image size, head, attention kernel, conv shortcuts, norms,
                initialisation, dropouts, alphas, norm position.
        """
        num_heads = tuple(num_heads)
        if len(num_heads) != len(depths):
            raise ValueError(f'num_heads {num_heads} needs one entry per stage of depths {tuple(depths)}')

        def make_mixer(args: MixerArgs) -> nn.Module:
            window = tuple(min(window_size, r) for r in args.feat_size)
            shifted = shift_windows and args.block % 2 == 1
            shift = tuple(w // 2 if shifted and r > w else 0 for r, w in zip(args.feat_size, window))
            heads = num_heads[args.stage]
            return WindowAttention(args.dim, heads, window, shift, args.make_kernel(args.dim // heads, heads),
                                   args.qkv_bias, args.proj_drop, device=args.device, dtype=args.dtype)

        super().__init__(
            make_mixer=make_mixer,
            make_downsample=lambda dim, out_dim, norm, **dd: PatchMerging(dim, out_dim, norm_layer=norm, **dd),
            post_attn_norm=True,
            final_norm=True,
            alpha_init=1.0 / sum(depths) if alpha_init is None else alpha_init,
            embed_dim=embed_dim, depths=depths, tau=tau, drop_path_rate=drop_path_rate, **kwargs)


# The authors' block-level names (models/lipsformer_swin.py) and ours.
_AUTHORS_BLOCK_KEYS = (
    (r'dwconv_layers\.0\.', 'conv_shortcuts.0.dw.'),
    (r'dwconv_layers\.1\.', 'conv_shortcuts.1.dw.'),
    (r'nin\.', 'conv_shortcuts.0.pw.'),
    (r'scale_layers\.(\d)\.scale', r'conv_shortcuts.\1.alpha.gamma'),
    (r'alpha(\d)\.scale', r'alpha\1.gamma'),
)


def checkpoint_filter_fn(state_dict: dict[str, Any], model: LipsFormerSwin) -> dict[str, torch.Tensor]:
    """Map a LipsFormer-Swin checkpoint to this model: the authors' layout (the file's dict or its ``model`` entry)
    or this package's, with relative-position tables resized to the model's windows (e.g. 7 -> 12 for 384 models).

    Raises:
        CheckpointError: The checkpoint's blocks per stage differ from the model's.
    """
    state_dict = state_dict.get('model', state_dict.get('state_dict', state_dict))
    if any(k.startswith('layers.') for k in state_dict):
        check_checkpoint_depths(state_dict, r'^layers\.(\d+)\.blocks\.(\d+)\.', model)
        state_dict = {_authors_key(k): v for k, v in state_dict.items()
                      if not k.endswith(('relative_position_index', 'attn_mask'))}
    return {k: _fit_bias_table(k, v, model) for k, v in state_dict.items()}


def _authors_key(key: str) -> str:
    key = re.sub(r'^layers\.(\d+)\.downsample', lambda m: f'stages.{int(m.group(1)) + 1}.downsample', key)
    key = re.sub(r'^layers\.', 'stages.', key)
    if '.blocks.' in key:
        for pattern, replacement in _AUTHORS_BLOCK_KEYS:
            key = re.sub(pattern, replacement, key)
    return re.sub(r'^head\.', 'head.fc.', key)


def _fit_bias_table(key: str, value: torch.Tensor, model: LipsFormerSwin) -> torch.Tensor:
    """Interpolate a relative-position bias table saved for another window size to the model's window."""
    suffix = '.relative_position_bias_table'
    if not key.endswith(suffix):
        return value
    try:
        attn = model.get_submodule(key[:-len(suffix)])
    except AttributeError:
        return value  # not in this model: reported as unexpected by the strict load
    target = attn.relative_position_bias_table.shape
    if value.shape == target or value.shape[1] != target[1]:
        return value
    return resize_rel_pos_bias_table(value, new_window_size=attn.window_size, new_bias_shape=target)


def _create_lipsformer_swin(variant: str, pretrained: bool, model_args: dict[str, Any], **kwargs: Any
                            ) -> LipsFormerSwin:
    return build_lipsformer(LipsFormerSwin, variant, pretrained, checkpoint_filter_fn, model_args, **kwargs)


default_cfgs = generate_default_cfgs({
    'lipsformer_swin_tiny.in1k': default_cfg(
        url='https://github.com/cyh1112/LipsFormer/releases/download/checkpoint/lipsformer-swin-tiny.pth'),
    'lipsformer_swin_small': default_cfg(),
    'lipsformer_swin_base': default_cfg(),
    'lipsformer_swin_large': default_cfg(),
    'lipsformer_swin_large_plus': default_cfg(),
    'lipsformer_swin_base_384': default_cfg(input_size=(3, 384, 384), pool_size=(12, 12), crop_pct=1.0),
    'lipsformer_swin_large_384': default_cfg(input_size=(3, 384, 384), pool_size=(12, 12), crop_pct=1.0),
})


@register_model
def lipsformer_swin_tiny(pretrained: bool = False, **kwargs: Any) -> LipsFormerSwin:
    """LipsFormer-Swin-T (82.7% ImageNet-1k top-1 with the authors' released weights)."""
    model_args = dict(embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24), drop_path_rate=0.2)
    return _create_lipsformer_swin('lipsformer_swin_tiny', pretrained, model_args, **kwargs)


@register_model
def lipsformer_swin_small(pretrained: bool = False, **kwargs: Any) -> LipsFormerSwin:
    """LipsFormer-Swin-S (paper: 83.5% top-1)."""
    model_args = dict(embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24), drop_path_rate=0.3)
    return _create_lipsformer_swin('lipsformer_swin_small', pretrained, model_args, **kwargs)


@register_model
def lipsformer_swin_base(pretrained: bool = False, **kwargs: Any) -> LipsFormerSwin:
    """LipsFormer-Swin-B (paper: 84.0% top-1)."""
    model_args = dict(embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32), drop_path_rate=0.5)
    return _create_lipsformer_swin('lipsformer_swin_base', pretrained, model_args, **kwargs)


@register_model
def lipsformer_swin_large(pretrained: bool = False, **kwargs: Any) -> LipsFormerSwin:
    """LipsFormer-Swin-L (paper: 83.5% top-1)."""
    model_args = dict(embed_dim=192, depths=(2, 2, 18, 2), num_heads=(6, 12, 24, 48), drop_path_rate=0.5)
    return _create_lipsformer_swin('lipsformer_swin_large', pretrained, model_args, **kwargs)


@register_model
def lipsformer_swin_large_plus(pretrained: bool = False, **kwargs: Any) -> LipsFormerSwin:
    """LipsFormer-Swin-L++ (C 288; the authors trained it on ImageNet-22k with num_classes=21841)."""
    model_args = dict(embed_dim=288, depths=(2, 2, 18, 2), num_heads=(6, 12, 24, 48), drop_path_rate=0.5)
    return _create_lipsformer_swin('lipsformer_swin_large_plus', pretrained, model_args, **kwargs)


@register_model
def lipsformer_swin_base_384(pretrained: bool = False, **kwargs: Any) -> LipsFormerSwin:
    """LipsFormer-Swin-B at 384x384 with 12x12 windows."""
    model_args = dict(
        img_size=384, embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32), window_size=12,
        drop_path_rate=0.5)
    return _create_lipsformer_swin('lipsformer_swin_base_384', pretrained, model_args, **kwargs)


@register_model
def lipsformer_swin_large_384(pretrained: bool = False, **kwargs: Any) -> LipsFormerSwin:
    """LipsFormer-Swin-L at 384x384 with 12x12 windows."""
    model_args = dict(
        img_size=384, embed_dim=192, depths=(2, 2, 18, 2), num_heads=(6, 12, 24, 48), window_size=12,
        drop_path_rate=0.5)
    return _create_lipsformer_swin('lipsformer_swin_large_384', pretrained, model_args, **kwargs)
