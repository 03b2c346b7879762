"""What the tests of PyTorch's and timm's tools on the models share (test_tool_*.py, test_cuda.py).

- :data:`FAMILIES` and :data:`WITH_CONTROL`: the two LipsFormer families at their tiny shapes, and the same plus timm's
  own Swin at Swin's tiny shape. A tool test must pass on timm's Swin, a plain module graph: that shows the test
  itself is right, whatever the LipsFormer models do.
- :func:`build`: a tiny model by name, on the CPU, 10 classes.
- :func:`plain_path`: the models' plain path (every fast path off), the reference fast paths are compared with.
- :func:`assert_close_to`: a comparison whose tolerance follows the dtype and the reference's scale.
"""
import contextlib
import importlib
from collections.abc import Iterator
from unittest import mock

import pytest
import timm
import torch
from tiny_models import TIMM_SWIN, TINY_MODELS, TINY_SWIN

import lipsformer.layers

FAMILIES = list(TINY_MODELS)
# The shape of each name in WITH_CONTROL; timm's Swin takes TINY_SWIN's keyword arguments as they are.
SHAPES = {**TINY_MODELS, TIMM_SWIN: TINY_SWIN}
WITH_CONTROL = [*FAMILIES, pytest.param(TIMM_SWIN, id='timm_swin')]
NUM_CLASSES = 10


def build(name: str, **kwargs) -> torch.nn.Module:
    """``timm.create_model(name)`` at its tiny shape (``SHAPES``), 10 classes, ``kwargs`` overriding."""
    return timm.create_model(name, **{**SHAPES[name], 'num_classes': NUM_CLASSES, **kwargs})


@contextlib.contextmanager
def plain_path() -> Iterator[None]:
    """Run the models on their plain path: ``lipsformer.layers.set_fast_path(False)``, the package's one switch.

    A lipsformer without the switch gets the nearest equivalent: its lean autograd Functions bypassed (the oneDNN
    products and the depthwise weight-gradient kernel run in float32 only, so in float64 the models are then plain
    PyTorch operations). References are computed in float64 for that reason.
    """
    set_fast_path = getattr(lipsformer.layers, 'set_fast_path', None)
    if set_fast_path is not None:
        with set_fast_path(False):
            yield
        return
    try:
        lean_autograd = importlib.import_module('lipsformer.layers.lean_autograd')
    except ImportError:
        lean_autograd = None
    if lean_autograd is None or not hasattr(lean_autograd, '_lean'):
        yield
        return
    with mock.patch.object(lean_autograd, '_lean', lambda *tensors: False):
        yield


# Relative to the reference's largest magnitude: float64 leaves room for summation order only; float32 against a
# float64 reference, for rounding through a dozen layers and a second derivative.
TOLERANCES = {torch.float64: 1e-9, torch.float32: 2e-4}


def assert_close_to(actual: torch.Tensor | None, reference: torch.Tensor | None, dtype: torch.dtype,
                    what: str = '', scale: float | None = None) -> None:
    """``actual`` (computed in ``dtype``) equals ``reference`` to ``TOLERANCES[dtype]`` relative to ``scale`` (default:
    the reference's largest magnitude); a missing gradient (None) counts as zeros."""
    if actual is None and reference is None:
        return
    if actual is None:
        actual = torch.zeros_like(reference)
    if reference is None:
        reference = torch.zeros_like(actual)
    reference = reference.detach().double()
    tolerance = TOLERANCES[dtype]
    scale = max(reference.abs().max().item() if scale is None else scale, 1e-12)
    torch.testing.assert_close(actual.detach().double(), reference, rtol=tolerance, atol=tolerance * scale,
                               msg=lambda message: f'{what}: {message}')
