"""Lean autograd (lipsformer.fastpath.lean_autograd): the plain expressions' values and gradients (twice), fewer
saved tensors."""
import pytest
import torch
import torch.nn.functional as F
from tiny_models import TINY_MODELS

from lipsformer.fastpath import l2_normalize
from lipsformer.fastpath.lean_autograd import _GeluResidual, _ScaledLinear, gelu_residual, scaled_linear
from lipsformer.instruments.benchmark import BenchmarkConfig, saved_activations_mb


def _linear_reference(x, weight, bias, scale, gelu):
    if scale is not None:
        weight, bias = weight * scale[:, None], (bias * scale if bias is not None else None)
    return F.linear(F.gelu(x) if gelu else x, weight, bias)


def _gradients(function, inputs, seed_grad):
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None for t in inputs]
    out = function(*inputs)
    wanted = [t for t in inputs if t is not None and t.requires_grad]
    return out, torch.autograd.grad(out, wanted, seed_grad)


def _assert_same(lean, plain, inputs, atol=1e-5):
    seed_grad = torch.randn_like(plain(*inputs))
    out, grads = _gradients(lean, inputs, seed_grad)
    expected_out, expected_grads = _gradients(plain, inputs, seed_grad)
    torch.testing.assert_close(out, expected_out, atol=atol, rtol=1e-5)
    for grad, expected in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected, atol=atol, rtol=1e-5)


@pytest.mark.parametrize('gelu', [False, True])
@pytest.mark.parametrize('with_scale', [False, True])
@pytest.mark.parametrize('with_bias', [False, True])
def test_linear_passes_gradcheck(gelu, with_scale, with_bias):
    x = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(4, dtype=torch.float64, requires_grad=True) if with_bias else None
    scale = torch.rand(4, dtype=torch.float64, requires_grad=True) if with_scale else None
    assert torch.autograd.gradcheck(lambda *args: _ScaledLinear.apply(*args, gelu), (x, weight, bias, scale))
    # Twice differentiable: a recorded backward (create_graph=True) differentiates the plain expression.
    assert torch.autograd.gradgradcheck(lambda *args: _ScaledLinear.apply(*args, gelu), (x, weight, bias, scale))


@pytest.mark.parametrize('gelu', [False, True])
@pytest.mark.parametrize('shape', [(1, 7, 7, 16), (4, 16, 17, 16)])
def test_linear_equals_the_plain_expression(gelu, shape):
    inputs = [torch.randn(*shape, requires_grad=True), torch.randn(8, 16, requires_grad=True),
              torch.randn(8, requires_grad=True), torch.rand(8, requires_grad=True)]
    _assert_same(lambda *args: scaled_linear(*args, gelu=gelu), lambda *args: _linear_reference(*args, gelu), inputs)
    # A fixed scale and weight (alpha as a buffer, a frozen layer): only the input's gradient.
    inputs = [inputs[0], inputs[1].detach(), None, inputs[3].detach()]
    _assert_same(lambda *args: scaled_linear(*args, gelu=gelu), lambda *args: _linear_reference(*args, gelu), inputs)


@pytest.mark.parametrize('scale_shape', [(6,), (3, 1, 1, 6)])
def test_gelu_residual_passes_gradcheck_and_equals_the_plain_expression(scale_shape):
    x = torch.randn(3, 4, 5, 6, dtype=torch.float64, requires_grad=True)
    z = torch.randn(3, 4, 5, 6, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(scale_shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_GeluResidual.apply, (x, z, scale))
    assert torch.autograd.gradgradcheck(_GeluResidual.apply, (x, z, scale))
    inputs = [t.float() for t in (x, z, scale)]
    _assert_same(gelu_residual, lambda x, z, s: x + s * F.gelu(z), inputs)


@pytest.mark.parametrize('scale', [1.0, 12.0])
def test_l2_normalize_equals_f_normalize_in_values_and_gradients(scale):
    qkv = torch.randn(2, 49, 3, 3, 8).permute(2, 0, 3, 1, 4)  # q as a strided view of a qkv projection
    q = qkv[0].clone().requires_grad_(True)
    q.data[0, 0, :3] *= 1e-14  # some rows below the eps floor
    _assert_same(lambda t: l2_normalize(t, 1e-12, scale), lambda t: scale * F.normalize(t, dim=-1, eps=1e-12), [q])
    out = l2_normalize(qkv[0].requires_grad_(True), 1e-12, scale)
    assert out.is_contiguous()  # on the CPU: what the explicit attention product reads


def test_l2_normalize_in_bfloat16_is_close_to_float32():
    x = torch.randn(4, 3, 49, 32)
    grad = torch.randn_like(x)
    x32, x16 = x.clone().requires_grad_(True), x.bfloat16().requires_grad_(True)
    (l2_normalize(x32, 1e-12, 10.0) * grad).sum().backward()
    out16 = l2_normalize(x16, 1e-12, 10.0)
    (out16 * grad.bfloat16()).sum().backward()
    assert out16.dtype == torch.bfloat16 and x16.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x16.grad.float(), x32.grad, atol=0.05, rtol=0.02)


def test_without_a_backward_the_plain_expression_runs():
    x, weight = torch.randn(3, 5, requires_grad=True), torch.randn(4, 5)
    with torch.no_grad():
        assert scaled_linear(x, weight, None).grad_fn is None
    assert scaled_linear(x.detach(), weight, None).grad_fn is None
    assert type(scaled_linear(x, weight, None).grad_fn).__name__ == '_ScaledLinearBackward'  # the lean Function


@pytest.mark.parametrize('case', ['linear_gelu', 'linear_scaled', 'gelu_residual', 'l2_normalize'])
def test_lean_functions_save_one_activation(case):
    x = torch.randn(8, 49, 32, requires_grad=True)
    weight, bias, scale = (torch.nn.Parameter(torch.randn(32, 32)), torch.nn.Parameter(torch.randn(32)),
                           torch.nn.Parameter(torch.rand(32)))
    one_activation = x.numel() * 4 / 2 ** 20 / x.shape[0]
    lean, plain = {
        'linear_gelu': (lambda t: scaled_linear(t, weight, bias, gelu=True),
                        lambda t: _linear_reference(t, weight, bias, None, True)),
        'linear_scaled': (lambda t: scaled_linear(t, weight, bias, scale), lambda t: _linear_reference(t, weight, bias,
                                                                                                 scale, False)),
        'gelu_residual': (lambda t: gelu_residual(t, t * 2, scale), lambda t: t + scale * F.gelu(t * 2)),
        'l2_normalize': (lambda t: l2_normalize(t[..., :16], 1e-12, 10.0),
                         lambda t: t[..., :16] * t[..., :16].square().sum(-1, keepdim=True).rsqrt() * 10),
    }[case]

    class Wrap(torch.nn.Module):
        def __init__(self, function):
            super().__init__()
            self.function, self.params = function, torch.nn.ParameterList([weight, bias, scale])

        def forward(self, t):
            return self.function(t)

    config = BenchmarkConfig()
    lean_mb, plain_mb = saved_activations_mb(Wrap(lean), x, config), saved_activations_mb(Wrap(plain), x, config)
    # The input of l2_normalize is a view of x: the lean form keeps half of x's size (its output) and the norms.
    expected = (0.5 + 1 / 32) * one_activation if case == 'l2_normalize' else one_activation
    assert lean_mb == pytest.approx(expected, rel=1e-9)
    if case == 'linear_scaled':  # the plain form also keeps the scaled weight
        assert plain_mb == pytest.approx(lean_mb + weight.numel() * 4 / 2 ** 20 / x.shape[0], rel=1e-9)
    else:  # and the others a second activation: gelu's output, or all of x beside the normalised half
        assert plain_mb > 1.9 * lean_mb


def _train_step_gradients(model, x, seed):
    torch.manual_seed(seed)  # the same drop-path draws
    model.zero_grad()
    model(x).logsumexp(-1).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize('name', TINY_MODELS)
def test_whole_models_train_with_the_gradients_of_the_plain_expressions(name):
    import timm
    from forms_support import form
    model = timm.create_model(name, drop_path_rate=0.3, **TINY_MODELS[name]).train()
    x = torch.randn(3, 3, 64, 96)  # cut windows and stripes
    config = BenchmarkConfig()
    with form(model, True):
        lean = _train_step_gradients(model, x, seed=5)
        lean_mb = saved_activations_mb(model, x, config)
    plain = _train_step_gradients(model, x, seed=5)
    assert saved_activations_mb(model, x, config) > 1.3 * lean_mb
    assert lean.keys() == plain.keys()
    for key in lean:  # float32 sums in another order: close relative to the largest entry of each gradient
        torch.testing.assert_close(lean[key], plain[key], rtol=1e-4, atol=1e-5 * plain[key].abs().max().item(),
                                   msg=lambda text: f'{key}: {text}')


def _mlp_reference(x, weight1, bias1, weight2, bias2, scale):
    return _linear_reference(F.gelu(F.linear(x, weight1, bias1)), weight2, bias2, scale, False)


@pytest.mark.parametrize('shape', [(1, 3, 5, 16), (2, 32, 17, 16)])
def test_mlp_equals_timm_mlp_with_the_scale_on_its_output(shape):
    from lipsformer.fastpath.lean_autograd import lean_mlp
    inputs = [torch.randn(*shape, requires_grad=True), 0.2 * torch.randn(64, 16), torch.randn(64),
              0.1 * torch.randn(16, 64), torch.randn(16), torch.rand(16)]
    inputs = [t.detach().requires_grad_(True) for t in inputs]
    _assert_same(lean_mlp, _mlp_reference, inputs)
    assert type(lean_mlp(*inputs).grad_fn).__name__ == '_ScaledLinearBackward'  # fc2 keeps fc1's output, not GELU's
    with torch.no_grad():
        torch.testing.assert_close(lean_mlp(*inputs), _mlp_reference(*inputs))
