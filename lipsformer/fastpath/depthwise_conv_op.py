"""Depthwise convolution of NHWC maps as the ``lipsformer::depthwise_conv2d`` custom op, for the CPU's weight gradient.

    y[b, h, w, c] = bias[c] + sum_{i, j} W[c, 0, i, j] x[b, h + i - p, w + j - p, c]      (x is zero outside the map)

with stride 1, an odd square kernel of 3 to 7 (p = k // 2, 'same' padding): the conv shortcuts' 7x7. Forward and input
gradient are PyTorch's convolution of the channels-last view. The weight gradient is the reason for the op: in float32
on the CPU oneDNN computes it for channels-last maps with its generic grouped-convolution kernel, far slower than its
forward (docs/performance.md), while the sum over (h, w) of ``g[b, h, w, c] x_pad[b, h + i, w + j, c]`` is itself a
depthwise convolution, of x_pad by a kernel g[b] the size of the map, with a (K, K) output, which oneDNN's forward
kernel computes (an image at a time where x_pad[b] and g[b] stay in cache, or for small maps all images in one call,
their channels side by side as the groups of one convolution). Elsewhere the weight gradient is PyTorch's. The conv
shortcuts' fast form takes the op where that applies (:func:`cpu_weight_grad_applies`); on a GPU the fast form keeps
cuDNN's convolutions, which a GPU measured faster than the package's own Triton kernels for this op
(docs/performance.md).

It is a ``torch.library`` custom op with fake-tensor registrations and an autograd formula, so that ``torch.compile``
and ``torch.export`` see one operation forward and one backward (``lipsformer::depthwise_conv2d_backward``, which
computes the gradients asked for, as ATen's ``convolution_backward`` does). A recorded backward
(``create_graph=True``) differentiates PyTorch's convolution instead, so second derivatives are the plain
expression's.
"""
import torch
import torch.nn.functional as F

from .lean_autograd import differentiate_plain, lean_backward

__all__ = ['KERNEL_SIZES', 'cpu_weight_grad_applies', 'depthwise_conv2d_op']

KERNEL_SIZES = (3, 5, 7)
# Above this many pixels a map, the CPU weight gradient runs one image at a time (its map and gradient stay in cache);
# at or below it, one call for the whole batch (a call per image would cost more than the image's arithmetic).
_PER_IMAGE_MIN_PIXELS = 256


def cpu_weight_grad_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the op's CPU weight gradient (the module docstring) serves a training step of a depthwise convolution
    of ``x`` by ``weight``: float32 on the CPU outside autocast, a square kernel of :data:`KERNEL_SIZES`, a backward
    to run."""
    return (x.dtype == weight.dtype == torch.float32 and lean_backward(x, weight)
            and not torch.is_autocast_enabled('cpu') and weight.shape[-1] == weight.shape[-2] in KERNEL_SIZES)


def _padding(weight: torch.Tensor) -> tuple[int, int]:
    return weight.shape[-2] // 2, weight.shape[-1] // 2


def _plain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """PyTorch's convolution of the NHWC map's channels-last NCHW view, NHWC out."""
    return F.conv2d(x.permute(0, 3, 1, 2), weight, bias, padding=_padding(weight),
                    groups=x.shape[-1]).permute(0, 2, 3, 1)


@torch.library.custom_op('lipsformer::depthwise_conv2d', mutates_args=())
def _depthwise_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _plain(x, weight, bias).contiguous()


@_depthwise_conv2d.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape)


def _input_grad(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dL/dx: the convolution of the output gradient by the flipped kernel."""
    return _plain(grad, weight.flip(-2, -1), None).contiguous()


def _cpu_weight_grad(x: torch.Tensor, grad: torch.Tensor, padding: int) -> torch.Tensor:
    """dL/dW (C, 1, K, K) from NHWC input and output gradient through oneDNN's forward kernel (the module docstring):
    one image at a time for large maps, the images side by side as channels of one convolution for small ones.

    Taps further from the centre than the map is wide see only the zero padding, so their gradient is zero: they are
    left out of the convolution and padded back with zeros. A 1x1 map leaves only the centre tap, a product summed over
    the images (a convolution by a 1x1 kernel of a single image would take PyTorch's slow unfolding path on one thread).
    """
    batch, height, width, channels = x.shape
    reach = (min(padding, height - 1), min(padding, width - 1))
    if reach == (0, 0):  # a 1x1 map: the one tap left is a product summed over the images
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
    border = (padding - reach[0], padding - reach[1])
    return F.pad(weight_grad, (border[1], border[1], border[0], border[0])).unsqueeze(1)


def _weight_grad(x: torch.Tensor, grad: torch.Tensor, kernel_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(dL/dW (C, 1, K, K), dL/dbias (C,)) in x's dtype, summed in float32."""
    channels = x.shape[-1]
    if x.numel() == 0:
        return x.new_zeros(channels, 1, kernel_size, kernel_size), x.new_zeros(channels)
    if x.device.type == 'cpu' and x.dtype == torch.float32:
        return _cpu_weight_grad(x, grad, kernel_size // 2), grad.sum((0, 1, 2))
    weight_grad = torch.nn.grad.conv2d_weight(
        x.permute(0, 3, 1, 2).float(), (channels, 1, kernel_size, kernel_size), grad.permute(0, 3, 1, 2).float(),
        padding=kernel_size // 2, groups=channels)
    return weight_grad.to(x.dtype), grad.sum((0, 1, 2), dtype=torch.float32).to(x.dtype)


@torch.library.custom_op('lipsformer::depthwise_conv2d_backward', mutates_args=())
def _depthwise_conv2d_backward(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, input_grad: bool,
                               weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dL/dx, dL/dW, dL/dbias), as ATen's ``convolution_backward`` with its output mask: one op for the backward
    pass, whose kernels (the input gradient's, the weight gradient's two) run for the gradients asked for; a gradient
    not asked for is an empty tensor."""
    empty = x.new_empty(0)
    grad_x = _input_grad(grad, weight) if input_grad else empty
    grad_weight, grad_bias = _weight_grad(x, grad, weight.shape[-1]) if weight_grad else (empty.clone(), empty.clone())
    return grad_x, grad_weight, grad_bias


@_depthwise_conv2d_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, input_grad: bool, weight_grad: bool
      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    channels, kernel_size = x.shape[-1], weight.shape[-1]
    return (x.new_empty(x.shape) if input_grad else x.new_empty(0),
            x.new_empty(channels, 1, kernel_size, kernel_size) if weight_grad else x.new_empty(0),
            x.new_empty(channels) if weight_grad else x.new_empty(0))


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight, bias)


def _backward(ctx, grad):
    x, weight, bias = ctx.saved_tensors
    need_x, need_weight, need_bias = ctx.needs_input_grad
    if torch.is_grad_enabled():
        # A recorded backward: PyTorch's convolution differentiated, so that second derivatives are the plain ones.
        return differentiate_plain(_plain, (x, weight, bias), (need_x, need_weight, need_bias), grad)
    grad_x, grad_weight, grad_bias = torch.ops.lipsformer.depthwise_conv2d_backward(
        grad, x, weight, need_x, need_weight or need_bias)
    return grad_x if need_x else None, grad_weight if need_weight else None, grad_bias if need_bias else None


_depthwise_conv2d.register_autograd(_backward, setup_context=_setup_context)


def depthwise_conv2d_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Stride-1 depthwise convolution of an NHWC map ``x`` (B, H, W, C), any strides, by ``weight`` (C, 1, K, K),
    K odd from 3 to 7, with 'same' zero padding and an optional ``bias`` (C,); a contiguous NHWC map out.

    Under autocast the three tensors are cast to autocast's dtype, as ``F.conv2d`` casts them; otherwise they must
    share one dtype.
    """
    channels = x.shape[-1] if x.dim() == 4 else None
    if (x.dim() != 4 or weight.dim() != 4 or weight.shape[0] != channels or weight.shape[1] != 1
            or weight.shape[2] != weight.shape[3] or weight.shape[2] not in KERNEL_SIZES):
        raise ValueError(f'depthwise_conv2d_op takes an NHWC map (B, H, W, C) and a (C, 1, K, K) weight with K in '
                         f'{KERNEL_SIZES}; got a map of shape {list(x.shape)} and a weight of shape '
                         f'{list(weight.shape)}')
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f'depthwise_conv2d_op takes a bias of shape ({channels},), got {list(bias.shape)}')
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    if weight.dtype != x.dtype or bias is not None and bias.dtype != x.dtype:
        raise TypeError(f'depthwise_conv2d_op needs one dtype for the map ({x.dtype}), the weight ({weight.dtype}) and '
                        f'the bias ({None if bias is None else bias.dtype}); cast them, or run under autocast')
    return torch.ops.lipsformer.depthwise_conv2d(x, weight, bias)
