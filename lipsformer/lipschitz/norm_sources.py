"""Where a bound takes the size of each part from: the weights as they are, or the caps a constraint enforces.

Every bound in :mod:`lipsformer.lipschitz.structure` is monotone in these quantities, so the same formulas give the
bound of a model (:class:`MeasuredNorms`) and the bound a constraint guarantees (``CappedNorms`` in
:mod:`lipsformer.lipschitz.constraint`).
"""
from collections.abc import Sequence

import torch
import torch.nn as nn

from .norms import conv_operator_norm, largest_singular_value

__all__ = ['MeasuredNorms', 'NormSource']


class NormSource:
    """The interface: norms of matrices and convolutions, and the scalars (alpha, gamma, tau) a bound needs."""

    def matrix(self, owner: nn.Module, weight: torch.Tensor, rows: Sequence[slice] | None = None) -> float:
        """Spectral norm of a parameter (a Linear weight; value maps are stacks of matrices), or of its ``rows``.

        ``owner`` is the module the parameter belongs to (a constraint caps per module).
        """
        raise NotImplementedError

    def conv(self, conv: nn.Conv2d, input_size: tuple[int, int]) -> float:
        """Operator norm of ``conv`` on an ``input_size`` map."""
        raise NotImplementedError

    def alpha(self, scale_layer: nn.Module) -> float:
        """max |alpha| of a weighted residual."""
        raise NotImplementedError

    def gamma(self, norm: nn.Module) -> float:
        """max |gamma| of a CenterNorm."""
        raise NotImplementedError

    def tau(self, kernel: nn.Module) -> float:
        """|tau| of an SCSA kernel."""
        raise NotImplementedError


class MeasuredNorms(NormSource):
    """The norms of the weights as they are now (cached: use a new instance after the weights change).

    Args:
        conv_mode: 'operator' for the true operator norm of each convolution on its map (power iteration), or
            'reshaped' for the spectral norm of its (out, -1) weight, as the paper bounds it.
        cache: Norms already measured, shared with another ``MeasuredNorms`` of the same weights.
    """

    def __init__(self, conv_mode: str = 'operator', cache: dict[tuple, float] | None = None) -> None:
        if conv_mode not in ('operator', 'reshaped'):
            raise ValueError(f"conv_mode must be 'operator' or 'reshaped', got {conv_mode!r}")
        self.conv_mode = conv_mode
        self.cache: dict[tuple, float] = {} if cache is None else cache

    def matrix(self, owner: nn.Module, weight: torch.Tensor, rows: Sequence[slice] | None = None) -> float:
        key = ('matrix', id(weight), None if rows is None else tuple((r.start, r.stop) for r in rows))
        if key not in self.cache:
            block = weight if rows is None else torch.cat([weight[r] for r in rows])
            self.cache[key] = largest_singular_value(block.reshape(block.shape[0], -1) if block.dim() == 4 else block)
        return self.cache[key]

    def conv(self, conv: nn.Conv2d, input_size: tuple[int, int]) -> float:
        if self.conv_mode == 'reshaped':
            return self.matrix(conv, conv.weight)
        key = ('conv', id(conv), tuple(input_size))
        if key not in self.cache:
            self.cache[key] = conv_operator_norm(conv, input_size)
        return self.cache[key]

    def alpha(self, scale_layer: nn.Module) -> float:
        return scale_layer.gamma.detach().abs().max().item()

    def gamma(self, norm: nn.Module) -> float:
        return norm.weight.detach().abs().max().item()

    def tau(self, kernel: nn.Module) -> float:
        return abs(float(kernel.tau))
