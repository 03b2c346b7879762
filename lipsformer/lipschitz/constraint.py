"""Lipschitz-constrained training: keep LipsFormer's Theorem 2 bound through training, not only at initialisation.

After every optimizer step :class:`LipschitzConstraint` projects the weights back into a set where the bound holds:

- every Linear and Conv2d weight whose spectral norm (of the (out, -1) reshaped weight, estimated by power iteration
  with vectors carried over from the previous step, as ``torch.nn.utils.spectral_norm``) exceeds its cap is scaled
  down to the cap; so is every head of an L2 attention's value map (small matrices: exact norms);
- every weighted-residual alpha is clipped to [-alpha_max, alpha_max], every CenterNorm gamma to
  [-gamma_max, gamma_max], every learnable SCSA tau to [-tau_max, tau_max].

The bound these caps guarantee is Theorem 2's product with each part at its cap (a convolution whose patches
overlap counts sqrt(overlapping taps) times its cap, the largest its operator norm can be); give ``max_bound`` and
alpha_max is chosen as the largest value that keeps that product below it. Norm balls and boxes are convex, so an
EMA of projected weights stays inside them (if it averages the projected weights).

Power iteration approaches a norm from below. Carried vectors follow a slowly turning top singular direction, but
not a sudden new one: Adam's first steps at a high learning rate move a weight by a nearly rank-one update of
spectral norm up to lr * sqrt(m n), and the estimate then trails the true norm for a few steps; it also converges
slowly where the top singular values are close together, as in random matrices. ``exact=True`` computes every norm
exactly, so that the caps, and the bound, hold after every step, at a much higher cost. docs/lipschitz.md
gives the measured overshoot and cost.
"""
import math
import re
from typing import Any

import torch
import torch.nn as nn
from timm.layers import to_2tuple

from ..layers import CenterNorm, ResidualAlpha, ScaledCosineAttention
from .analysis import network_bound
from .norm_sources import NormSource
from .norms import conv_overlap_factor
from .structure import describe

__all__ = ['LipschitzConstraint']


class CappedNorms(NormSource):
    """Every norm at its cap: the worst case the constraint allows."""

    def __init__(self, constraint: 'LipschitzConstraint', alpha_max: float) -> None:
        self.constraint = constraint
        self.alpha_max = alpha_max

    def matrix(self, owner: nn.Module, weight: torch.Tensor, rows=None) -> float:
        return self.constraint.caps[id(owner)]  # a block of rows is at most the whole

    def conv(self, conv: nn.Conv2d, input_size: tuple[int, int]) -> float:
        return self.constraint.caps[id(conv)] * conv_overlap_factor(conv)

    def alpha(self, scale_layer: nn.Module) -> float:
        return self.alpha_max

    def gamma(self, norm: nn.Module) -> float:
        return self.constraint.gamma_max

    def tau(self, kernel: nn.Module) -> float:
        return self.constraint.tau_caps.get(id(kernel), abs(float(kernel.tau)))


class LipschitzConstraint:
    """Project a LipsFormer model's weights after each optimizer step so that its Lipschitz bound holds.

    Use as ``constraint = LipschitzConstraint(model, ...)`` then ``constraint()`` after every ``optimizer.step()``
    (train.py: ``lipschitz.enabled: true``, ``lipschitz.kwargs: {...}``). Its ``state_dict`` holds the cached
    power-iteration vectors.
    """

    def __init__(
            self,
            model: nn.Module,
            weight_cap: float = 1.0,
            module_caps: dict[str, float] | None = None,
            alpha_max: float | None = None,
            gamma_max: float = 1.0,
            tau_max: float | None = None,
            max_bound: float | None = None,
            img_size: int | tuple[int, int] | None = None,
            power_iterations: int = 1,
            exact: bool = False,
            seed: int = 0,
    ) -> None:
        """
        Args:
            model: The (unwrapped) model; its parameters are modified in place. The caps apply to any model; the
                bound (``max_bound``, :meth:`bound`) needs a LipsFormer.
            weight_cap: Largest spectral norm of every Linear / Conv2d weight (1: spectral init's value).
            module_caps: Other caps by module name, ``{regex: cap}`` (first ``re.search`` match), e.g.
                ``{'^head': 4.0}``.
            alpha_max: Largest |alpha|; None: the largest at construction, or the value ``max_bound`` allows.
            gamma_max: Largest |gamma| of CenterNorm.
            tau_max: Largest |tau| of learnable SCSA temperatures; None: each one's value at construction.
            max_bound: Keep Theorem 2's product below this (sets alpha_max; an error if the caps cannot).
            img_size: Input size the bound is for (CSwin stripes grow with it); None: the model's default.
            power_iterations: Power iterations per step with carried vectors (1 or 2).
            exact: Compute every spectral norm exactly (an SVD per matrix and step) instead: the caps then hold after
                every step, at a much higher cost.
            seed: Seed of the initial power-iteration vectors.
        """
        if power_iterations < 1:
            raise ValueError(f'power_iterations must be >= 1, got {power_iterations}')
        self.model = model
        self.power_iterations = power_iterations
        self.exact = exact
        self.gamma_max = float(gamma_max)
        if img_size is None and hasattr(model, 'patch_embed'):
            img_size = model.patch_embed.img_size
        self.img_size = to_2tuple(img_size) if img_size is not None else None  # only the bound needs it
        self.matrices = self._capped_matrices(model, float(weight_cap), module_caps or {})
        self.caps = {id(module): cap for _, module, cap in self.matrices}
        self.alphas = [m for m in model.modules() if isinstance(m, ResidualAlpha)]
        self.gammas = [m for m in model.modules() if isinstance(m, CenterNorm)]
        self.taus = [m for m in model.modules() if isinstance(m, ScaledCosineAttention) and m.tau_learnable]
        self.tau_caps = {id(m): abs(float(m.tau)) if tau_max is None else float(tau_max) for m in self.taus}
        self.vectors = self._initial_vectors(seed)
        self.alpha_max = self._choose_alpha_max(alpha_max, max_bound)
        if not exact:
            self.refresh(iterations=100)  # start from converged vectors

    @staticmethod
    def _capped_matrices(model: nn.Module, weight_cap: float,
                         module_caps: dict[str, float]) -> list[tuple[str, nn.Module, float]]:
        def cap_of(name: str) -> float:
            return next((float(cap) for pattern, cap in module_caps.items() if re.search(pattern, name)), weight_cap)
        return [(name, module, cap_of(name)) for name, module in model.named_modules()
                if isinstance(module, (nn.Linear, nn.Conv2d)) or hasattr(module, 'value_map')]

    def _initial_vectors(self, seed: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        return {name: nn.functional.normalize(torch.randn(module.weight.shape[0], generator=generator), dim=0).to(
            module.weight) for name, module, _ in self.matrices if not hasattr(module, 'value_map')}

    def _choose_alpha_max(self, alpha_max: float | None, max_bound: float | None) -> float:
        if alpha_max is not None:
            if max_bound is not None:
                raise ValueError('give alpha_max or max_bound, not both (max_bound chooses alpha_max)')
            return float(alpha_max)
        if max_bound is None:
            return max((m.gamma.detach().abs().max().item() for m in self.alphas), default=0.0)
        entries = describe(self.model, self.img_size)
        at_zero = network_bound(entries, CappedNorms(self, 0.0))
        if at_zero['unbounded']:
            raise ValueError(f'max_bound={max_bound}: no bound exists, these parts are not Lipschitz: '
                             f'{", ".join(at_zero["unbounded"][:3])} (use attn_type l2 or lipnorm, or scsa with '
                             f'v_norm=True, and norm_layer center)')
        if at_zero['log10_product_bound'] > math.log10(max_bound):
            raise ValueError(f'max_bound={max_bound} is below 10^{at_zero["log10_product_bound"]:.3f}, the bound of '
                             f'the layers outside the residuals at these caps; raise max_bound or lower the caps')

        def fits(alpha: float) -> bool:  # a hair below, so that the bound recomputed from logs stays <= max_bound
            bound = network_bound(entries, CappedNorms(self, alpha))['log10_product_bound']
            return bound <= math.log10(max_bound) - 1e-12

        low, high = 0.0, 1.0
        while fits(high) and high < 1e6:
            low, high = high, 2.0 * high
        for _ in range(60):
            middle = 0.5 * (low + high)
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low

    def bound(self) -> float | str:
        """Theorem 2's product bound that the caps guarantee (inf if some part has no bound, '10^x' beyond float64)."""
        return network_bound(describe(self.model, self.img_size), CappedNorms(self, self.alpha_max))['product_bound']

    @torch.no_grad()
    def refresh(self, iterations: int) -> dict[str, torch.Tensor]:
        """Spectral norm estimates of every capped matrix: power iterations on Linear and Conv weights (exact norms
        with ``exact``), exact norms for the small (and, at the identity, degenerate) value maps of L2 attention."""
        sigmas = {}
        for name, module, _ in self.matrices:
            if hasattr(module, 'value_map'):
                sigmas[name] = torch.linalg.matrix_norm(module.value_map.detach(), ord=2)
                continue
            weight = module.weight.detach().reshape(module.weight.shape[0], -1)
            if self.exact:
                sigmas[name] = torch.linalg.matrix_norm(weight, ord=2)
                continue
            u = self.vectors[name].to(weight.device)
            for _ in range(iterations):
                v = nn.functional.normalize(u @ weight, dim=0)
                weight_v = weight @ v
                u = nn.functional.normalize(weight_v, dim=0)
            self.vectors[name] = u
            sigmas[name] = u @ weight_v
        return sigmas

    @torch.no_grad()
    def __call__(self) -> None:
        """Project the model's weights into the constraint set (call after every optimizer step)."""
        sigmas = self.refresh(self.power_iterations)
        for name, module, cap in self.matrices:
            scale = (cap / sigmas[name]).clamp(max=1.0)
            if hasattr(module, 'value_map'):
                module.value_map.mul_(scale.view(-1, 1, 1))
            else:
                module.weight.mul_(scale)
        for layer in self.alphas:
            layer.gamma.clamp_(-self.alpha_max, self.alpha_max)
        for norm in self.gammas:
            norm.weight.clamp_(-self.gamma_max, self.gamma_max)
        for kernel in self.taus:
            kernel.tau.clamp_(-self.tau_caps[id(kernel)], self.tau_caps[id(kernel)])

    def state_dict(self) -> dict[str, Any]:
        """The cached power-iteration vectors (tensors only, safe for weights-only loading)."""
        return {name: u.detach().clone() for name, u in self.vectors.items()}

    def load_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Restore cached vectors saved by :meth:`state_dict` for the same model."""
        unknown = sorted(set(state_dict) - set(self.vectors))
        missing = sorted(set(self.vectors) - set(state_dict))
        if unknown or missing:
            raise ValueError(f'Lipschitz constraint state does not fit this model: unknown {unknown[:3]}, missing '
                             f'{missing[:3]}')
        for name, u in state_dict.items():
            if u.shape != self.vectors[name].shape:
                raise ValueError(f'Lipschitz constraint state for {name} has shape {tuple(u.shape)}, expected '
                                 f'{tuple(self.vectors[name].shape)}')
            self.vectors[name] = u.to(self.vectors[name])

