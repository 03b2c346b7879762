"""Token-wise linear layers through oneDNN's 1x1 convolution (lipsformer.fastpath.onednn_linear) against F.linear."""
import pytest
import torch
import torch.nn.functional as F

from lipsformer.fastpath import onednn_linear as onednn_linear_module
from lipsformer.fastpath.onednn_linear import linear_backward, onednn_linear


@pytest.fixture
def conv_calls(monkeypatch):
    """Counts the 1x1 convolutions ``onednn_linear`` runs."""
    calls = []
    conv2d = F.conv2d
    monkeypatch.setattr(onednn_linear_module.F, 'conv2d',
                        lambda *args, **kwargs: calls.append(1) or conv2d(*args, **kwargs))
    return calls


def _values_and_gradients(function, x, weight, bias, seed_grad):
    inputs = [t.detach().clone().requires_grad_(True) for t in (x, weight, bias)]
    out = function(*inputs)
    return (out, *torch.autograd.grad(out, inputs, seed_grad))


@pytest.mark.parametrize('shape', [(2, 32, 17, 24), (1100, 24), (1, 7, 7, 24), (3, 24)])
def test_linear_on_cpu_is_a_1x1_convolution_with_f_linear_s_values_and_gradients(shape, conv_calls):
    """Whatever the number of rows: the kernel depends on device and dtype only, so that a batch or token count that
    export keeps dynamic picks no branch."""
    x, weight, bias = torch.randn(*shape), torch.randn(40, 24), torch.randn(40)
    seed_grad = torch.randn(*shape[:-1], 40)
    ours = _values_and_gradients(onednn_linear, x, weight, bias, seed_grad)
    expected = _values_and_gradients(F.linear, x, weight, bias, seed_grad)
    assert conv_calls  # the oneDNN path ran (float32, CPU)
    for got, want in zip(ours, expected):  # float32 sums in another order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert ours[0].shape == (*shape[:-1], 40)


def test_linear_reads_a_strided_input(conv_calls):
    projection = torch.randn(2, 40, 30, 3, 24)
    x = projection[:, :, :, 1]  # a slice of channels, as a window partition of a projection is
    weight, bias = torch.randn(16, 24), None
    torch.testing.assert_close(onednn_linear(x, weight, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert conv_calls


@pytest.mark.parametrize('case', ['float64', 'bfloat16 autocast'])
def test_elsewhere_linear_is_f_linear(case, conv_calls):
    weight, bias = torch.randn(40, 24), torch.randn(40)
    if case == 'float64':
        x, weight, bias = torch.randn(50, 30, 24).double(), weight.double(), bias.double()
    if case == 'bfloat16 autocast':
        x = torch.randn(50, 30, 24)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out = onednn_linear(x, weight, bias)
        assert out.dtype == torch.bfloat16
    else:
        torch.testing.assert_close(onednn_linear(x, weight, bias), F.linear(x, weight, bias))
    assert not conv_calls


@pytest.mark.parametrize('need_input', [False, True])
@pytest.mark.parametrize('need_weight', [False, True])
@pytest.mark.parametrize('need_bias', [False, True])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])  # oneDNN's convolution backward, then BLAS
def test_linear_backward_gives_f_linear_s_gradients(need_input, need_weight, need_bias, dtype):
    x, weight = torch.randn(3, 400, 24, dtype=dtype, requires_grad=True), torch.randn(40, 24, dtype=dtype)
    weight.requires_grad_(True)
    bias = torch.randn(40, dtype=dtype, requires_grad=True)
    grad = torch.randn(3, 400, 40, dtype=dtype)
    expected = torch.autograd.grad(F.linear(x, weight, bias), (x, weight, bias), grad)
    got = linear_backward(grad, x.detach(), weight.detach(), need_input, need_weight, need_bias)
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else {}
    for value, wanted, needed in zip(got, expected, (need_input, need_weight, need_bias)):
        assert (value is not None) == needed
        if needed:
            torch.testing.assert_close(value, wanted, **tolerance)
