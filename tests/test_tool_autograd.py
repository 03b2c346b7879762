"""Higher-order and functional autograd through both families and timm's Swin, equal to the plain path.

Gradient penalties (``torch.autograd.grad(..., create_graph=True)`` then a backward of the penalty),
``torch.autograd.functional.jvp`` / ``vjp`` / ``hvp`` (the power iteration that estimates a local Lipschitz constant
is a jvp), and ``torch.func.jvp`` / ``jacrev`` / ``vmap`` (per-sample gradients included): for a Lipschitz package,
Jacobians are the point. Every custom autograd Function must be twice differentiable and work under torch.func.

Each result is compared with the models' plain path (:func:`tool_support.plain_path`) computed in float64: train
mode in float32 (where every fast path runs, the float32-only ones included), to 2e-4 of the result's scale, and eval
mode in float64, to 1e-9; timm's Swin, the control, in train mode. Train mode runs with drop path (the same seed
draws the same masks) for the reverse-mode tools, without it for torch.func (whose vmap refuses random operations).
"""
import copy
import os
import subprocess
import sys

import pytest
import timm
import torch
import torch.nn.functional as F
from tiny_models import TIMM_SWIN
from tool_support import FAMILIES, FORMS, assert_close_to, build, plain_path
from torch.func import functional_call
from torch.nn.attention import SDPBackend, sdpa_kernel

pytestmark = pytest.mark.usefixtures('one_thread')

CASES = [
    *[pytest.param(name, mode, dtype, form, id=f'{name}-{form}-{mode}-{str(dtype)[6:]}')
      for name in FAMILIES for form in FORMS for mode, dtype in (('train', torch.float32), ('eval', torch.float64))],
    pytest.param(TIMM_SWIN, 'train', torch.float32, 'plain', id='timm_swin-train-float32'),
]
SEED = 1
NUM_CLASSES = 5  # a short Jacobian


def _model(name: str, mode: str, drop_path_rate: float, form: str) -> torch.nn.Module:
    return build(name, form, num_classes=NUM_CLASSES, drop_path_rate=drop_path_rate).train(mode == 'train')


def _images(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 64, 64, dtype=torch.float64)


def _assert_equal_to_plain_path(model, dtype, compute, inputs, names, reference_compute=None):
    """``compute(model, *inputs)`` (a list of tensors) in ``dtype`` equals ``reference_compute`` (default: ``compute``)
    on the plain path in float64; ``names`` label the results, those starting with 'grad ' compared at the scale of
    all of them together (a parameter whose gradient is all but zero is then not held to its own)."""
    torch.manual_seed(SEED)
    actual = compute(copy.deepcopy(model).to(dtype), *[t.to(dtype) for t in inputs])
    # PyTorch's fused CPU attention kernels have neither a double backward nor forward AD: the reference is the
    # plain path with SDPA's math backend, the explicit expression.
    with plain_path(copy.deepcopy(model).double()) as plain_model, sdpa_kernel(SDPBackend.MATH):
        torch.manual_seed(SEED)
        reference = (reference_compute or compute)(plain_model, *inputs)
    assert len(reference) == len(names)
    gradient_scale = max((r.abs().max().item() for n, r in zip(names, reference)
                          if n.startswith('grad ') and r is not None), default=None)
    for a, r, n in zip(actual, reference, names):
        assert_close_to(a, r, dtype, n, gradient_scale if n.startswith('grad ') else None)


def _parameter_names(model: torch.nn.Module) -> list[str]:
    return [f'grad {n}' for n, _ in model.named_parameters()]


@pytest.mark.parametrize(('name', 'mode', 'dtype', 'form'), CASES)
def test_gradient_penalty_double_backward(name, mode, dtype, form):
    model = _model(name, mode, 0.2, form)
    weights = torch.randn(2, NUM_CLASSES, dtype=torch.float64)

    def penalty(model, x, weights):
        x = x.detach().requires_grad_()
        out = model(x)
        (grad_x,) = torch.autograd.grad((out * weights).sum(), x, create_graph=True)
        value = grad_x.square().sum()
        value.backward()
        return [out, grad_x, value, x.grad, *(p.grad for p in model.parameters())]

    names = ['logits', 'input gradient', 'penalty', 'penalty input gradient', *_parameter_names(model)]
    _assert_equal_to_plain_path(model, dtype, penalty, [_images(), weights], names)


@pytest.mark.parametrize(('name', 'mode', 'dtype', 'form'), CASES)
def test_autograd_functional_jvp(name, mode, dtype, form):
    model = _model(name, mode, 0.2, form)
    _assert_equal_to_plain_path(model, dtype, lambda m, x, v: list(torch.autograd.functional.jvp(m, x, v)),
                                [_images(), _images()], ['logits', 'jvp'])


@pytest.mark.parametrize(('name', 'mode', 'dtype', 'form'), CASES)
def test_autograd_functional_vjp(name, mode, dtype, form):
    model = _model(name, mode, 0.2, form)
    cotangent = torch.randn(2, NUM_CLASSES, dtype=torch.float64)
    _assert_equal_to_plain_path(model, dtype, lambda m, x, u: list(torch.autograd.functional.vjp(m, x, u)),
                                [_images(), cotangent], ['logits', 'vjp'])


@pytest.mark.parametrize(('name', 'mode', 'dtype', 'form'), CASES)
def test_autograd_functional_hvp(name, mode, dtype, form):
    model = _model(name, mode, 0.2, form)
    targets = torch.tensor([1, 3])

    def hvp(model, x, v):
        return list(torch.autograd.functional.hvp(lambda y: F.cross_entropy(model(y), targets), x, v))

    _assert_equal_to_plain_path(model, dtype, hvp, [_images(), _images()], ['loss', 'hvp'])


@pytest.mark.parametrize(('name', 'mode', 'dtype', 'form'), CASES)
def test_func_jvp(name, mode, dtype, form):
    model = _model(name, mode, 0.0, form)

    def jvp(model, x, v):
        # On the module (its parameters require grad), and through functional_call with detached parameters, as
        # torch.func's documentation writes it (then nothing requires grad and no backward is planned).
        detached = {n: t.detach() for n, t in [*model.named_parameters(), *model.named_buffers()]}
        return [*torch.func.jvp(model, (x,), (v,)),
                *torch.func.jvp(lambda y: functional_call(model, detached, (y,)), (x,), (v,))]

    def reference(model, x, v):
        return 2 * list(torch.autograd.functional.jvp(model, x, v))

    _assert_equal_to_plain_path(model, dtype, jvp, [_images(), _images()],
                                ['logits', 'jvp', 'logits (functional_call)', 'jvp (functional_call)'],
                                reference_compute=reference)


@pytest.mark.parametrize(('name', 'mode', 'dtype', 'form'), CASES)
def test_func_jacrev(name, mode, dtype, form):
    model = _model(name, mode, 0.0, form)
    _assert_equal_to_plain_path(
        model, dtype, lambda m, x: [torch.func.jacrev(m)(x)], [_images(1)], ['jacobian'],
        reference_compute=lambda m, x: [torch.autograd.functional.jacobian(m, x)])


@pytest.mark.parametrize(('name', 'mode', 'dtype', 'form'), CASES)
def test_func_vmap_over_images_and_per_sample_gradients(name, mode, dtype, form):
    model = _model(name, mode, 0.0, form)
    targets = torch.tensor([1, 3])

    def per_image(model, x):
        logits = torch.func.vmap(lambda image: model(image.unsqueeze(0)).squeeze(0))(x)
        params = {n: p.detach() for n, p in model.named_parameters()}
        buffers = dict(model.named_buffers())

        def loss(params, image, target):
            logits = functional_call(model, (params, buffers), (image.unsqueeze(0),))
            return F.cross_entropy(logits, target.unsqueeze(0))

        grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, x, targets)
        return [logits, *grads.values()]

    def one_at_a_time(model, x):
        grads = []
        for image, target in zip(x, targets):
            model.zero_grad(set_to_none=False)
            F.cross_entropy(model(image.unsqueeze(0)), target.unsqueeze(0)).backward()
            grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()])
        with torch.no_grad():
            logits = model(x)
        return [logits, *(torch.stack(per_param) for per_param in zip(*grads))]

    _assert_equal_to_plain_path(model, dtype, per_image, [_images()], ['logits', *_parameter_names(model)],
                                reference_compute=one_at_a_time)


def test_one_switch_turns_the_fast_paths_off():
    """``lipsformer.fastpath.set_fast_path(False)`` (a call, and a context manager restoring the previous state),
    ``use_fast_path()``, ``LIPSFORMER_FAST_PATH=0`` and timm's exportable / scriptable layer config."""
    from lipsformer.fastpath import set_fast_path, use_fast_path
    assert use_fast_path() == (os.environ.get('LIPSFORMER_FAST_PATH') != '0')
    with set_fast_path(True):
        with set_fast_path(False):
            assert not use_fast_path()
            with set_fast_path(True):
                assert use_fast_path()
            assert not use_fast_path()
        assert use_fast_path()
        set_fast_path(False)
        assert not use_fast_path()
        set_fast_path(None)
        for config in (dict(exportable=True), dict(scriptable=True)):
            with timm.layers.set_layer_config(**config):
                assert not use_fast_path(), config
        assert use_fast_path()
    code = 'import lipsformer.fastpath as fastpath; print(fastpath.use_fast_path())'
    env = {**os.environ, 'LIPSFORMER_FAST_PATH': '0'}
    out = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == 'False', (out.stdout, out.stderr)
