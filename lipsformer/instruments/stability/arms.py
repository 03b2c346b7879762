"""The arms of the stability experiment: full LipsFormer, one Lipschitz component swapped at a time, all swapped.

Every arm is the same small, deep LipsFormer-CSwin; only the options below differ. The standard counterpart of each
component: LayerNorm for CenterNorm, dot-product attention for scaled cosine similarity attention (SCSA), truncated
normal for spectral init, a plain residual (alpha fixed at 1) for the learnable weighted residual, and no conv
shortcuts (Table 3's configuration A) for configuration D. Three architectures also have a warmup arm, the same model
with 5 epochs of linear warmup: the full LipsFormer and the two standard Transformers, so that what warmup buys each is
measured, not assumed.
"""
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...models.lipsformer_cswin import LipsFormerCSwin

__all__ = ['ARMS', 'WARMUP_ARM', 'Arm', 'ModelShape', 'build_arm_model']

# The authors' LipsFormer-CSwin choices.
LIPSFORMER = dict(norm_layer='center', attn_type='scsa', tau=12.0, weight_init='spectral', alpha_init=0.2,
                  alpha_learnable=True, conv_config='D', norm_position='post')
# Every Lipschitz component replaced by its standard counterpart.
STANDARD = dict(LIPSFORMER, norm_layer='layer', attn_type='dot', weight_init='trunc_normal', alpha_init=1.0,
                alpha_learnable=False, conv_config='A')
PLAIN_RESIDUAL = dict(alpha_init=1.0, alpha_learnable=False)


@dataclass(frozen=True)
class Arm:
    """One arm: the model options that differ from the shared shape, and the warmup in epochs.

    ``without_warmup`` names the arm with the same model and no warmup (for an arm that warms up).
    """
    name: str
    description: str
    model_options: dict[str, Any]
    warmup_epochs: int = 0
    without_warmup: str | None = None


ARMS = {arm.name: arm for arm in (
    Arm('lipsformer', 'full LipsFormer (CenterNorm, SCSA tau 12, spectral init, alpha 0.2 learnable, conv D)',
        LIPSFORMER),
    Arm('layernorm', 'LayerNorm instead of CenterNorm', dict(LIPSFORMER, norm_layer='layer')),
    Arm('dot_product', 'dot-product attention instead of SCSA', dict(LIPSFORMER, attn_type='dot')),
    Arm('trunc_normal_init', 'truncated-normal instead of spectral init', dict(LIPSFORMER, weight_init='trunc_normal')),
    Arm('alpha_fixed_1', 'plain residual (alpha fixed at 1) instead of the weighted residual',
        dict(LIPSFORMER, **PLAIN_RESIDUAL)),
    Arm('no_conv_shortcuts', 'no conv shortcuts (configuration A) instead of D', dict(LIPSFORMER, conv_config='A')),
    Arm('post_norm_transformer', 'all swapped: standard post-norm Transformer', STANDARD),
    Arm('pre_norm_transformer', 'all swapped: standard pre-norm Transformer', dict(STANDARD, norm_position='pre')),
    Arm('lipsformer_warmup', 'full LipsFormer with 5 epochs of linear warmup', LIPSFORMER, warmup_epochs=5,
        without_warmup='lipsformer'),
    Arm('post_norm_transformer_warmup', 'standard post-norm Transformer with 5 epochs of linear warmup', STANDARD,
        warmup_epochs=5, without_warmup='post_norm_transformer'),
    Arm('pre_norm_transformer_warmup', 'standard pre-norm Transformer with 5 epochs of linear warmup',
        dict(STANDARD, norm_position='pre'), warmup_epochs=5, without_warmup='pre_norm_transformer'),
)}
# The arm that adds warmup to each arm that has one.
WARMUP_ARM = {arm.without_warmup: arm.name for arm in ARMS.values() if arm.without_warmup}


@dataclass(frozen=True)
class ModelShape:
    """The architecture every arm shares: a LipsFormer-CSwin on 32x32 images (one channel and ten classes for
    Fashion-MNIST; an image folder sets its own).

    At 32x32 with patch 4 the stages see 8x8, 4x4, 2x2 and 1x1 token maps; stripes of width (1, 2) in the first two
    stages and whole-map attention in the last two (a 2x2 stripe covers the 2x2 map).
    """
    embed_dim: int = 16
    depths: Sequence[int] = (1, 2, 21, 1)
    num_heads: Sequence[int] = (2, 2, 4, 8)
    split_size: Sequence[int] = (1, 2, 2, 1)
    img_size: int = 32
    in_chans: int = 1
    num_classes: int = 10

    def options(self) -> dict[str, Any]:
        return dict(img_size=self.img_size, in_chans=self.in_chans, num_classes=self.num_classes,
                    embed_dim=self.embed_dim,
                    depths=tuple(self.depths), num_heads=tuple(self.num_heads), split_size=tuple(self.split_size),
                    drop_path_rate=0.0)


def build_arm_model(arm: Arm, shape: ModelShape) -> LipsFormerCSwin:
    """The arm's model with the shared shape (no drop path: the runs are short)."""
    return LipsFormerCSwin(**shape.options(), **arm.model_options)
