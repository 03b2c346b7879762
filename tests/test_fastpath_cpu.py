"""The fast path's CPU backwards, its PyTorch code against the plain path's float64 gradients: the conv shortcut's
depthwise weight gradient (the ``lipsformer::depthwise_conv2d`` op's on the CPU, an image at a time) and the GELU
residual's backward (lipsformer.fastpath.lean_autograd), on the shapes where a reordered sum or a tail of GELU would
show."""
import pytest
import torch
import torch.nn.functional as F

from lipsformer.fastpath import depthwise_conv_op
from lipsformer.fastpath.lean_autograd import gelu_residual


def _plain_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The plain path: F.conv2d on the channels-last map, NHWC out."""
    kernel = weight.shape[-1]
    return F.conv2d(x.permute(0, 3, 1, 2), weight, bias, padding=kernel // 2, groups=x.shape[-1]).permute(0, 2, 3, 1)


def _assert_close_to(got: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    # float32 sums of up to 1000 products, in another order: close relative to the largest entry
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-6 * expected.abs().max().item(),
                               msg=lambda text: f'{name}: {text}')


# Maps narrower than the 7-column window (1-3 columns), a single row, a single pixel (only the centre tap sees data),
# odd sizes, one image, 16-64 channels and channel counts that are no multiple of a vector's width; maps of at most 256
# pixels take the weight gradient of all images in one convolution, larger ones (17x16, 20x20, 2x150) one image at a
# time.
@pytest.mark.parametrize('shape', [(2, 5, 1, 16), (1, 1, 2, 32), (3, 1, 1, 40), (3, 4, 3, 16), (2, 9, 13, 48),
                                   (4, 14, 14, 64), (1, 8, 30, 16), (2, 6, 6, 20), (2, 17, 16, 24), (3, 20, 20, 16),
                                   (2, 2, 150, 8)])
@pytest.mark.parametrize('kernel', [7, 3])
def test_the_depthwise_conv_gives_the_float64_gradients_of_the_plain_convolution(shape, kernel):
    x = torch.randn(shape, requires_grad=True)
    weight = torch.randn(shape[-1], 1, kernel, kernel, requires_grad=True)
    bias = torch.randn(shape[-1], requires_grad=True)
    assert depthwise_conv_op.cpu_weight_grad_applies(x, weight)  # the op's CPU weight gradient, not the plain one
    out = depthwise_conv_op.depthwise_conv2d_op(x, weight, bias)
    grad = torch.randn(shape).transpose(1, 2).contiguous().transpose(1, 2)  # a non-contiguous gradient, as autograd's
    got = torch.autograd.grad(out, (x, weight, bias), grad)
    inputs64 = [t.detach().double().requires_grad_(True) for t in (x, weight, bias)]
    expected = torch.autograd.grad(_plain_conv(*inputs64), inputs64, grad.double())
    torch.testing.assert_close(out.double(), _plain_conv(*inputs64).detach(), rtol=1e-5, atol=1e-5)
    for name, g, e in zip(('x', 'weight', 'bias'), got, expected):
        _assert_close_to(g, e, name)


# all images in one convolution, one at a time, a single pixel
@pytest.mark.parametrize('height, width', [(10, 12), (20, 12), (1, 1)])
def test_the_depthwise_weight_gradient_sums_the_images_and_takes_an_empty_batch(height, width):
    x, grad = torch.randn(3, height, width, 32), torch.randn(3, height, width, 32)
    with torch.no_grad():  # as in a backward
        whole = depthwise_conv_op._cpu_weight_grad(x, grad, 3)
        per_image = sum(depthwise_conv_op._cpu_weight_grad(x[i:i + 1], grad[i:i + 1], 3) for i in range(3))
        empty = depthwise_conv_op._weight_grad(x[:0], grad[:0], 7)[0]
    assert whole.shape == (32, 1, 7, 7)
    torch.testing.assert_close(whole, per_image)
    assert torch.equal(empty, torch.zeros(32, 1, 7, 7))


def test_a_double_backward_gets_the_second_derivatives_of_the_convolution():
    # The backward that builds a graph differentiates the plain convolution; the per-image sum's output has no graph.
    x = torch.randn(2, 6, 6, 16, requires_grad=True)
    weight = torch.randn(16, 1, 7, 7, requires_grad=True)

    def second_order(conv):
        (weight_grad,) = torch.autograd.grad(conv(x, weight).square().sum(), weight, create_graph=True)
        return torch.autograd.grad(weight_grad.sum(), x)[0]

    got = second_order(lambda x, weight: depthwise_conv_op.depthwise_conv2d_op(x, weight))
    expected = second_order(lambda x, weight: _plain_conv(x, weight, None))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize('shape, scale_shape', [
    ((4, 14, 14, 64), (4, 1, 1, 64)),  # alpha times drop path's per-image keep mask
    ((2, 7, 9, 48), (48,)),  # alpha alone
    ((3, 300, 32), (3, 1, 32)),  # tokens
    ((2, 5, 5, 20), (20,)),  # channels off a vector's width
])
def test_the_gelu_residual_backward_gives_the_float64_gradients_of_the_plain_expression(shape, scale_shape):
    x = torch.randn(shape, requires_grad=True)
    z = torch.cat([4 * torch.randn(shape).flatten()[:-6], torch.tensor([0.0, -30.0, 30.0, -100.0, 1e-30, -5.5])]
                  ).view(shape).requires_grad_(True)  # GELU's tails, its zero, exp's underflow
    scale = torch.rand(scale_shape, requires_grad=True)
    grad = torch.randn(shape)
    out = gelu_residual(x, z, scale)
    assert type(out.grad_fn).__name__ == '_GeluResidualBackward'  # the fast path ran, not the plain expression
    got = torch.autograd.grad(out, (x, z, scale), grad)
    inputs64 = [t.detach().double().requires_grad_(True) for t in (x, z, scale)]
    expected = torch.autograd.grad(torch.addcmul(inputs64[0], F.gelu(inputs64[1]), inputs64[2]), inputs64,
                                   grad.double())
    for name, g, e in zip(('x', 'z', 'scale'), got, expected):
        _assert_close_to(g, e, name)


def test_the_gelu_residual_backward_propagates_nan_as_the_plain_expression_does():
    z = torch.randn(2, 3, 3, 16)
    z[0, 1, 2, 5] = float('nan')
    z.requires_grad_(True)
    scale = torch.ones(16, requires_grad=True)
    out = gelu_residual(torch.zeros(2, 3, 3, 16, requires_grad=True), z, scale)
    grad_z, grad_scale = torch.autograd.grad(out, (z, scale), torch.ones_like(out))
    assert grad_z.isnan().sum() == 1 and grad_z[0, 1, 2, 5].isnan()
    assert grad_scale.isnan().sum() == 1 and grad_scale[5].isnan()
