"""The recipe as built from a config: parameter groups, batch-size scaling, the no-warmup per-update cosine, EMA
decay and losses, checked against the paper's numbers and first principles."""
import math
import os
from types import SimpleNamespace

import pytest
import timm
import torch
from accelerate.state import AcceleratorState
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.utils import ModelEmaV3
from tiny_models import TINY_MODELS, TINY_SWIN

import lipsformer.training.session as session
from lipsformer.training import ConfigError, load_config
from lipsformer.training.loop import _apply_update
from lipsformer.training.optim import (
    create_mixup,
    create_optimizer,
    create_scheduler,
    create_train_loss,
    ema_decay,
    global_batch_size,
    lr_scale,
)
from lipsformer.training.session import create_lipschitz_constraint

pytestmark = pytest.mark.usefixtures('one_thread')

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')


def _groups_by_decay(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[float, set[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {group['weight_decay']: {names[id(p)] for p in group['params']} for group in optimizer.param_groups}


@pytest.mark.parametrize('model_name, config_file, no_decay', [
    ('lipsformer_swin_tiny', 'lipsformer_swin_tiny.yaml', 0.0),
    ('lipsformer_swin_tiny', 'authors/lipsformer_swin_tiny.yaml', 5e-4),
    ('lipsformer_cswin_tiny', 'lipsformer_cswin_tiny.yaml', 0.0),
])
def test_weight_decay_skips_alpha_norms_biases_and_position_tables(model_name, config_file, no_decay):
    config = load_config(os.path.join(CONFIGS, config_file))
    model = timm.create_model(model_name, num_classes=10, **TINY_MODELS[model_name])
    groups = _groups_by_decay(create_optimizer(model, config, global_batch=2048), model)
    decayed, skipped = groups[config.optimizer.weight_decay], groups[no_decay]
    assert decayed | skipped == {n for n, _ in model.named_parameters()} and not decayed & skipped
    assert any('alpha' in n for n in skipped) and not any('alpha' in n for n in decayed)
    assert all(p.ndim > 1 for n, p in model.named_parameters() if n in decayed)
    assert all('relative_position_bias_table' not in n for n in decayed)
    assert all(n.endswith('.weight') for n in decayed)


def test_lr_follows_the_global_batch_from_the_paper_reference_of_2048():
    config = load_config(os.path.join(CONFIGS, 'lipsformer_swin_tiny.yaml'), ['train.batch_size=64',
                                                                              'train.grad_accum_steps=2'])
    global_batch = global_batch_size(config, num_processes=8)
    assert global_batch == 1024 and lr_scale(config, global_batch) == 0.5
    model = timm.create_model('lipsformer_swin_tiny', num_classes=10, **TINY_SWIN)
    optimizer = create_optimizer(model, config, global_batch)
    assert all(group['lr'] == pytest.approx(1e-3) for group in optimizer.param_groups)
    assert lr_scale(load_config(None, ['optimizer.lr_scaling=sqrt']), 512) == pytest.approx(0.5)
    assert lr_scale(load_config(None, ['optimizer.lr_base_batch_size=null']), 512) == 1.0


def test_no_warmup_cosine_stepped_per_update():
    config = load_config(os.path.join(CONFIGS, 'lipsformer_swin_tiny.yaml'), ['train.epochs=4'])
    model = timm.create_model('lipsformer_swin_tiny', num_classes=10, **TINY_SWIN)
    optimizer = create_optimizer(model, config, global_batch=2048)
    scheduler = create_scheduler(optimizer, config, updates_per_epoch=25, global_batch=2048)
    peak, floor, total = 2e-3, config.scheduler.min_lr, 100
    assert optimizer.param_groups[0]['lr'] == pytest.approx(peak)  # full lr at the first update: no warmup
    for step in (1, 10, 50, 77, 99):
        scheduler.step_update(num_updates=step)
        expected = floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * step / total))
        assert optimizer.param_groups[0]['lr'] == pytest.approx(expected, rel=1e-6)
    scheduler.step_update(num_updates=total)
    assert optimizer.param_groups[0]['lr'] == pytest.approx(floor)


def test_ema_decay_keeps_its_horizon_in_images():
    config = load_config(os.path.join(CONFIGS, 'lipsformer_swin_tiny.yaml'))
    assert ema_decay(config, 2048) == 0.99984
    half = ema_decay(config, 1024)
    assert half ** 2 == pytest.approx(0.99984) and 1 / (1 - half) == pytest.approx(2 / (1 - 0.99984), rel=1e-3)


def test_losses_and_mixup_follow_the_recipe():
    paper = load_config(os.path.join(CONFIGS, 'lipsformer_swin_tiny.yaml'))
    mixup = create_mixup(paper, num_classes=1000)
    assert isinstance(mixup, Mixup) and (mixup.mixup_alpha, mixup.cutmix_alpha, mixup.label_smoothing) == (
        0.8, 1.0, 0.1)
    assert isinstance(create_train_loss(paper, mixup), SoftTargetCrossEntropy)
    quickstart = load_config(os.path.join(CONFIGS, 'quickstart.yaml'))
    assert create_mixup(quickstart, 10) is None
    assert isinstance(create_train_loss(quickstart, None), LabelSmoothingCrossEntropy)


def test_ema_averages_the_weights_after_the_lipschitz_constraint():
    """The constraint projects the weights after each update; the EMA must average projected weights, or its copy
    (the one evaluated and exported as best) would not satisfy the constraint."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    ema = ModelEmaV3(model, decay=0.5)

    def cap_weights():
        with torch.no_grad():
            model.weight.clamp_(-0.1, 0.1)
    stub = SimpleNamespace(
        model=model, unwrapped_model=model, optimizer=optimizer, ema=ema, lipschitz=cap_weights,
        keeps_own_gradients=False, accelerator=SimpleNamespace(optimizer_step_was_skipped=False),
        config=SimpleNamespace(optimizer=SimpleNamespace(clip_grad=None)), progress=SimpleNamespace(step=1))
    cap_weights()
    ema.set(model)
    model(torch.full((8, 4), 10.0)).sum().backward()  # a large step takes the weights far past the cap
    _apply_update(stub, measure_grad_norm=False)
    assert model.weight.abs().max() <= 0.1 and ema.module.weight.abs().max() <= 0.1


def test_a_constraint_rejecting_its_settings_is_a_config_error():
    config = load_config(None, ['lipschitz.enabled=true', 'lipschitz.kwargs={power_iterations: 0}'])
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match='lipschitz.kwargs: .*power_iterations must be >= 1, got 0'):
        create_lipschitz_constraint(config.lipschitz, model)


@pytest.mark.parametrize('retain', [True, False])
def test_cpu_runs_retain_freed_memory_unless_switched_off(retain, monkeypatch, tmp_path):
    """train.cpu_retain_freed_memory (default on) applies lipsformer.utils.cpu_memory's malloc settings on a CPU run."""
    calls = []
    monkeypatch.setattr(session, 'retain_freed_memory', lambda: calls.append(True) or True)
    config = load_config(None, [f'train.cpu_retain_freed_memory={str(retain).lower()}', 'log.trackers=[]'])
    assert load_config(None).train.cpu_retain_freed_memory  # the default
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        device = session.create_accelerator(config, str(tmp_path)).device
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert device.type == 'cpu' and calls == ([True] if retain else [])
