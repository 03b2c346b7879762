"""The conv shortcuts' depthwise convolution on NHWC maps, with a faster weight gradient on CPU (a fast path).

    y[b, h, w, c] = bias[c] + sum_{i, j} W[c, i, j] x_pad[b, h + i, w + j, c]
    dL/dW[c, i, j] = sum_b sum_{h, w} g[b, h, w, c] x_pad[b, h + i, w + j, c]

On CPU, oneDNN computes that weight gradient for channels-last maps with its generic grouped-convolution kernel,
far slower than its forward pass (docs/performance.md). The sum over (h, w) is itself a depthwise convolution, of
x_pad by a kernel g[b] the size of the map, with a (kh, kw) output: it goes through oneDNN's depthwise forward kernel
instead, per image where x_pad[b] and g[b] stay in cache, or for small maps all images in one call, their channels side
by side as the groups of one convolution. The input gradient, a convolution by the flipped
kernel, goes through oneDNN's forward kernel.
"""

import torch
import torch.nn.functional as F

from .lean_autograd import autocast_backward, autocast_forward, differentiate_plain

__all__ = ['depthwise_conv2d']


# Above this many pixels a map, the weight gradient runs one image at a time (its map and gradient stay in cache); at
# or below it, one call for the whole batch (a call per image would cost more than the image's arithmetic).
_PER_IMAGE_MIN_PIXELS = 256


def _weight_grad(x: torch.Tensor, grad: torch.Tensor, padding: tuple[int, int], kernel: tuple[int, int]
                 ) -> torch.Tensor:
    """dL/dW (C, 1, kh, kw) from NHWC input and output gradient: one image at a time for large maps, the images side
    by side as channels of one convolution for small ones.

    Taps further from the centre than the map is wide see only the zero padding, so their gradient is zero: they are
    left out of the convolution and padded back with zeros. A 1x1 map leaves only the centre tap, a product summed over
    the images (a convolution by a 1x1 kernel of a single image would take PyTorch's slow unfolding path on one thread).
    """
    batch, height, width, channels = x.shape
    reach = (min(padding[0], height - 1), min(padding[1], width - 1))
    border = (padding[0] - reach[0], padding[1] - reach[1])
    if batch == 0 or height == 0 or width == 0:
        return x.new_zeros(channels, 1, kernel[0], kernel[1])
    if reach == (0, 0):  # a 1x1 map (or a 1x1 kernel): the one tap left is a product summed over the images
        weight_grad = (x * grad).sum((0, 1, 2)).view(channels, 1, 1)
    elif height * width <= _PER_IMAGE_MIN_PIXELS:
        # (1, B*C, H, W) channels-last input and (B*C, 1, H, W) kernels: every image's channels are groups of one
        # convolution, whose outputs (a tap each) are summed over the images.
        images = x.permute(1, 2, 0, 3).reshape(1, height, width, batch * channels).permute(0, 3, 1, 2)
        kernels = grad.permute(0, 3, 1, 2).reshape(batch * channels, 1, height, width)
        per_image = F.conv2d(images, kernels, padding=reach, groups=batch * channels)
        weight_grad = per_image.view(batch, channels, 2 * reach[0] + 1, 2 * reach[1] + 1).sum(0)
    else:
        weight_grad = x.new_zeros(channels, 2 * reach[0] + 1, 2 * reach[1] + 1)
        for image, image_grad in zip(x.unbind(0), grad.unbind(0)):
            # (1, C, H, W) and (C, 1, H, W) views of NHWC memory, channels-last as oneDNN takes them; with the
            # forward's zero padding the output is a tap each.
            weight_grad += F.conv2d(image.permute(2, 0, 1).unsqueeze(0), image_grad.permute(2, 0, 1).unsqueeze(1),
                                    padding=reach, groups=channels)[0]
    if border != (0, 0):
        weight_grad = F.pad(weight_grad, (border[1], border[1], border[0], border[0]))
    return weight_grad.unsqueeze(1)


def _plain_depthwise_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            padding: tuple[int, int]) -> torch.Tensor:
    return F.conv2d(x.permute(0, 3, 1, 2), weight, bias, padding=padding, groups=x.shape[-1]).permute(0, 2, 3, 1)


class _DepthwiseConv2d(torch.autograd.Function):
    """Stride-1 depthwise convolution of an NHWC map, NHWC out; the backward as in the module docstring (a recorded
    backward, ``create_graph=True``, differentiates the plain convolution instead)."""

    @staticmethod
    @autocast_forward
    def forward(ctx, x, weight, bias, padding: tuple[int, int]):
        ctx.padding = padding
        ctx.save_for_backward(x, weight, bias)
        return _plain_depthwise_conv2d(x, weight, bias, padding)

    @staticmethod
    @autocast_backward
    def backward(ctx, grad):
        x, weight, bias = ctx.saved_tensors
        need_x, need_weight, need_bias, _ = ctx.needs_input_grad
        if torch.is_grad_enabled():
            return *differentiate_plain(lambda *inputs: _plain_depthwise_conv2d(*inputs, ctx.padding),
                                        (x, weight, bias), (need_x, need_weight, need_bias), grad), None
        grad_x = grad_weight = grad_bias = None
        if need_x:
            # A stride-1 'same' convolution's transpose is the convolution by the flipped kernel: oneDNN's forward
            # kernel again, faster than its backward-data one.
            grad_x = F.conv2d(grad.permute(0, 3, 1, 2), weight.flip(-2, -1), padding=ctx.padding,
                              groups=x.shape[-1]).permute(0, 2, 3, 1)
        if need_weight:
            grad_weight = _weight_grad(x, grad, ctx.padding, (weight.shape[2], weight.shape[3]))
        if need_bias:
            grad_bias = grad.sum((0, 1, 2))
        return grad_x, grad_weight, grad_bias, None


def depthwise_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Stride-1 depthwise convolution of an NHWC map with a (C, 1, kh, kw) weight, 'same' padding; NHWC out.

    Training on CPU in float32 takes the faster weight gradient of the module docstring; elsewhere (GPU, other
    dtypes, no weight gradient) it is ``F.conv2d`` on the channels-last view.
    """
    padding = (weight.shape[2] // 2, weight.shape[3] // 2)
    if (x.device.type == 'cpu' and x.dtype == torch.float32 and weight.dtype == torch.float32
            and not torch.is_autocast_enabled('cpu') and torch.is_grad_enabled() and weight.requires_grad):
        return _DepthwiseConv2d.apply(x, weight, bias, padding)
    return _plain_depthwise_conv2d(x, weight, bias, padding)
