"""What the tests of PyTorch's and timm's tools on the models share (test_tool_*.py, test_cuda.py).

- :data:`FAMILIES` and :data:`WITH_CONTROL`: the two LipsFormer families at their tiny shapes, and the same plus timm's
  own Swin at Swin's tiny shape. A tool test must pass on timm's Swin, a plain module graph: that shows the test
  itself is right, whatever the LipsFormer models do.
- :func:`build`: a tiny model by name, on the CPU, 10 classes.
- :func:`plain_path`: a model as its plain module graph (``lipsformer.fastpath.to_plain_form``) inside a block, the
  reference a fast form is compared with; :data:`FORMS`, the forms a tool test runs a model in.
- :func:`assert_close_to`: a comparison whose tolerance follows the dtype and the reference's scale.
"""
import contextlib
from collections.abc import Iterator

import forms_support
import pytest
import timm
import torch
from forms_support import in_form
from tiny_models import TIMM_SWIN, TINY_MODELS, TINY_SWIN

FAMILIES = list(TINY_MODELS)
# The shape of each name in WITH_CONTROL; timm's Swin takes TINY_SWIN's keyword arguments as they are.
SHAPES = {**TINY_MODELS, TIMM_SWIN: TINY_SWIN}
WITH_CONTROL = [*FAMILIES, pytest.param(TIMM_SWIN, id='timm_swin')]
NUM_CLASSES = 10


# The forms a tool test runs a model in: what timm.create_model returns, and its fast form on the CPU.
FORMS = ['plain', 'fast']
# Each family in each form, and timm's Swin (plain: it has no fast form), as (name, form).
FORMS_WITH_CONTROL = [*[pytest.param(name, form, id=f'{name}-{form}') for name in FAMILIES for form in FORMS],
                      pytest.param(TIMM_SWIN, 'plain', id='timm_swin')]


def build(name: str, form: str = 'plain', **kwargs) -> torch.nn.Module:
    """``timm.create_model(name)`` at its tiny shape (``SHAPES``), 10 classes, ``kwargs`` overriding, in ``form``
    (``'fast'``: given its fast form for the CPU)."""
    model = timm.create_model(name, **{**SHAPES[name], 'num_classes': NUM_CLASSES, **kwargs})
    return in_form(model, form == 'fast', 'cpu')


@contextlib.contextmanager
def plain_path(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` as its plain module graph inside the block, in its own form after it."""
    with forms_support.form(model, False):
        yield model


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
