"""Lipschitz analysis of a LipsFormer model: bounds from its parts (Theorem 2) against empirical estimates.

Network bound (LipsFormer Theorem 2, written for every map of the chain):

    Lip(F) <= prod_plain Lip(g) * prod_residual (1 + alpha_i Lip(f_i))                         (product_bound)
           <= prod_plain Lip(g) * exp(kappa * sum_i alpha_i),    kappa = max_i Lip(f_i)          (exp_kappa_bound)

which is the paper's (1 + kappa/L)^L <= exp(kappa) when the alphas are 1/L and sum to 1. With drop path p_i each
residual factor is 1 with probability p_i (Appendix J), so the bound's expectation is
prod_plain * prod_i (1 + (1 - p_i) alpha_i Lip(f_i)); timm's DropPath rescales kept paths by 1/(1 - p_i), which
makes the expectation the full product again.
"""
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
from timm.layers import to_2tuple

from .empirical import capture_inputs, difference_quotient_ascent, explicit_attention, frozen, jacobian_norm
from .norm_sources import MeasuredNorms, NormSource
from .structure import Entry, describe, require_lipsformer

__all__ = ['analyze', 'network_bound']


def _log_sum(values: Sequence[float]) -> float:
    """sum(log(v)), +inf if any is infinite (products of ~100 factors can overflow float64)."""
    return sum(math.log(v) if math.isfinite(v) else math.inf for v in values)


def _exp(log_value: float) -> float | str:
    """exp(log_value); inf if unbounded; a '10^x' string if finite but beyond float64 (e.g. 1/eps factors)."""
    if log_value < 700.0:
        return math.exp(log_value)
    return math.inf if math.isinf(log_value) else f'10^{log_value / math.log(10):.2f}'


def _part_norms(entry: Entry, norms: MeasuredNorms) -> list[dict[str, Any]]:
    rows = []
    for name, module, size in entry.parts:
        row: dict[str, Any] = {'name': name, 'reshaped_norm': norms.matrix(module, module.weight)}
        if isinstance(module, nn.Conv2d):
            row.update(operator_norm=norms.conv(module, size), map_size=list(size))
        rows.append(row)
    if entry.kind == 'attention':  # L2 attention's value maps M_h: the largest norm over heads
        rows += [{'name': f'{entry.name}.{name}.value_map', 'reshaped_norm': norms.matrix(kernel, kernel.value_map)}
                 for name, kernel in entry.residual.function.named_modules() if hasattr(kernel, 'value_map')]
    return rows


def network_bound(entries: list[Entry], norms: NormSource) -> dict[str, Any]:
    """Theorem 2's product over ``entries`` with the norms of ``norms``, its exp(kappa) form and the drop-path mean."""
    plain, factors, lipschitz, alphas, kept = [], [], [], [], []
    unbounded, unproven = [], []
    for entry in entries:
        bound = entry.bound(norms)
        if not bound.bounded:
            unbounded.append(entry.name)
        elif not bound.proven:
            unproven.append(entry.name)
        if entry.residual is None:
            plain.append(bound.value)
            continue
        alpha = norms.alpha(entry.residual.alpha)
        lipschitz.append(bound.value)
        alphas.append(alpha)
        factors.append(1.0 + alpha * bound.value)
        kept.append(1.0 + (1.0 - entry.residual.drop_prob) * alpha * bound.value)
    log_plain, log_product = _log_sum(plain), _log_sum(plain) + _log_sum(factors)
    log_finite = _log_sum([v for v in plain + factors if math.isfinite(v)])
    kappa = max(lipschitz, default=0.0)
    log_exp_kappa = log_plain + (kappa * sum(alphas) if math.isfinite(kappa) else math.inf)
    return {
        'product_bound': _exp(log_product),
        'log10_product_bound': log_product / math.log(10),
        'exp_kappa_bound': _exp(log_exp_kappa),
        'log10_exp_kappa_bound': log_exp_kappa / math.log(10),
        'kappa': kappa,
        'sum_alpha': sum(alphas),
        'plain_layers_bound': _exp(log_plain),
        'drop_path_expected_bound': {'paper': _exp(log_plain + _log_sum(kept)),
                                     'timm_rescaled': _exp(log_plain + _log_sum(factors))},
        'unbounded': unbounded,
        'bounded_parts_product': _exp(log_finite),  # what the rest of the network contributes
        'log10_bounded_parts_product': log_finite / math.log(10),
        'not_proven': unproven,
    }


def _entry_rows(entries: list[Entry], operator: MeasuredNorms, reshaped: MeasuredNorms) -> list[dict[str, Any]]:
    rows = []
    for entry in entries:
        bound, paper_bound = entry.bound(operator), entry.bound(reshaped)
        row: dict[str, Any] = {'name': entry.name, 'kind': entry.kind, 'lipschitz_bound': bound.value,
                               'lipschitz_bound_reshaped': paper_bound.value, 'reason': bound.reason,
                               'proven': bound.proven}
        if entry.residual is not None:
            alpha = operator.alpha(entry.residual.alpha)
            row.update(alpha=alpha, drop_path=entry.residual.drop_prob, factor=1.0 + alpha * bound.value,
                       factor_reshaped=1.0 + alpha * paper_bound.value)
        row['parts'] = _part_norms(entry, operator)
        rows.append(row)
    return rows


def _empirical(model: nn.Module, entries: list[Entry], rows: list[dict[str, Any]], x: torch.Tensor,
               iterations: int, ascent_steps: int, branch_iterations: int, seed: int) -> dict[str, Any]:
    residuals = [(entry, row) for entry, row in zip(entries, rows) if entry.residual is not None]
    with frozen(model), explicit_attention(model):
        captured = capture_inputs(model, [entry.residual.input_of for entry, _ in residuals], x)
        for entry, row in residuals:
            branch_input = captured[id(entry.residual.input_of)]
            row['empirical'], _ = jacobian_norm(entry.residual.function, branch_input, branch_iterations, 1e-2, seed)
        power, direction = jacobian_norm(model, x, iterations, 1e-3, seed)
        ascent = difference_quotient_ascent(model, x, direction, steps=ascent_steps) if ascent_steps else power
    return {'power_iteration': power, 'gradient_ascent': max(ascent, power), 'iterations': iterations,
            'ascent_steps': ascent_steps, 'input': f'standard normal image, seed {seed}'}


def analyze(
        model: nn.Module,
        img_size: int | tuple[int, int] | None = None,
        empirical: bool = True,
        iterations: int = 10,
        ascent_steps: int = 10,
        branch_iterations: int = 5,
        seed: int = 0,
        inputs: torch.Tensor | None = None,
        progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Bounds and empirical estimates of the Lipschitz constant of a LipsFormer model and of each of its branches.

    Args:
        model: A lipsformer_swin_* or lipsformer_cswin_* model (put in eval mode; any other is refused with a
            TypeError). Many small operations: on a busy CPU one thread (``torch.set_num_threads(1)``) can be much
            faster.
        img_size: Input size; None for the model's default.
        empirical: Also measure (power iteration on the Jacobian, gradient ascent, per-branch estimates).
        iterations: Power iterations on the network's Jacobian.
        ascent_steps: Adam steps of the difference-quotient ascent (0 to skip).
        branch_iterations: Power iterations on each branch's Jacobian.
        seed: Seed of the random input image and starting directions.
        inputs: A (1, C, H, W) input to measure at instead of a random image.
        progress: Called with the report of the bounds once they are computed, before the (slower) measurements,
            so that a run cut short keeps them.

    Returns:
        A report: ``model``, ``img_size``, the network bounds of :func:`network_bound` (with operator norms of the
        convolutions; ``bounded_parts_product`` multiplies only the parts that have a bound) and ``reshaped`` (with
        the paper's reshaped norms), ``empirical_lipschitz``, ``branches`` (the weighted residuals) and
        ``plain_layers``. Infinite values mean unbounded; a network bound beyond
        float64 is a string '10^x'.
    """
    require_lipsformer(model)
    model.eval()
    size = to_2tuple(img_size) if img_size is not None else tuple(model.patch_embed.img_size)
    model._check_img_size(size)
    start = time.perf_counter()
    entries = describe(model, size)
    operator = MeasuredNorms('operator')
    reshaped = MeasuredNorms('reshaped', cache=operator.cache)
    rows = _entry_rows(entries, operator, reshaped)
    report: dict[str, Any] = {
        'model': getattr(model, 'pretrained_cfg', {}).get('architecture', type(model).__name__),
        'img_size': list(size),
        **network_bound(entries, operator),
        'reshaped': {k: v for k, v in network_bound(entries, reshaped).items()
                     if k in ('product_bound', 'log10_product_bound', 'exp_kappa_bound', 'bounded_parts_product')},
    }
    timings = {'bounds': time.perf_counter() - start}
    if progress is not None and empirical:
        progress(dict(report, branches=[dict(row) for row in rows if 'alpha' in row],
                      plain_layers=[dict(row) for row in rows if 'alpha' not in row], seconds=dict(timings)))
    if empirical:
        if inputs is None:
            generator = torch.Generator().manual_seed(seed)
            inputs = torch.randn(1, model.in_chans, *size, generator=generator)
        device = next(model.parameters()).device
        report['empirical_lipschitz'] = _empirical(model, entries, rows, inputs.to(device), iterations, ascent_steps,
                                                   branch_iterations, seed)
        timings['empirical'] = time.perf_counter() - start - timings['bounds']
    report['branches'] = [row for row in rows if 'alpha' in row]
    report['plain_layers'] = [row for row in rows if 'alpha' not in row]
    report['seconds'] = timings
    return report
