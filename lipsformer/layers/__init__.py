"""LipsFormer's Lipschitz building blocks, and factories that let models swap each one by name.

- Norms: ``center_norm`` (CenterNorm), ``NORM_LAYERS`` / ``resolve_norm_layer``.
- Attention kernels (q, k, v, bias -> out): ``scaled_cosine_attention`` (SCSA), ``dot_product_attention``,
  ``l2_attention``, ``lipschitz_norm_attention``, all ending in ``softmax_attention``; ``create_attention_kernel``.
- Windows, stripes and heads of the mixers: ``windows``.
- Residuals: ``residual_alpha`` (the weighted residual's alpha, ``ResidualAlpha``), ``conv_shortcut``.
- Convolutions of NHWC maps through their modules (depthwise, pointwise): ``nhwc_conv``.
- Initialisation: ``spectral_init``.

Every layer here is the plain module graph, on torch and timm alone; ``lipsformer.fastpath`` gives a built model its
fast form from above.
"""
from collections.abc import Callable

import torch.nn as nn

from .center_norm import CenterNorm
from .conv_shortcut import CONV_CONFIGS, ConvShortcut, create_conv_shortcuts
from .dot_product_attention import DotProductAttention
from .l2_attention import L2Attention
from .lipschitz_norm_attention import LipschitzNormAttention
from .nhwc_conv import depthwise_conv_nhwc, is_plain_module, pointwise_conv_nhwc
from .residual_alpha import ResidualAlpha
from .scaled_cosine_attention import ScaledCosineAttention
from .spectral_init import WEIGHT_INITS, init_weights_, spectral_norm, spectral_normalize_
from .windows import pad_to_multiple, padded_size, padding_key_mask, split_heads, window_partition, window_reverse

NORM_LAYERS: dict[str, Callable[[int], nn.Module]] = {
    'center': CenterNorm,
    'layer': nn.LayerNorm,
    'none': lambda dim, **kwargs: nn.Identity(),  # takes the device / dtype that timm's PatchEmbed passes
}


def resolve_norm_layer(norm_layer: str | Callable[[int], nn.Module]) -> Callable[[int], nn.Module]:
    """A norm constructor (taking the channel count) from a name in ``NORM_LAYERS`` or a callable."""
    if callable(norm_layer):
        return norm_layer
    if norm_layer not in NORM_LAYERS:
        raise ValueError(f'unknown norm_layer {norm_layer!r}; expected one of {sorted(NORM_LAYERS)} or a callable')
    return NORM_LAYERS[norm_layer]


ATTENTION_TYPES = ('scsa', 'dot', 'l2', 'lipnorm')


def create_attention_kernel(
        attn_type: str,
        head_dim: int,
        tau: float,
        tau_learnable: bool = False,
        v_norm: bool = False,
        nu: float = 1.0,
        attn_drop: float = 0.0,
        num_heads: int | None = None,
        device=None,
        dtype=None,
) -> nn.Module:
    """The attention kernel for ``attn_type``: ``kernel(q, k, v, attn_bias=None)`` maps (batch, heads, tokens, head_dim)
    q, k, v and additive logits broadcastable to (batch, heads, tokens, tokens) (or None) to (batch, heads, tokens,
    head_dim).

    Args:
        attn_type: 'scsa' (LipsFormer's scaled cosine similarity), 'dot' (standard scaled dot product), 'l2' (Kim et
            al.'s L2 attention; the mixer then ties queries, keys and values to one projection) or 'lipnorm'
            (Dasoulas et al.'s LipschitzNorm scores).
        head_dim: Width of each head.
        tau, tau_learnable, v_norm, nu: SCSA's temperature and value normalisation ('scsa' only).
        attn_drop: Dropout on the attention probabilities.
        num_heads: Heads the kernel serves; required by 'l2', which has a value map per head.
        device, dtype: Where and in which dtype to create the kernel's parameters (learned tau, L2's value maps).
    """
    if attn_type == 'scsa':
        return ScaledCosineAttention(tau=tau, tau_learnable=tau_learnable, v_norm=v_norm, nu=nu, attn_drop=attn_drop,
                                     device=device, dtype=dtype)
    if attn_type == 'dot':
        return DotProductAttention(head_dim, attn_drop=attn_drop)
    if attn_type == 'l2':
        if num_heads is None:
            raise ValueError("attn_type 'l2' needs num_heads (it learns one value map per head)")
        return L2Attention(head_dim, num_heads, attn_drop=attn_drop, device=device, dtype=dtype)
    if attn_type == 'lipnorm':
        return LipschitzNormAttention(attn_drop=attn_drop)
    raise ValueError(f'unknown attn_type {attn_type!r}; expected one of {ATTENTION_TYPES}')


__all__ = [
    'ATTENTION_TYPES', 'CONV_CONFIGS', 'CenterNorm', 'ConvShortcut', 'DotProductAttention', 'L2Attention',
    'LipschitzNormAttention', 'NORM_LAYERS', 'ResidualAlpha', 'ScaledCosineAttention', 'WEIGHT_INITS',
    'create_attention_kernel', 'create_conv_shortcuts', 'depthwise_conv_nhwc', 'init_weights_', 'is_plain_module',
    'pad_to_multiple', 'padded_size', 'padding_key_mask', 'pointwise_conv_nhwc', 'resolve_norm_layer',
    'spectral_norm', 'spectral_normalize_', 'split_heads', 'window_partition', 'window_reverse',
]
