"""Upper bounds on the Lipschitz constant of LipsFormer's token mixers, from the theorem of each attention kernel.

Windows and stripes partition the tokens (padding is an isometric embedding, shifting a permutation), so a mixer's
constant is that of one window. Heads are functions of the same input, concatenated: sqrt(sum_h L_h^2). CSwin adds
LePE (a depthwise conv on the values of each stripe) and scales each branch by 1/sqrt(heads); its branches are
concatenated like heads. The output projection multiplies the whole.
"""
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch.nn as nn

from ..layers import DotProductAttention, L2Attention, LipschitzNormAttention, ScaledCosineAttention
from .norm_sources import NormSource
from .theorems import DASOULAS_SELF_ATTENTION, kim_l2_head_bound, scsa_head_bound

__all__ = ['Bound', 'cross_stripe_attention_bound', 'mixer_bound', 'stripe_sizes', 'window_attention_bound']


@dataclass
class Bound:
    """An upper bound on a Lipschitz constant (2-norm), where it comes from, and whether it is proven here."""
    value: float
    reason: str
    proven: bool = True

    @property
    def bounded(self) -> bool:
        return math.isfinite(self.value)


@dataclass
class _Heads:
    """Per-head bounds of one attention kernel, or why there is none."""
    values: list[float]
    reason: str
    covers_bias: bool


def _unbounded(reason: str) -> _Heads:
    return _Heads([math.inf], 'unbounded: ' + reason, covers_bias=True)


def _head_rows(dim: int, channel_start: int, head_dim: int, head: int, tied: bool) -> tuple[slice, slice, slice]:
    """Rows of the qkv weight that give one head's queries, keys and values."""
    start = channel_start + head * head_dim
    query = slice(start, start + head_dim)
    if tied:
        return query, query, query
    return query, slice(dim + start, dim + start + head_dim), slice(2 * dim + start, 2 * dim + start + head_dim)


def _kernel_heads(kernel: nn.Module, qkv: nn.Linear, rows: Sequence[tuple[slice, slice, slice]], num_tokens: int,
                  norms: NormSource) -> _Heads:
    weight = qkv.weight
    if isinstance(kernel, ScaledCosineAttention):
        if not kernel.v_norm:
            return _unbounded('SCSA without l2-normalised values (v_norm=False, the authors\' code) has no global '
                              'bound: the output grows with the values. LipsFormer\'s Theorem 1 needs v_norm=True')
        tau = norms.tau(kernel)
        values = [scsa_head_bound(num_tokens, tau, kernel.nu, 1.0 / kernel.eps, norms.matrix(qkv, weight, (q,)),
                                  norms.matrix(qkv, weight, (k,)), norms.matrix(qkv, weight, (v,)))
                  for q, k, v in rows]
        return _Heads(values, f'SCSA, LipsFormer Theorem 1 setting (eps={kernel.eps:g}, tau={tau:g}, N={num_tokens})',
                      covers_bias=True)
    if isinstance(kernel, DotProductAttention):
        return _unbounded('dot-product attention is not Lipschitz (Kim et al. 2021, Theorem 3.1)')
    if isinstance(kernel, L2Attention):
        values = [kim_l2_head_bound(num_tokens, norms.matrix(qkv, weight, (q,)),
                                    norms.matrix(kernel, kernel.value_map, (slice(h, h + 1),)))
                  for h, (q, _, _) in enumerate(rows)]
        return _Heads(values, f'L2 attention, Kim et al. 2021 Theorem 3.2 (N={num_tokens})', covers_bias=False)
    if isinstance(kernel, LipschitzNormAttention):
        values = [DASOULAS_SELF_ATTENTION * norms.matrix(qkv, weight, (q, k, v)) for q, k, v in rows]
        return _Heads(values, 'LipschitzNorm attention, Dasoulas et al. 2021 Corollary 2', covers_bias=False)
    return _unbounded(f'no known Lipschitz bound for {type(kernel).__name__}')


def _combine(bounds: Sequence[float]) -> float:
    return math.sqrt(sum(b * b for b in bounds)) if all(map(math.isfinite, bounds)) else math.inf


def window_attention_bound(attn: nn.Module, norms: NormSource) -> Bound:
    """Bound of a Swin ``WindowAttention`` (qkv, attention in windows with the relative-position bias, proj)."""
    dim = attn.proj.in_features
    head_dim = dim // attn.num_heads
    num_tokens = attn.window_size[0] * attn.window_size[1]
    rows = [_head_rows(dim, 0, head_dim, h, attn.tied_qkv) for h in range(attn.num_heads)]
    heads = _kernel_heads(attn.kernel, attn.qkv, rows, num_tokens, norms)
    value = norms.matrix(attn.proj, attn.proj.weight) * _combine(heads.values)
    if not heads.covers_bias:
        return Bound(value, heads.reason + '; the theorem has no positional bias, this model adds the relative-'
                                           'position bias: not proven', proven=False)
    return Bound(value, heads.reason + ('' if math.isinf(value) else '; covers the relative-position bias'))


def stripe_sizes(attn: nn.Module, feat_size: tuple[int, int]) -> list[tuple[int, int]]:
    """(height, width) of the stripes of each branch of a ``CrossStripeAttention`` on a ``feat_size`` map."""
    height, width = feat_size
    if attn.two_branches:
        return [(height, attn.split_size), (attn.split_size, width)]
    return [(height, width)]


def cross_stripe_attention_bound(attn: nn.Module, feat_size: tuple[int, int], norms: NormSource) -> Bound:
    """Bound of a CSwin ``CrossStripeAttention`` on a ``feat_size`` map (stripes with LePE and head scaling)."""
    dim = attn.proj.in_features
    stripes = stripe_sizes(attn, feat_size)
    branch_dim = dim // len(attn.branches)
    branch_bounds, reason = [], ''
    for index, (branch, stripe) in enumerate(zip(attn.branches, stripes)):
        head_dim = branch_dim // branch.num_heads
        rows = [_head_rows(dim, index * branch_dim, head_dim, h, attn.tied_qkv) for h in range(branch.num_heads)]
        heads = _kernel_heads(branch.kernel, attn.qkv, rows, stripe[0] * stripe[1], norms)
        reason = heads.reason
        value_rows = slice(rows[0][2].start, rows[-1][2].stop)  # the branch's values, which LePE convolves
        lepe = norms.conv(branch.lepe, stripe) * norms.matrix(attn.qkv, attn.qkv.weight, (value_rows,))
        branch_bounds.append(branch.head_scale * (_combine(heads.values) + lepe))
    value = norms.matrix(attn.proj, attn.proj.weight) * _combine(branch_bounds)
    return Bound(value, reason + ('' if math.isinf(value) else '; plus LePE'))


def mixer_bound(attn: nn.Module, feat_size: tuple[int, int], norms: NormSource) -> Bound | None:
    """Bound of a LipsFormer token mixer, or None if it is neither a window nor a cross-stripe attention."""
    if hasattr(attn, 'window_size') and hasattr(attn, 'kernel'):
        return window_attention_bound(attn, norms)
    if hasattr(attn, 'branches') and hasattr(attn, 'split_size'):
        return cross_stripe_attention_bound(attn, feat_size, norms)
    return None
