"""The trunk shared by LipsFormer-Swin and LipsFormer-CSwin: block, stage and the timm model interface.

LipsFormer (Qi et al., "LipsFormer: Introducing Lipschitz Continuity to Vision Transformers", ICLR 2023,
arXiv:2304.09856). A family supplies its token mixer (window or cross-stripe attention) and its downsampling; this
module holds everything else, with timm's model API (features, intermediates, pruning, grad checkpointing, heads).
Feature maps are NHWC throughout, as in timm's Swin.
"""
import contextlib
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.layers import ClassifierHead, DropPath, Mlp, PatchEmbed, calculate_drop_path_rates, to_2tuple
from timm.models import build_model_with_cfg, checkpoint_seq, register_notrace_function, register_notrace_module
from timm.models._features import feature_take_indices
from timm.models._input import update_model_input_size

from ..layers import (
    ResidualAlpha,
    create_attention_kernel,
    create_conv_shortcuts,
    init_weights_,
    resolve_norm_layer,
)

__all__ = ['NORM_POSITIONS', 'LipsFormer', 'LipsFormerBlock', 'LipsFormerStage', 'MixerArgs', 'TokenMixer',
           'CheckpointError', 'build_lipsformer', 'check_checkpoint_depths', 'check_norm_position', 'default_cfg',
           'record_input_size', 'set_pretrained_loading']


class MixerArgs(NamedTuple):
    """What the trunk gives a family's mixer factory for one block."""
    stage: int
    block: int
    dim: int
    feat_size: tuple[int, int]  # the stage's map at the model's img_size
    make_kernel: Callable[[int, int], nn.Module]  # (head_dim, heads) -> the attention kernel
    qkv_bias: bool
    proj_drop: float
    device: torch.device | str | None
    dtype: torch.dtype | None


class TokenMixer(nn.Module):
    """A family's attention on NHWC maps, (B, H, W, C) -> (B, H, W, C): ``proj_drop(proj(attend(x)))``.

    A family implements :meth:`attend`, its attention before the output projection (the ``qkv`` projection through
    :meth:`project_qkv`, windows or stripes, the attention kernel, positional terms), and nothing else; ``proj`` (an
    ``nn.Linear`` over channels) and ``proj_drop`` follow here, so that a block's fast form can fold its alpha into
    ``proj`` and give ``project_qkv`` a faster product (``lipsformer.fastpath``).
    """

    qkv: nn.Linear
    proj: nn.Linear
    proj_drop: nn.Module

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """``qkv(x)``, the input projection of :meth:`attend`."""
        return self.qkv(x)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        """(B, H, W, C) -> (B, H, W, C): the attention's output before ``proj``, with ``project_qkv`` as its input
        projection."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj_drop(self.proj(self.attend(x)))


MixerFactory = Callable[[MixerArgs], nn.Module]

NORM_POSITIONS = ('post', 'pre')


def check_norm_position(norm_position: str) -> None:
    """Raise a ValueError unless ``norm_position`` is one of ``NORM_POSITIONS``."""
    if norm_position not in NORM_POSITIONS:
        raise ValueError(f'unknown norm_position {norm_position!r}; expected one of {NORM_POSITIONS}')


class LipsFormerBlock(nn.Module):
    """Conv shortcuts, then weighted residual attention and MLP, each followed by a (post-)norm.

        x <- x + DropPath(alpha_c (.) conv_c(x))          for each conv shortcut c
        x <- norm1(x + DropPath(alpha1 (.) attn(x)))      norm1 is Identity where the family has no norm there
        x <- norm2(x + DropPath(alpha2 (.) mlp(x)))

    With ``norm_position='pre'`` (the standard pre-norm Transformer, for ablations) the norms move into the branches:
    x <- x + DropPath(alpha1 (.) attn(norm1(x))), x <- x + DropPath(alpha2 (.) mlp(norm2(x))), norm1 always present.

    ``lipsformer.fastpath.to_fast_form`` gives a built model's blocks a fast form of this forward (the same function
    through faster kernels); the block itself is this plain module graph.
    """

    def __init__(
            self,
            dim: int,
            attn: TokenMixer,
            norm_layer: Callable[..., nn.Module],
            alpha_init: float,
            post_attn_norm: bool,
            mlp_ratio: float = 4.0,
            conv_config: str = 'D',
            drop_path: float = 0.0,
            proj_drop: float = 0.0,
            alpha_learnable: bool = True,
            norm_position: str = 'post',
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        check_norm_position(norm_position)
        dd = {'device': device, 'dtype': dtype}
        self.pre_norm = norm_position == 'pre'
        self.conv_shortcuts = create_conv_shortcuts(dim, conv_config, alpha_init, drop_path, alpha_learnable, **dd)
        self.attn = attn
        self.alpha1 = ResidualAlpha(dim, alpha_init, learnable=alpha_learnable, **dd)
        self.drop_path1 = DropPath(drop_path)
        self.norm1 = norm_layer(dim, **dd) if post_attn_norm or self.pre_norm else nn.Identity()
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=nn.GELU, drop=proj_drop, **dd)
        self.alpha2 = ResidualAlpha(dim, alpha_init, learnable=alpha_learnable, **dd)
        self.drop_path2 = DropPath(drop_path)
        self.norm2 = norm_layer(dim, **dd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for shortcut in self.conv_shortcuts:
            x = shortcut(x)
        if self.pre_norm:
            x = x + self.drop_path1(self.alpha1(self.attn(self.norm1(x))))
            return x + self.drop_path2(self.alpha2(self.mlp(self.norm2(x))))
        x = self.norm1(x + self.drop_path1(self.alpha1(self.attn(x))))
        return self.norm2(x + self.drop_path2(self.alpha2(self.mlp(x))))


# The block is a leaf of timm's FX tracer: a traced model calls it as a module, so that the traced graph runs the
# same code as eager (a block's fast form included) and gives the same bits.
register_notrace_module(LipsFormerBlock)


class LipsFormerStage(nn.Module):
    """Optional downsampling followed by a sequence of blocks, on NHWC maps."""

    def __init__(self, downsample: nn.Module, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.downsample = downsample
        self.blocks = nn.Sequential(*blocks)
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.downsample(x)
        if self.grad_checkpointing and not torch.jit.is_scripting():
            return checkpoint_seq(self.blocks, x)
        return self.blocks(x)


@register_notrace_function  # checks the traced input's shape at run time
def check_input(x: torch.Tensor, in_chans: int, divisor: int) -> torch.Tensor:
    """Return ``x`` if it is a (B, in_chans, H, W) batch with H and W multiples of ``divisor``, else raise."""
    if x.dim() != 4:
        raise ValueError(f'expected a 4-D image batch (B, C, H, W), got a tensor of shape {list(x.shape)}')
    if x.shape[1] != in_chans:
        raise ValueError(f'expected {in_chans} input channels, got {x.shape[1]} (input shape {list(x.shape)}); '
                         f'build the model with in_chans={x.shape[1]} to accept it')
    if x.shape[2] % divisor != 0 or x.shape[3] % divisor != 0:
        raise ValueError(f'input height and width must be multiples of {divisor}, got {x.shape[2]}x{x.shape[3]}; '
                         f'resize or pad the image')
    return x


class LipsFormer(nn.Module):
    """Patch stem, four (or any number of) stages, final norm and classifier head, with timm's model interface.

    The families (:class:`~lipsformer.models.LipsFormerSwin`, :class:`~lipsformer.models.LipsFormerCSwin`) supply
    the token mixer and the downsampling, set their own defaults and pass every other argument through to here.
    """

    def __init__(
            self,
            make_mixer: MixerFactory,
            make_downsample: Callable[[int, int, Callable[[int], nn.Module]], nn.Module],
            post_attn_norm: bool,
            final_norm: bool,
            alpha_init: float,
            img_size: int | tuple[int, int] = 224,
            patch_size: int = 4,
            in_chans: int = 3,
            num_classes: int = 1000,
            global_pool: str = 'avg',
            embed_dim: int = 96,
            depths: Sequence[int] = (2, 2, 6, 2),
            mlp_ratio: float = 4.0,
            qkv_bias: bool = True,
            attn_type: str = 'scsa',
            tau: float = 10.0,
            tau_learnable: bool = False,
            v_norm: bool = False,
            nu: float = 1.0,
            conv_config: str = 'D',
            norm_layer: str | Callable[[int], nn.Module] = 'center',
            weight_init: str = 'spectral',
            drop_rate: float = 0.0,
            proj_drop_rate: float = 0.0,
            attn_drop_rate: float = 0.0,
            drop_path_rate: float = 0.0,
            alpha_learnable: bool = True,
            norm_position: str = 'post',
            device=None,
            dtype=None,
    ) -> None:
        """
        Args:
            make_mixer: Builds each block's token mixer from its :class:`MixerArgs`.
            make_downsample: Builds a stage's downsampling from (in channels, out channels, norm constructor,
                device=, dtype=).
            post_attn_norm: A norm after the attention residual (Swin) or none there (CSwin).
            final_norm: A norm after the last stage.
            alpha_init: Initial weighted-residual alpha.
            img_size: Default input size (any multiple of patch_size * 2 ** (stages - 1) works at run time).
            patch_size: Stride of the patch-embedding conv.
            in_chans: Input channels.
            num_classes: Classes of the head (0 for none).
            global_pool: Head pooling ('avg', 'max', ... or '' for none).
            embed_dim: Channels of the first stage, doubled at every stage.
            depths: Blocks per stage.
            mlp_ratio: MLP hidden width over dim.
            qkv_bias: Bias in the qkv projection.
            attn_type: The attention kernel: 'scsa' (scaled cosine similarity), 'dot' (standard dot product), 'l2'
                (Kim et al.'s L2 attention, tied queries and keys) or 'lipnorm' (Dasoulas et al.'s LipschitzNorm
                scores).
            tau: SCSA temperature (each family sets the authors' value as its default).
            tau_learnable: Learn tau.
            v_norm: l2-normalise the values and scale by ``nu`` (the paper's SCSA; not in the authors' code).
            nu: Output scale with ``v_norm``.
            conv_config: Conv shortcuts, Table 3's 'A' (none), 'B', 'C' or 'D' (authors').
            norm_layer: 'center' (CenterNorm), 'layer' (LayerNorm), 'none', or a constructor taking the channels.
            weight_init: 'spectral', 'xavier' or 'trunc_normal'.
            drop_rate: Dropout before the classifier.
            proj_drop_rate: Dropout after attention and MLP projections.
            attn_drop_rate: Dropout on attention probabilities.
            drop_path_rate: Stochastic depth, rising linearly to this rate over all blocks.
            alpha_learnable: Learn the weighted-residual alphas (blocks and conv shortcuts); False keeps them at
                ``alpha_init`` as buffers (alpha_init=1 gives the plain residual of a standard Transformer).
            norm_position: 'post' (LipsFormer's norms after each residual sum) or 'pre' (the standard pre-norm
                Transformer: a norm at the input of every attention and MLP branch and a final norm before the head).
            device, dtype: Where and in which dtype to create parameters and buffers, as timm's models take them
                (``device='meta'`` builds without memory; ``to_empty`` and ``init_non_persistent_buffers`` follow).
        """
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        check_norm_position(norm_position)
        norm_layer = resolve_norm_layer(norm_layer)
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.output_fmt = 'NHWC'
        self.input_divisor = patch_size * 2 ** (len(depths) - 1)
        img_size = to_2tuple(img_size)
        self._check_img_size(img_size)
        dims = [int(embed_dim * 2 ** i) for i in range(len(depths))]
        self.num_features = self.head_hidden_size = dims[-1]

        def make_kernel(head_dim: int, heads: int) -> nn.Module:
            return create_attention_kernel(attn_type, head_dim, tau=tau, tau_learnable=tau_learnable, v_norm=v_norm,
                                           nu=nu, attn_drop=attn_drop_rate, num_heads=heads, **dd)

        self.patch_embed = PatchEmbed(
            img_size=img_size, patch_size=patch_size, in_chans=in_chans, embed_dim=embed_dim,
            norm_layer=norm_layer, output_fmt='NHWC', strict_img_size=False, **dd)
        grid = self.patch_embed.grid_size
        drop_path_rates = calculate_drop_path_rates(drop_path_rate, list(depths), stagewise=True)
        stages = []
        self.feature_info = []
        for i, depth in enumerate(depths):
            feat_size = (grid[0] // 2 ** i, grid[1] // 2 ** i)
            blocks = [
                LipsFormerBlock(
                    dims[i],
                    make_mixer(MixerArgs(i, j, dims[i], feat_size, make_kernel, qkv_bias, proj_drop_rate, **dd)),
                    norm_layer, alpha_init, post_attn_norm, mlp_ratio=mlp_ratio, conv_config=conv_config,
                    drop_path=drop_path_rates[i][j], proj_drop=proj_drop_rate, alpha_learnable=alpha_learnable,
                    norm_position=norm_position, **dd)
                for j in range(depth)]
            downsample = make_downsample(dims[i - 1], dims[i], norm_layer, **dd) if i > 0 else nn.Identity()
            stages.append(LipsFormerStage(downsample, blocks))
            self.feature_info.append(dict(num_chs=dims[i], reduction=patch_size * 2 ** i, module=f'stages.{i}'))
        self.stages = nn.Sequential(*stages)
        # A pre-norm stack leaves its residual stream unnormalised: it always ends with a norm.
        self.norm = norm_layer(self.num_features, **dd) if final_norm or norm_position == 'pre' else nn.Identity()
        self.head = ClassifierHead(
            self.num_features, num_classes, pool_type=global_pool, drop_rate=drop_rate, input_fmt=self.output_fmt,
            **dd)
        self.weight_init = weight_init
        self.apply(partial(init_weights_, mode=weight_init))

    def _check_img_size(self, img_size: tuple[int, int]) -> None:
        if img_size[0] % self.input_divisor or img_size[1] % self.input_divisor:
            raise ValueError(f'img_size must be a multiple of {self.input_divisor}, got {img_size[0]}x{img_size[1]}')

    @torch.jit.ignore
    def set_input_size(self, img_size: int | tuple[int, int]) -> None:
        """Make ``img_size`` the model's default input size (any multiple of the stride works without this)."""
        img_size = to_2tuple(img_size)
        self._check_img_size(img_size)
        self.patch_embed.set_input_size(img_size=img_size)
        update_model_input_size(self, img_size)
        record_input_size(self, img_size=img_size)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {n for n, _ in self.named_parameters() if 'relative_position_bias_table' in n or n.endswith('.tau')}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        return dict(
            stem=r'^patch_embed',
            blocks=r'^stages\.(\d+)' if coarse else [
                (r'^stages\.(\d+)\.downsample', (0,)),
                (r'^stages\.(\d+)\.blocks\.(\d+)', None),
                (r'^norm', (99999,)),
            ])

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for stage in self.stages:
            stage.grad_checkpointing = enable

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head.fc

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        self.num_classes = num_classes
        self.head.reset(num_classes, pool_type=global_pool, in_features=self.num_features)
        self.head.fc.apply(partial(init_weights_, mode=self.weight_init))
        self.head_hidden_size = self.head.num_features
        if global_pool is not None:
            self.global_pool = global_pool

    def forward_intermediates(
            self,
            x: torch.Tensor,
            indices: int | list[int] | None = None,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
        """Forward returning the stage outputs (NCHW) listed in ``indices``, as timm's ``forward_intermediates``.

        Args:
            x: Input images.
            indices: Take the last n stages if an int, all if None, those listed if a sequence.
            norm: Apply the final norm to the last stage's intermediate.
            stop_early: Stop after the last stage needed.
            output_fmt: Only 'NCHW'.
            intermediates_only: Return only the intermediates.
        """
        if output_fmt != 'NCHW':
            raise ValueError(f"output_fmt must be 'NCHW', got {output_fmt!r}")
        intermediates = []
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        x = self._embed_patches(x)
        last_index = len(self.stages) - 1
        if torch.jit.is_scripting() or not stop_early:
            stages = self.stages
        else:
            stages = self.stages[:max_index + 1]
        i = 0
        for i, stage in enumerate(stages):
            x = stage(x)
            if i in take_indices:
                x_inter = self.norm(x) if norm and i == last_index else x
                intermediates.append(x_inter.permute(0, 3, 1, 2).contiguous())
        if intermediates_only:
            return intermediates
        if i == last_index:
            x = self.norm(x)
        return x, intermediates

    def prune_intermediate_layers(
            self,
            indices: int | list[int] = 1,
            prune_norm: bool = False,
            prune_head: bool = True,
    ) -> list[int]:
        """Drop the stages (and norm / head) that the intermediates in ``indices`` do not need."""
        take_indices, max_index = feature_take_indices(len(self.stages), indices)
        prune_end = max_index < len(self.stages) - 1
        if prune_norm or prune_end:
            self.norm = nn.Identity()
        self.stages = self.stages[:max_index + 1]
        if prune_end:
            self.num_features = self.head_hidden_size = self.feature_info[max_index]['num_chs']
        if prune_head or prune_end:
            self.reset_classifier(0, '')
        return take_indices

    def _embed_patches(self, x: torch.Tensor) -> torch.Tensor:
        """The patch embedding of a checked input as a contiguous NHWC map. The image is handed to the stem's
        convolution channels-last, so that the convolution's output is too and timm's PatchEmbed's permute to NHWC
        is that memory as it is (a channels-first output would be copied into NHWC, and its layout, kept by
        CenterNorm, would reach every block's depthwise convolutions, which CUDA runs channels-first with a slow
        kernel of its own); the copy of a three-channel image is the cheaper one."""
        # channels-last through a contiguous NHWC copy, which torch.func's vmap takes (not a memory_format argument)
        x = check_input(x, self.in_chans, self.input_divisor).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)
        return self.patch_embed(x).contiguous()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self._embed_patches(x)
        x = self.stages(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        return self.head(x, pre_logits=True) if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the model it is loaded into (its blocks per stage, its keys or
    shapes), or pretrained weights that cannot be had: what the models and the package's readers of weight files
    (``lipsformer.weights``) raise, so that one ``except`` catches what any of them says about a checkpoint."""


def check_checkpoint_depths(keys: Iterable[str], block_pattern: str, model: 'LipsFormer') -> None:
    """Raise a CheckpointError when a checkpoint's blocks per stage differ from the model's.

    Args:
        keys: The checkpoint's keys.
        block_pattern: Regex whose two groups capture the stage and block indices of a block's key.
        model: The model the checkpoint is loaded into.
    """
    blocks = defaultdict(set)
    for key in keys:
        match = re.match(block_pattern, key)
        if match:
            blocks[int(match.group(1))].add(int(match.group(2)))
    found_depths = tuple(len(blocks[stage]) for stage in sorted(blocks))
    model_depths = tuple(len(stage.blocks) for stage in model.stages)
    if found_depths != model_depths:
        raise CheckpointError(
            f'checkpoint has depths {tuple(found_depths)} but the model has depths {tuple(model_depths)}; build '
            f'the model with depths={tuple(found_depths)} to load it')


def default_cfg(url: str = '', **kwargs: Any) -> dict[str, Any]:
    """timm pretrained config shared by every LipsFormer model (the authors' evaluation: resize 256, crop 224)."""
    return {
        'url': url, 'num_classes': 1000, 'input_size': (3, 224, 224), 'pool_size': (7, 7),
        'crop_pct': 0.875, 'interpolation': 'bicubic', 'mean': IMAGENET_DEFAULT_MEAN, 'std': IMAGENET_DEFAULT_STD,
        'first_conv': 'patch_embed.proj', 'classifier': 'head.fc', 'paper_ids': 'arXiv:2304.09856',
        'paper_name': 'LipsFormer: Introducing Lipschitz Continuity to Vision Transformers',
        'origin_url': 'https://github.com/IDEA-Research/LipsFormer', 'license': 'apache-2.0', **kwargs,
    }


PretrainedLoading = Callable[[str, dict[str, Any]], contextlib.AbstractContextManager]
# The context timm's build with pretrained weights runs in (what :func:`set_pretrained_loading` gave).
_pretrained_loading: PretrainedLoading | None = None


def set_pretrained_loading(loading: PretrainedLoading | None) -> None:
    """Give the builder the context in which timm builds a model with pretrained weights: ``loading(variant,
    kwargs)`` for the registered ``variant`` and what its entry point was given; it may refuse before the build and
    turn a failed load into an error that says what to do. ``import lipsformer`` gives it
    ``lipsformer.weights.pretrained_sources.explaining_pretrained_failures``; None builds as timm alone does."""
    global _pretrained_loading
    _pretrained_loading = loading


def build_lipsformer(model_cls: type[LipsFormer], variant: str, pretrained: bool,
                     checkpoint_filter_fn: Callable[[dict[str, Any], nn.Module], dict[str, torch.Tensor]],
                     model_args: dict[str, Any], **kwargs: Any) -> LipsFormer:
    """A registered variant through timm's ``build_model_with_cfg``: its ``model_args`` overridden by the caller's
    ``kwargs``, a feature map per stage (``features_only``), checkpoints mapped by the family's filter, and pretrained
    weights loaded in the context :func:`set_pretrained_loading` gave.

    Raises:
        CheckpointError: The pretrained weights do not fit the model (or, as the loading context says, their file is
            missing or unreadable, or their host cannot be reached).
    """
    loading = _pretrained_loading(variant, kwargs) if pretrained and _pretrained_loading else contextlib.nullcontext()
    kwargs = dict(model_args, **kwargs)
    out_indices = kwargs.pop('out_indices', tuple(range(len(kwargs['depths']))))
    with loading:
        model = build_model_with_cfg(
            model_cls, variant, pretrained,
            pretrained_filter_fn=checkpoint_filter_fn,
            feature_cfg=dict(out_indices=out_indices, feature_cls='getter'),
            **kwargs)
    record_input_size(model, kwargs.get('in_chans'), kwargs.get('img_size'), kwargs.get('patch_size', 4) * 2 ** (
        len(kwargs['depths']) - 1))
    return model


def record_input_size(model: nn.Module, in_chans: int | None = None, img_size: int | Sequence[int] | None = None,
                      reduction: int | None = None) -> None:
    """Put the input the model was built for (or resized to) into its ``pretrained_cfg``, which timm's
    ``resolve_model_data_config`` and ``save_for_hf`` read, so that a model built with ``img_size=64`` (or resized by
    ``set_input_size``) is preprocessed at 64. Sizes not given keep the cfg's (a data overlay, the variant's own)."""
    cfg = model.pretrained_cfg
    channels, *size = cfg.get('input_size', (3, 224, 224))
    channels = in_chans if in_chans is not None else channels
    size = list(to_2tuple(img_size)) if img_size is not None else size
    if (channels, *size) == tuple(cfg.get('input_size', ())):
        return
    reduction = reduction or getattr(model, 'input_divisor', None)
    pool_size = (size[0] // reduction, size[1] // reduction) if reduction else None
    model.pretrained_cfg = model.default_cfg = {**cfg, 'input_size': (channels, *size), 'pool_size': pool_size}
