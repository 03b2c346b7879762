"""Deferred initialisation as timm does it, on both families and on timm's Swin: build on the meta device (timm's
``device='meta'``, or ``with torch.device('meta')``), ``to_empty``, rebuild the non-persistent buffers with timm's
``reinit_non_persistent_buffers`` (each module's ``init_non_persistent_buffers``), load a state dict: the model then
equals one built the ordinary way."""
import pytest
import torch
from timm.models._manipulate import reinit_non_persistent_buffers
from tool_support import FORMS_WITH_CONTROL, build

pytestmark = pytest.mark.usefixtures('one_thread')


def _poison_buffers(model: torch.nn.Module) -> None:
    """Fill every buffer with values no model computes with (``to_empty`` leaves whatever memory the allocator hands
    back, which may by chance hold the right values): NaN, or an integer far beyond any index."""
    with torch.no_grad():
        for buffer in model.buffers():
            buffer.fill_(float('nan') if buffer.is_floating_point() else torch.iinfo(buffer.dtype).max)


def _materialise_and_load(model: torch.nn.Module, ordinary: torch.nn.Module) -> torch.nn.Module:
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    model = model.to_empty(device='cpu')
    _poison_buffers(model)
    reinit_non_persistent_buffers(model)
    model.load_state_dict(ordinary.state_dict())
    return model.eval()


def _assert_same_logits(model: torch.nn.Module, ordinary: torch.nn.Module) -> None:
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ordinary(x), rtol=0, atol=0)


@pytest.mark.parametrize(('name', 'form'), FORMS_WITH_CONTROL)
def test_built_under_the_meta_device_context_then_loaded_equals_ordinary_construction(name, form):
    ordinary = build(name, form).eval()
    with torch.device('meta'):
        model = build(name, form)
    _assert_same_logits(_materialise_and_load(model, ordinary), ordinary)


@pytest.mark.parametrize(('name', 'form'), FORMS_WITH_CONTROL)
def test_create_model_takes_the_meta_device(name, form):
    ordinary = build(name, form).eval()
    model = build(name, form, device='meta')
    _assert_same_logits(_materialise_and_load(model, ordinary), ordinary)
