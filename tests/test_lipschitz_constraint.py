"""Lipschitz-constrained training: LipschitzConstraint keeps Theorem 2's bound through training, and train.py's
``lipschitz.*`` config builds it."""
import math

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from tiny_models import TINY_CSWIN, TINY_SWIN

from lipsformer.layers import CenterNorm, ResidualAlpha
from lipsformer.lipschitz import LipschitzConstraint, reshaped_norm
from lipsformer.lipschitz.analysis import network_bound
from lipsformer.lipschitz.norm_sources import MeasuredNorms
from lipsformer.lipschitz.structure import describe
from lipsformer.training.config import LipschitzConfig
from lipsformer.training.session import create_lipschitz_constraint

pytestmark = pytest.mark.usefixtures('one_thread')


def _model(**kwargs):
    torch.manual_seed(0)
    return timm.create_model('lipsformer_cswin_tiny', **dict(TINY_CSWIN, num_classes=10, drop_path_rate=0.0,
                                                             attn_type='l2', **kwargs))


def _measured_log10_bound(model) -> float:
    """Theorem 2's product with the weights' true norms (convolutions as operators), in log10."""
    return network_bound(describe(model, (64, 64)), MeasuredNorms('operator'))['log10_product_bound']


def _train(model, steps, constraint=None, lr=1e-2):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.randn(8, 3, 64, 64, generator=generator), torch.randint(0, 10, (8,), generator=generator)
    for _ in range(steps):
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if constraint is not None:
            constraint()
    return loss.item()


MAX_BOUND = 1e7


@pytest.fixture(scope='module')
def unconstrained_bounds():
    """log10 of the bound of the model at initialisation and after 50 unconstrained steps at lr 1e-2."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    free = _model()
    at_init = _measured_log10_bound(free)
    _train(free, 50)
    torch.set_num_threads(threads)
    return at_init, _measured_log10_bound(free)


@pytest.mark.parametrize('exact', [False, True])
def test_fifty_steps_keep_the_bound_that_the_learning_rate_breaks_without_the_constraint(exact, unconstrained_bounds):
    at_init, after_training = unconstrained_bounds
    assert at_init < math.log10(MAX_BOUND) < after_training - 1  # lr 1e-2 breaks the bound by 10x or more
    constrained = _model()
    constraint = LipschitzConstraint(constrained, max_bound=MAX_BOUND, exact=exact)
    assert 0 < constraint.alpha_max < 0.2 and constraint.bound() <= MAX_BOUND
    loss = _train(constrained, 50, constraint)
    assert _measured_log10_bound(constrained) <= math.log10(MAX_BOUND)
    assert math.isfinite(loss) and loss < math.log(10)  # it still learns (chance: log 10)
    if not exact:  # power iteration may trail the last steps' changes (module docstring); it catches up
        for _ in range(20):
            constraint()
    for module in constrained.modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            assert reshaped_norm(module.weight) <= 1.0 + (1e-5 if exact else 1e-3)
        if isinstance(module, ResidualAlpha):
            assert module.gamma.abs().max() <= constraint.alpha_max
        if isinstance(module, CenterNorm):
            assert module.weight.abs().max() <= 1.0
        if hasattr(module, 'value_map'):
            assert torch.linalg.matrix_norm(module.value_map, ord=2).max() <= 1.0 + 1e-5


def test_caps_per_module_and_without_a_bound():
    model = timm.create_model('lipsformer_swin_tiny', **TINY_SWIN)  # the authors' SCSA: no bound, caps still apply
    constraint = LipschitzConstraint(model, weight_cap=0.5, module_caps={r'^head\.': 3.0}, gamma_max=2.0)
    assert math.isinf(constraint.bound())
    assert constraint.alpha_max == pytest.approx(1 / 5)  # the initial alpha
    with torch.no_grad():
        model.head.fc.weight.mul_(10)
        model.stages[0].blocks[0].mlp.fc1.weight.mul_(10)
        model.norm.weight.fill_(5.0)
    constraint()
    # Power iteration trails the true norm a little after a jump (here x10 in one step), then catches up.
    assert reshaped_norm(model.head.fc.weight) == pytest.approx(3.0, rel=1e-2)
    assert reshaped_norm(model.stages[0].blocks[0].mlp.fc1.weight) == pytest.approx(0.5, rel=1e-2)
    assert reshaped_norm(model.stages[0].blocks[0].attn.proj.weight) == pytest.approx(0.5, rel=1e-2)
    for _ in range(10):
        constraint()
    assert reshaped_norm(model.head.fc.weight) == pytest.approx(3.0, rel=1e-4)
    assert torch.all(model.norm.weight == 2.0)


def test_a_bound_that_cannot_be_kept_is_refused():
    model = timm.create_model('lipsformer_swin_tiny', **TINY_SWIN)  # the authors' SCSA: not Lipschitz
    with pytest.raises(ValueError, match='not Lipschitz: stages.0.blocks.0.attn'):
        LipschitzConstraint(model, max_bound=1e6)
    with pytest.raises(ValueError, match='below'):
        LipschitzConstraint(_model(), max_bound=1e-3)
    with pytest.raises(ValueError, match='not both'):
        LipschitzConstraint(_model(), max_bound=1e9, alpha_max=0.1)


def test_caps_work_on_any_timm_model():
    model = timm.create_model('resnet10t', num_classes=5)
    constraint = LipschitzConstraint(model, weight_cap=0.5, power_iterations=2)
    for _ in range(5):
        constraint()
    # Random (Kaiming) weights have clustered top singular values, where power iteration converges slowly from below.
    assert all(reshaped_norm(m.weight) <= 0.5 * (1 + 2e-2) for m in model.modules() if isinstance(m, nn.Conv2d))
    with pytest.raises(TypeError, match='not a LipsFormer model'):
        constraint.bound()


def test_state_dict_round_trip_and_mismatch():
    model = _model()
    constraint = LipschitzConstraint(model)
    state = constraint.state_dict()
    assert state and all(isinstance(v, torch.Tensor) for v in state.values())
    restored = LipschitzConstraint(model, seed=1)
    restored.load_state_dict(state)
    for name, vector in restored.state_dict().items():
        torch.testing.assert_close(vector, state[name])
    with pytest.raises(ValueError, match='does not fit this model'):
        LipschitzConstraint(_model(conv_config='A')).load_state_dict(state)


def test_training_config_builds_the_constraint():
    """The default lipschitz.target of train.py's config is this class; its kwargs reach it."""
    model = _model()
    settings = LipschitzConfig(enabled=True, kwargs={'max_bound': 1e8, 'power_iterations': 2})
    constraint = create_lipschitz_constraint(settings, model)
    assert isinstance(constraint, LipschitzConstraint) and constraint.power_iterations == 2
    assert constraint.bound() <= 1e8 and hasattr(constraint, 'state_dict')
    constraint()
