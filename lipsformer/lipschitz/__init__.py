"""Lipschitz analysis of LipsFormer models, the theorems behind it, and Lipschitz-constrained training.

- :func:`analyze`: per-branch and whole-network bounds (LipsFormer Theorem 2 with each part's bound) and empirical
  estimates; ``python -m lipsformer.lipschitz --model NAME`` prints them and writes them as JSON.
- :class:`LipschitzConstraint`: a callable run after each optimizer step that keeps the bound (train.py's
  ``lipschitz.*`` config keys).
"""
from .analysis import analyze, network_bound
from .constraint import LipschitzConstraint
from .empirical import difference_quotient_ascent, jacobian_norm, jacobian_norm_ascent
from .norms import activation_lipschitz, conv_operator_norm, largest_singular_value, reshaped_norm
from .structure import describe
from .theorems import dasoulas_bound, kim_c, kim_mha_bound_2, kim_mha_bound_inf, lambert_w0, scsa_head_bound

__all__ = [
    'LipschitzConstraint', 'activation_lipschitz', 'analyze', 'conv_operator_norm', 'dasoulas_bound', 'describe',
    'difference_quotient_ascent', 'jacobian_norm', 'jacobian_norm_ascent', 'kim_c', 'kim_mha_bound_2',
    'kim_mha_bound_inf', 'lambert_w0', 'largest_singular_value', 'network_bound', 'reshaped_norm', 'scsa_head_bound',
]
