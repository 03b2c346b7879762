"""A LipsFormer network as the chain of maps that Theorem 2 multiplies: plain layers and weighted residuals.

    F = head o pool o norm o ... o [norm2 o (I + alpha2 MLP)] o [norm1 o (I + alpha1 Attn)] o (I + alpha_c Conv) o ...
        o stem

(a pre-norm block, ``norm_position='pre'``, is (I + alpha2 MLP o norm2) o (I + alpha1 Attn o norm1) instead).

Each entry bounds its own map from a :class:`~lipsformer.lipschitz.norm_sources.NormSource`: a plain layer by its
Lipschitz constant, a weighted residual x + alpha (.) f(x) by 1 + max|alpha| Lip(f) (Lip(f) is what the entry's
``bound`` returns for a residual).
"""
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from ..layers import CenterNorm, ResidualAlpha
from .attention_bounds import Bound, mixer_bound, stripe_sizes
from .norm_sources import NormSource
from .norms import activation_lipschitz

__all__ = ['Entry', 'Residual', 'describe', 'require_lipsformer']

# Lipschitz constant of timm's global pools over T tokens (2-norm): a mean is 1/sqrt(T), a max 1.
_POOL_GAINS = {
    'avg': lambda tokens: tokens ** -0.5,
    'max': lambda tokens: 1.0,
    'avgmax': lambda tokens: 0.5 * (tokens ** -0.5 + 1.0),
    'catavgmax': lambda tokens: math.sqrt(1.0 / tokens + 1.0),
    '': lambda tokens: 1.0,
}


@dataclass
class Residual:
    """The weighted residual x + DropPath(alpha (.) f(x)) around an entry's map f."""
    alpha: ResidualAlpha
    drop_prob: float
    function: Callable[[torch.Tensor], torch.Tensor]
    input_of: nn.Module  # f's input is this module's forward input


@dataclass
class Entry:
    """One map of the chain, with the Linear / Conv parts that set its bound."""
    name: str
    kind: str
    bound: Callable[[NormSource], Bound]
    parts: list[tuple[str, nn.Module, tuple[int, int] | None]] = field(default_factory=list)
    residual: Residual | None = None


def norm_bound(norm: nn.Module, norms: NormSource) -> Bound:
    """Lipschitz constant of a normalisation layer: CenterNorm D/(D-1) max|gamma|; LayerNorm has none."""
    if isinstance(norm, nn.Identity):
        return Bound(1.0, 'identity')
    if isinstance(norm, CenterNorm):
        return Bound(norm.scale * norms.gamma(norm), f'CenterNorm D/(D-1) max|gamma| (D={norm.dim})')
    if isinstance(norm, nn.LayerNorm):
        return Bound(math.inf, 'unbounded: LayerNorm divides by the token\'s standard deviation, its Jacobian grows '
                               'like eps^-1/2 near constant tokens')
    return Bound(math.inf, f'unbounded: no known Lipschitz bound for {type(norm).__name__}')


def _conv_shortcut(name: str, shortcut: nn.Module, size: tuple[int, int]) -> Entry:
    def bound(norms: NormSource) -> Bound:
        value = activation_lipschitz(shortcut.act1) * norms.conv(shortcut.dw, size)
        if shortcut.pw is not None:
            value *= activation_lipschitz(shortcut.act2) * norms.conv(shortcut.pw, size)
        return Bound(value, 'GELU o conv' + (' o GELU o conv' if shortcut.pw is not None else ''))

    parts = [(f'{name}.dw', shortcut.dw, size)]
    if shortcut.pw is not None:
        parts.append((f'{name}.pw', shortcut.pw, size))
    return Entry(name, 'conv_shortcut', bound, parts, Residual(shortcut.alpha, _drop_prob(shortcut.drop_path),
                                                               shortcut.branch, shortcut))


class PreNormed(nn.Module):
    """A pre-norm block's branch as one map, f(norm(x)) (for the branch's empirical estimate and its parts)."""

    def __init__(self, norm: nn.Module, function: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(self.norm(x))


def _pre_normed(norm: nn.Module, function: nn.Module, bound: Callable[[NormSource], Bound]
                ) -> tuple[nn.Module, Callable[[NormSource], Bound]]:
    """A pre-norm block's branch f(norm(x)) and its bound Lip(f) Lip(norm), from f and its bound."""
    def normed_bound(norms: NormSource) -> Bound:
        inner, outer = bound(norms), norm_bound(norm, norms)
        return Bound(inner.value * outer.value, f'({inner.reason}) o ({outer.reason})', inner.proven and outer.proven)

    return PreNormed(norm, function), normed_bound


def _attention(name: str, block: nn.Module, size: tuple[int, int]) -> Entry:
    attn = block.attn

    def bound(norms: NormSource) -> Bound:
        found = mixer_bound(attn, size, norms)
        return found if found is not None else Bound(math.inf, f'unbounded: unknown mixer {type(attn).__name__}')

    parts = [(f'{name}.qkv', attn.qkv, None), (f'{name}.proj', attn.proj, None)]
    if hasattr(attn, 'branches'):
        parts += [(f'{name}.branches.{index}.lepe', branch.lepe, stripe)
                  for index, (branch, stripe) in enumerate(zip(attn.branches, stripe_sizes(attn, size)))]
    return _branch(name, 'attention', block, attn, bound, parts, block.norm1, block.alpha1, block.drop_path1)


def _mlp(name: str, block: nn.Module) -> Entry:
    mlp = block.mlp

    def bound(norms: NormSource) -> Bound:
        if not isinstance(mlp.norm, nn.Identity):
            return Bound(math.inf, 'unbounded: MLP with an inner norm')
        value = norms.matrix(mlp.fc2, mlp.fc2.weight) * activation_lipschitz(mlp.act)
        return Bound(value * norms.matrix(mlp.fc1, mlp.fc1.weight), 'fc2 o GELU o fc1')

    parts = [(f'{name}.fc1', mlp.fc1, None), (f'{name}.fc2', mlp.fc2, None)]
    return _branch(name, 'mlp', block, mlp, bound, parts, block.norm2, block.alpha2, block.drop_path2)


def _branch(name: str, kind: str, block: nn.Module, function: nn.Module, bound: Callable[[NormSource], Bound],
            parts: list, norm: nn.Module, alpha: ResidualAlpha, drop_path: nn.Module) -> Entry:
    """A block's weighted residual branch around ``function``, with ``norm`` inside it in a pre-norm block."""
    if getattr(block, 'pre_norm', False):
        normed, normed_bound = _pre_normed(norm, function, bound)
        return Entry(name, kind, normed_bound, parts, Residual(alpha, _drop_prob(drop_path), normed, norm))
    return Entry(name, kind, bound, parts, Residual(alpha, _drop_prob(drop_path), function, function))


def _norm(name: str, norm: nn.Module) -> Entry:
    return Entry(name, 'norm', lambda norms: norm_bound(norm, norms))


def _drop_prob(drop_path: nn.Module) -> float:
    return float(getattr(drop_path, 'drop_prob', 0.0))


def _stem(model: nn.Module, size: tuple[int, int]) -> list[Entry]:
    proj = model.patch_embed.proj
    conv = Entry('patch_embed.proj', 'conv', lambda norms: Bound(norms.conv(proj, size), 'patch conv'),
                 [('patch_embed.proj', proj, size)])
    return [conv, _norm('patch_embed.norm', model.patch_embed.norm)]


def _downsample(name: str, downsample: nn.Module, size: tuple[int, int]) -> list[Entry]:
    """Swin's PatchMerging (a permutation, norm, Linear) or CSwin's ConvMerge (conv, norm)."""
    if isinstance(downsample, nn.Identity):
        return []
    if hasattr(downsample, 'reduction'):
        reduction = downsample.reduction
        linear = Entry(f'{name}.reduction', 'linear', lambda norms: Bound(norms.matrix(reduction, reduction.weight),
                                                                           'Linear'),
                       [(f'{name}.reduction', reduction, None)])
        return [_norm(f'{name}.norm', downsample.norm), linear]
    conv = downsample.conv
    return [Entry(f'{name}.conv', 'conv', lambda norms: Bound(norms.conv(conv, size), 'conv'),
                  [(f'{name}.conv', conv, size)]), _norm(f'{name}.norm', downsample.norm)]


def _head(model: nn.Module, tokens: int) -> list[Entry]:
    pool_type = model.head.global_pool.pool_type if hasattr(model.head, 'global_pool') else ''
    if pool_type not in _POOL_GAINS:
        pool = Bound(math.inf, f'unbounded: unknown pool {pool_type!r}')
    else:
        pool = Bound(_POOL_GAINS[pool_type](tokens), f'{pool_type or "no"} pooling over {tokens} tokens')
    entries = [_norm('norm', model.norm), Entry('head.global_pool', 'pool', lambda norms: pool)]
    fc = model.head.fc
    if isinstance(fc, nn.Linear):
        entries.append(Entry('head.fc', 'linear', lambda norms: Bound(norms.matrix(fc, fc.weight), 'Linear'),
                             [('head.fc', fc, None)]))
    return entries


def require_lipsformer(model: nn.Module) -> None:
    """Refuse a model the analysis cannot describe: one without LipsFormer's stages of weighted residual blocks.

    Raises:
        TypeError: ``model`` is not a lipsformer_swin_* / lipsformer_cswin_* model.
    """
    blocks = [block for stage in getattr(model, 'stages', ()) for block in getattr(stage, 'blocks', ())]
    if not (hasattr(model, 'patch_embed') and blocks and all(hasattr(block, 'conv_shortcuts') for block in blocks)):
        name = getattr(model, 'pretrained_cfg', {}).get('architecture', type(model).__name__)
        raise TypeError(f'{name} is not a LipsFormer model: the analysis bounds the weighted residual branches of '
                        f'lipsformer_swin_* and lipsformer_cswin_* models only')


def describe(model: nn.Module, img_size: tuple[int, int]) -> list[Entry]:
    """The chain of maps of a LipsFormer model (Swin or CSwin) on ``img_size`` images, input to output."""
    require_lipsformer(model)
    patch = model.patch_embed.patch_size
    size = (img_size[0] // patch[0], img_size[1] // patch[1])
    entries = _stem(model, img_size)
    for i, stage in enumerate(model.stages):
        entries += _downsample(f'stages.{i}.downsample', stage.downsample, size)
        if i > 0 and not isinstance(stage.downsample, nn.Identity):
            size = ((size[0] + 1) // 2, (size[1] + 1) // 2)
        for j, block in enumerate(stage.blocks):
            prefix = f'stages.{i}.blocks.{j}'
            entries += [_conv_shortcut(f'{prefix}.conv_shortcuts.{c}', s, size)
                        for c, s in enumerate(block.conv_shortcuts)]
            if getattr(block, 'pre_norm', False):  # the norms are inside the branches
                entries += [_attention(f'{prefix}.attn', block, size), _mlp(f'{prefix}.mlp', block)]
            else:
                entries += [_attention(f'{prefix}.attn', block, size), _norm(f'{prefix}.norm1', block.norm1),
                            _mlp(f'{prefix}.mlp', block), _norm(f'{prefix}.norm2', block.norm2)]
    return entries + _head(model, size[0] * size[1])
