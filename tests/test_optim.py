"""The optimizer's kernel: torch's fused Adam / AdamW on CUDA, the multi-tensor form elsewhere, one update either way.

The fused kernel is compared with the multi-tensor one on the CPU, where torch has both: the recipes' AdamW with its
weight-decay groups and layer decay, gradient clipping between the updates, and a state handed from one to the other
as a resume from a checkpoint does.
"""
import copy
import os
from types import SimpleNamespace

import pytest
import timm
import torch
from tiny_models import TINY_MODELS
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from lipsformer.training import load_config
from lipsformer.training.optim import create_optimizer, fused_by_default
from lipsformer.training.train_state import optimizer_state_dict, set_optimizer_state

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')
# The two kernels round in other orders: after a few float32 updates the weights agree to this (relative norm).
RELATIVE_TOLERANCE = 1e-5

needs_fused_cpu = pytest.mark.skipif('cpu' not in _get_fused_kernels_supported_devices(),
                                     reason=f'torch {torch.__version__} has no fused optimizer kernels for the CPU')


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def _set_gradients(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for parameter in model.parameters():
        parameter.grad = torch.randn(parameter.shape, generator=generator)


def _update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    """One update of made-up gradients, clipped as the training loop clips them."""
    _set_gradients(model, seed)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _assert_same_weights(actual: torch.nn.Module, expected: torch.nn.Module) -> None:
    errors = {name: _relative_error(parameter.detach(), dict(expected.named_parameters())[name].detach())
              for name, parameter in actual.named_parameters()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < RELATIVE_TOLERANCE, f'{worst}: relative difference {errors[worst]:.2e}'


@needs_fused_cpu
@pytest.mark.parametrize('overrides', [[], ['optimizer.layer_decay=0.8']], ids=['decay_groups', 'layer_decay'])
def test_the_fused_update_equals_the_multi_tensor_update(overrides):
    config = load_config(os.path.join(CONFIGS, 'lipsformer_swin_tiny.yaml'), overrides)
    torch.manual_seed(0)
    multi_tensor_model = timm.create_model('lipsformer_swin_tiny', num_classes=10,
                                           **TINY_MODELS['lipsformer_swin_tiny'])
    fused_model = copy.deepcopy(multi_tensor_model)
    multi_tensor = create_optimizer(multi_tensor_model, config, global_batch=2048)
    fused = create_optimizer(fused_model, config, global_batch=2048, fused=True)
    assert multi_tensor.defaults.get('fused') in (None, False) and fused.defaults['fused'] is True
    # the same groups: decays and layer-decay scales
    assert [{k: v for k, v in group.items() if k not in ('params', 'fused')} for group in fused.param_groups] == \
        [{k: v for k, v in group.items() if k not in ('params', 'fused')} for group in multi_tensor.param_groups]
    initial = copy.deepcopy(multi_tensor_model)
    for seed in range(3):
        _update(multi_tensor_model, multi_tensor, seed)
        _update(fused_model, fused, seed)
    _assert_same_weights(fused_model, multi_tensor_model)
    assert any(_relative_error(p.detach(), q.detach()) > 1e-3 for p, q in zip(fused_model.parameters(),
                                                                              initial.parameters()))  # it trained


@needs_fused_cpu
def test_a_multi_tensor_checkpoint_resumes_into_the_fused_kernel():
    config = load_config(os.path.join(CONFIGS, 'lipsformer_swin_tiny.yaml'))
    torch.manual_seed(0)
    model = timm.create_model('lipsformer_swin_tiny', num_classes=10, **TINY_MODELS['lipsformer_swin_tiny'])
    optimizer = create_optimizer(model, config, global_batch=2048)
    _update(model, optimizer, seed=0)
    accelerator = SimpleNamespace(distributed_type='NO', unwrap_model=lambda module, keep_torch_compile=False: module)
    saved = copy.deepcopy(optimizer_state_dict(accelerator, model, optimizer))
    resumed_model = copy.deepcopy(model)
    resumed = create_optimizer(resumed_model, config, global_batch=2048, fused=True)
    assert set_optimizer_state(accelerator, resumed_model, resumed, saved) == []  # the kernel is no setting
    assert all(group['fused'] is True for group in resumed.param_groups)
    for seed in (1, 2):
        _update(model, optimizer, seed)
        _update(resumed_model, resumed, seed)
    _assert_same_weights(resumed_model, model)


def test_the_fused_kernel_is_the_default_for_adam_on_cuda_only():
    assert fused_by_default('adamw', {'cuda'}) and fused_by_default('AdamW', {'cuda'})
    assert fused_by_default('adam', {'cuda'})
    assert not fused_by_default('adamw', {'cpu'}) and not fused_by_default('adamw', {'cuda', 'cpu'})
    assert not fused_by_default('sgd', {'cuda'}) and not fused_by_default('lamb', {'cuda'})
    assert not fused_by_default('adamw', set())
    model = timm.create_model('lipsformer_swin_tiny', num_classes=10, **TINY_MODELS['lipsformer_swin_tiny'])
    optimizer = create_optimizer(model, load_config(None, []), global_batch=2048)  # on the CPU: multi-tensor
    assert optimizer.defaults.get('fused') in (None, False)
