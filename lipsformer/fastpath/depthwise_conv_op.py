"""Depthwise convolution of NHWC maps as the ``lipsformer::depthwise_conv2d`` custom op (a fast path).

    y[b, h, w, c] = bias[c] + sum_{i, j} W[c, 0, i, j] x[b, h + i - p, w + j - p, c]      (x is zero outside the map)

with stride 1, an odd square kernel of 3 to 7 (p = k // 2, 'same' padding): the conv shortcuts' 7x7 and CSwin's LePE
3x3. On a GPU cuDNN runs these convolutions far from the memory bandwidth they need, above all their weight gradient
(docs/performance.md); here each pass is one Triton kernel that reads its inputs once from memory and accumulates in
float32:

- forward: a program computes a tile of pixels of one image (about 64) for up to 32 channels, one masked load of the
  shifted input tile per tap, its pointers the tile's plus one offset (the taps' loads overlap and hit the cache);
- input gradient: the same kernel over the output gradient with the kernel flipped, the transpose of a stride-1
  'same' convolution by an odd kernel;
- weight and bias gradient: a program sums ``g * shifted x`` for every tap at once (a taps x pixels x channels
  product over a few pixels, summed over the pixels) and ``g`` over a chunk of tiles into rows of float32 partial
  sums; a second kernel adds the chunks' rows in a fixed order (no atomics: the same inputs give the same bits) and
  writes both gradients in their dtype.

It is a ``torch.library`` custom op with fake-tensor registrations and an autograd formula, so that ``torch.compile``
and ``torch.export`` see one operation forward and one backward (``lipsformer::depthwise_conv2d_backward``, which
runs the kernels of the gradients asked for, as ATen's ``convolution_backward`` does). A recorded backward
(``create_graph=True``) differentiates PyTorch's convolution instead, so second derivatives are the plain
expression's. Where Triton cannot run (no Triton, a CPU tensor outside Triton's interpreter) each op is PyTorch's
convolution on the channels-last view, but for the weight gradient on the CPU in float32: oneDNN computes it for
channels-last maps with its generic grouped-convolution kernel, far slower than its forward (docs/performance.md),
while the sum over (h, w) of ``g[b, h, w, c] x_pad[b, h + i, w + j, c]`` is itself a depthwise convolution, of x_pad
by a kernel g[b] the size of the map, with a (K, K) output, which oneDNN's forward kernel computes (an image at a
time where x_pad[b] and g[b] stay in cache, or for small maps all images in one call, their channels side by side as
the groups of one convolution). The conv shortcuts' fast form takes the op for that on the CPU
(:func:`cpu_weight_grad_applies`).

``TRITON_INTERPRET=1`` (set before Triton is imported) runs the kernels on CPU tensors, which the tests use.
"""
import contextlib
import dataclasses
import functools
import importlib.util
import os
from collections.abc import Iterator
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..layers import is_plain_module
from .lean_autograd import differentiate_plain, lean_backward
from .triton_device import TRITON_DTYPES, triton_device

__all__ = ['KERNEL_SIZES', 'DepthwiseConvOp', 'DepthwiseTiling', 'cpu_weight_grad_applies', 'depthwise_conv2d_op',
           'depthwise_kernel_applies', 'depthwise_kernels_run_on', 'using_tiling']

KERNEL_SIZES = (3, 5, 7)
# Above this many pixels a map, the CPU weight gradient runs one image at a time (its map and gradient stay in cache);
# at or below it, one call for the whole batch (a call per image would cost more than the image's arithmetic).
_PER_IMAGE_MIN_PIXELS = 256


def _power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


@dataclasses.dataclass(frozen=True)
class DepthwiseTiling:
    """How the Triton kernels divide their work among programs. The defaults are the kernels' own; the GPU check
    times other tilings against them and cuDNN (``python -m lipsformer.instruments.gpu_check --conv-sweep``), and
    :func:`using_tiling` runs the op with one.

    Attributes:
        pixels: Pixels a program of the forward and of the input gradient computes.
        max_width: The widest such tile, in pixels (a narrower map gets a narrower, taller tile).
        channels: Channels such a program computes (32: 64 bytes of a bf16 pixel, one coalesced load per tap).
        warps: Warps of such a program.
        weight_grad_pixels: Pixels a loop step of the weight gradient sums over, for all taps at once: a
            (taps, pixels, channels) product a step.
        weight_grad_channels: Channels a program of the weight gradient sums.
        weight_grad_warps: Warps of such a program.
        weight_grad_programs: Programs of the weight gradient across channel blocks (enough to fill a large GPU);
            each sums a chunk of tiles into one row of partial sums.
    """

    pixels: int = 64
    max_width: int = 8
    channels: int = 32
    warps: int = 4
    weight_grad_pixels: int = 4
    weight_grad_channels: int = 32
    weight_grad_warps: int = 8
    weight_grad_programs: int = 1024

    def __post_init__(self) -> None:
        powers = [field.name for field in dataclasses.fields(self) if field.name != 'weight_grad_programs']
        wrong = {name: getattr(self, name) for name in powers
                 if not isinstance(getattr(self, name), int) or not _power_of_two(getattr(self, name))}
        if wrong:
            raise ValueError(f'DepthwiseTiling takes powers of two (Triton\'s blocks are), got {wrong}')
        if self.max_width > self.pixels or self.warps > 32 or self.weight_grad_warps > 32:
            raise ValueError(f'DepthwiseTiling needs max_width <= pixels and at most 32 warps, got {self}')
        if not isinstance(self.weight_grad_programs, int) or self.weight_grad_programs < 1:
            raise ValueError(f'DepthwiseTiling.weight_grad_programs must be a positive int, got '
                             f'{self.weight_grad_programs!r}')


_tiling_in_use = DepthwiseTiling()


@contextlib.contextmanager
def using_tiling(tiling: DepthwiseTiling) -> Iterator[DepthwiseTiling]:
    """Run the op's kernels with ``tiling`` inside the block (the defaults again after it): for measuring and
    testing other tilings. It changes how the work is divided, not what is computed."""
    global _tiling_in_use
    if not isinstance(tiling, DepthwiseTiling):
        raise TypeError(f'using_tiling takes a DepthwiseTiling, got {type(tiling).__name__}')
    previous, _tiling_in_use = _tiling_in_use, tiling
    try:
        yield tiling
    finally:
        _tiling_in_use = previous


# Read once, outside any compiled region: dynamo reads these flags instead of importing Triton in a traced call.
_TRITON_INSTALLED = importlib.util.find_spec('triton') is not None
_INTERPRETED = os.environ.get('TRITON_INTERPRET') == '1'


def depthwise_kernel_applies(conv: nn.Module, x: torch.Tensor, channels_dim: int = -1) -> bool:
    """Whether :func:`depthwise_conv2d_op` stands in for ``conv`` on the NHWC map ``x``: ``conv`` a
    :class:`DepthwiseConvOp` without hooks (what a fast form given where the kernel is switched on makes of a
    depthwise convolution: decided then), that is a stride-1 depthwise convolution with 'same' zero padding and a
    square kernel of :data:`KERNEL_SIZES`, Triton kernels on x's device (a GPU, or the CPU under Triton's
    interpreter), and x in a dtype they take (``channels_dim``: x's channel dimension, 1 for the NCHW view of the
    map)."""
    if not _TRITON_INSTALLED or not is_plain_module(conv, DepthwiseConvOp):
        return False
    device_type = x.device.type
    if not (device_type == 'cuda' or device_type == 'cpu' and _INTERPRETED) or x.dtype not in TRITON_DTYPES:
        return False
    size = conv.kernel_size[0]
    return (conv.groups == conv.in_channels == conv.out_channels == x.shape[channels_dim] and size in KERNEL_SIZES
            and tuple(conv.kernel_size) == (size, size) and tuple(conv.stride) == (1, 1)
            and tuple(conv.dilation) == (1, 1) and tuple(conv.padding) == (size // 2, size // 2)
            and conv.padding_mode == 'zeros')


def cpu_weight_grad_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the op's CPU weight gradient (the module docstring) serves a training step of a depthwise convolution
    of ``x`` by ``weight``: float32 on the CPU outside autocast, a square kernel of :data:`KERNEL_SIZES`, a backward
    to run."""
    return (x.dtype == weight.dtype == torch.float32 and lean_backward(x, weight)
            and not torch.is_autocast_enabled('cpu') and weight.shape[-1] == weight.shape[-2] in KERNEL_SIZES)


def depthwise_kernels_run_on(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run for ``x``: on a GPU (or on the CPU under Triton's interpreter,
    ``TRITON_INTERPRET=1``), in float32, bfloat16 or float16, with Triton installed."""
    if not triton_device(x):
        return False
    return _kernels() is not None


@functools.cache
def _kernels() -> SimpleNamespace | None:
    """The Triton kernels, compiled on first use (Triton is imported only then); None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def depthwise_convolve(x_ptr, w_ptr, b_ptr, y_ptr, height, width, channels, tiles_w, tiles_per_image,
                 sx_b, sx_h, sx_w, sx_c, K: tl.constexpr, FLIP: tl.constexpr, HAS_BIAS: tl.constexpr,
                 TILE_H: tl.constexpr, TILE_W: tl.constexpr, BLOCK_C: tl.constexpr):
        # one program: TILE_H x TILE_W pixels of one image, BLOCK_C channels
        tile = tl.program_id(0)
        image = (tile // tiles_per_image).to(tl.int64)
        tile = tile % tiles_per_image
        pixel = tl.arange(0, TILE_H * TILE_W)
        h = (tile // tiles_w) * TILE_H + pixel // TILE_W
        w = (tile % tiles_w) * TILE_W + pixel % TILE_W
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_channels = c < channels
        acc = tl.zeros((TILE_H * TILE_W, BLOCK_C), dtype=tl.float32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + c, mask=in_channels, other=0.0).to(tl.float32)[None, :]
        # the tile's pointers once; a tap adds one scalar offset to them (its masks are per pixel)
        x_tile = x_ptr + image * sx_b + (h.to(tl.int64) * sx_h + w.to(tl.int64) * sx_w)[:, None] + (c * sx_c)[None, :]
        for tap in tl.static_range(K * K):
            hh = h + (tap // K - K // 2)
            ww = w + (tap % K - K // 2)
            inside = (hh >= 0) & (hh < height) & (ww >= 0) & (ww < width)
            x = tl.load(x_tile + ((tap // K - K // 2) * sx_h + (tap % K - K // 2) * sx_w),
                        mask=inside[:, None] & in_channels[None, :], other=0.0)
            # the input gradient convolves by the flipped kernel: tap t reads weight K*K-1-t
            weight = tl.load(w_ptr + c * (K * K) + (tap + FLIP * (K * K - 1 - 2 * tap)), mask=in_channels,
                             other=0.0)
            acc += x.to(tl.float32) * weight.to(tl.float32)[None, :]
        out = ((image * height + h) * width + w).to(tl.int64)
        in_map = (h < height) & (w < width)
        tl.store(y_ptr + out[:, None] * channels + c[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=in_map[:, None] & in_channels[None, :])

    @triton.jit
    def depthwise_weight_grad(x_ptr, g_ptr, partial_ptr, height, width, channels, tiles_w, tiles_per_image, tiles,
                              tiles_per_program, sx_b, sx_h, sx_w, sx_c, sg_b, sg_h, sg_w, sg_c, K: tl.constexpr,
                              ROWS: tl.constexpr, TILE_H: tl.constexpr, TILE_W: tl.constexpr, BLOCK_C: tl.constexpr):
        # one program: a chunk of tiles_per_program tiles, BLOCK_C channels; row t < K*K of its partial sums is
        # tap t's, row K*K the bias's. Every tap at once: the (taps, pixels, channels) product of the shifted input
        # and the output gradient, summed over the tile's few pixels into a (taps, channels) accumulator.
        chunk = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_channels = c < channels
        row = tl.arange(0, ROWS)
        is_tap = row < K * K
        tap_h = row // K - K // 2
        tap_w = row % K - K // 2
        pixel = tl.arange(0, TILE_H * TILE_W)
        acc = tl.zeros((ROWS, BLOCK_C), dtype=tl.float32)
        bias = tl.zeros((BLOCK_C,), dtype=tl.float32)
        first = chunk * tiles_per_program
        for tile in range(first, tl.minimum(first + tiles_per_program, tiles)):
            image = (tile // tiles_per_image).to(tl.int64)
            in_image = tile % tiles_per_image
            h = (in_image // tiles_w) * TILE_H + pixel // TILE_W
            w = (in_image % tiles_w) * TILE_W + pixel % TILE_W
            in_map = (h < height) & (w < width)
            g_offsets = h.to(tl.int64)[:, None] * sg_h + w.to(tl.int64)[:, None] * sg_w + c[None, :] * sg_c
            g = tl.load(g_ptr + image * sg_b + g_offsets, mask=in_map[:, None] & in_channels[None, :],
                        other=0.0).to(tl.float32)
            bias += tl.sum(g, axis=0)
            hh = h[None, :] + tap_h[:, None]
            ww = w[None, :] + tap_w[:, None]
            inside = is_tap[:, None] & in_map[None, :] & (hh >= 0) & (hh < height) & (ww >= 0) & (ww < width)
            offsets = (hh.to(tl.int64) * sx_h + ww.to(tl.int64) * sx_w)[:, :, None] + (c * sx_c)[None, None, :]
            x = tl.load(x_ptr + image * sx_b + offsets, mask=inside[:, :, None] & in_channels[None, None, :],
                        other=0.0)
            acc += tl.sum(x.to(tl.float32) * g[None, :, :], axis=1)
        acc += tl.where(row[:, None] == K * K, bias[None, :], 0.0)
        out = (chunk.to(tl.int64) * ROWS + row)[:, None] * channels + c[None, :]
        tl.store(partial_ptr + out, acc, mask=(row < K * K + 1)[:, None] & in_channels[None, :])

    @triton.jit
    def depthwise_weight_grad_sum(partial_ptr, weight_grad_ptr, bias_grad_ptr, chunks, channels, TAPS: tl.constexpr,
                                  ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
        # one program: BLOCK_C channels of every chunk's partial sums, added in chunk order, written as the (C, TAPS)
        # weight gradient and the bias gradient in their dtype
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_channels = c < channels
        row = tl.arange(0, ROWS)
        inside = (row < TAPS + 1)[:, None] & in_channels[None, :]
        acc = tl.zeros((ROWS, BLOCK_C), dtype=tl.float32)
        for chunk in range(chunks):
            acc += tl.load(partial_ptr + (chunk * ROWS + row).to(tl.int64)[:, None] * channels + c[None, :],
                           mask=inside, other=0.0)
        tl.store(weight_grad_ptr + c[None, :] * TAPS + row[:, None], acc.to(weight_grad_ptr.dtype.element_ty),
                 mask=(row < TAPS)[:, None] & in_channels[None, :])
        bias = tl.sum(tl.where(row[:, None] == TAPS, acc, 0.0), axis=0)
        tl.store(bias_grad_ptr + c, bias.to(bias_grad_ptr.dtype.element_ty), mask=in_channels)

    return SimpleNamespace(convolve=depthwise_convolve, weight_grad=depthwise_weight_grad,
                           weight_grad_sum=depthwise_weight_grad_sum, next_power_of_2=triton.next_power_of_2,
                           cdiv=triton.cdiv)


def _tiling(height: int, width: int, channels: int, kernels: SimpleNamespace, pixels: int, max_width: int,
            block_channels: int) -> tuple[int, int, int, int, int]:
    """(TILE_H, TILE_W, BLOCK_C, tiles across, tiles per image): tiles of about ``pixels`` pixels, at most
    ``max_width`` wide and no larger than the map (a 1-pixel-wide stripe is computed ``pixels`` rows at a time)."""
    tile_w = min(max_width, pixels, kernels.next_power_of_2(width))
    tile_h = min(pixels // tile_w, kernels.next_power_of_2(height))
    block_c = min(block_channels, kernels.next_power_of_2(channels))
    tiles_w = kernels.cdiv(width, tile_w)
    return tile_h, tile_w, block_c, tiles_w, kernels.cdiv(height, tile_h) * tiles_w


def _padding(weight: torch.Tensor) -> tuple[int, int]:
    return weight.shape[-2] // 2, weight.shape[-1] // 2


def _plain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """PyTorch's convolution of the NHWC map's channels-last NCHW view, NHWC out."""
    return F.conv2d(x.permute(0, 3, 1, 2), weight, bias, padding=_padding(weight),
                    groups=x.shape[-1]).permute(0, 2, 3, 1)


def _convolve(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, flip: bool) -> torch.Tensor:
    """The Triton convolution kernel: x (B, H, W, C) of any strides by weight (C, 1, K, K) (flipped), NHWC out."""
    batch, height, width, channels = x.shape
    y = torch.empty((batch, height, width, channels), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    kernels, tiling = _kernels(), _tiling_in_use
    tile_h, tile_w, block_c, tiles_w, tiles_per_image = _tiling(height, width, channels, kernels, tiling.pixels,
                                                                tiling.max_width, tiling.channels)
    weight = weight.contiguous()
    kernels.convolve[(batch * tiles_per_image, kernels.cdiv(channels, block_c))](
        x, weight, weight if bias is None else bias.contiguous(), y, height, width, channels, tiles_w,
        tiles_per_image, *x.stride(), K=weight.shape[-1], FLIP=int(flip), HAS_BIAS=bias is not None, TILE_H=tile_h,
        TILE_W=tile_w, BLOCK_C=block_c, num_warps=tiling.warps)
    return y


@torch.library.custom_op('lipsformer::depthwise_conv2d', mutates_args=())
def _depthwise_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if not depthwise_kernels_run_on(x):
        return _plain(x, weight, bias).contiguous()
    return _convolve(x, weight, bias, flip=False)


@_depthwise_conv2d.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape)


def _input_grad(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """dL/dx: the convolution of the output gradient by the flipped kernel."""
    if not depthwise_kernels_run_on(grad):
        return _plain(grad, weight.flip(-2, -1), None).contiguous()
    return _convolve(grad, weight, None, flip=True)


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
    batch, height, width, channels = x.shape
    taps = kernel_size * kernel_size
    if x.numel() == 0:
        return x.new_zeros(channels, 1, kernel_size, kernel_size), x.new_zeros(channels)
    if not depthwise_kernels_run_on(x):
        if x.device.type == 'cpu' and x.dtype == torch.float32:
            return _cpu_weight_grad(x, grad, kernel_size // 2), grad.sum((0, 1, 2))
        weight_grad = torch.nn.grad.conv2d_weight(
            x.permute(0, 3, 1, 2).float(), (channels, 1, kernel_size, kernel_size), grad.permute(0, 3, 1, 2).float(),
            padding=kernel_size // 2, groups=channels)
        return weight_grad.to(x.dtype), grad.sum((0, 1, 2), dtype=torch.float32).to(x.dtype)
    kernels, tiling = _kernels(), _tiling_in_use
    tile_h, tile_w, block_c, tiles_w, tiles_per_image = _tiling(
        height, width, channels, kernels, tiling.weight_grad_pixels, tiling.max_width, tiling.weight_grad_channels)
    tiles = batch * tiles_per_image
    channel_blocks = kernels.cdiv(channels, block_c)
    tiles_per_program = kernels.cdiv(tiles, max(tiling.weight_grad_programs // channel_blocks, 1))
    chunks = kernels.cdiv(tiles, tiles_per_program)
    rows = kernels.next_power_of_2(taps + 1)
    partial = torch.empty((chunks, rows, channels), dtype=torch.float32, device=x.device)
    kernels.weight_grad[(chunks, channel_blocks)](
        x, grad, partial, height, width, channels, tiles_w, tiles_per_image, tiles, tiles_per_program, *x.stride(),
        *grad.stride(), K=kernel_size, ROWS=rows, TILE_H=tile_h, TILE_W=tile_w, BLOCK_C=block_c,
        num_warps=tiling.weight_grad_warps)
    weight_grad = torch.empty((channels, 1, kernel_size, kernel_size), dtype=x.dtype, device=x.device)
    bias_grad = torch.empty((channels,), dtype=x.dtype, device=x.device)
    kernels.weight_grad_sum[(channel_blocks,)](partial, weight_grad, bias_grad, chunks, channels, TAPS=taps, ROWS=rows,
                                               BLOCK_C=block_c)
    return weight_grad, bias_grad


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


class DepthwiseConvOp(nn.Conv2d):
    """A depthwise convolution in a fast form given where its kernel is switched on (``switch.kernel_enabled``): the
    ``lipsformer::depthwise_conv2d`` custom op on a channels-last map where its kernel applies, so that eager,
    ``torch.compile`` and ``torch.export`` run one op a pass; the convolution otherwise. Called as its module, as the
    convolution it stands for (hooks fire, the state dict is the convolution's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.jit.is_scripting():
            # the NCHW view of an NHWC map (channels-last in memory): the op takes that map
            if depthwise_kernel_applies(self, x, channels_dim=1) and x.is_contiguous(memory_format=torch.channels_last):
                return depthwise_conv2d_op(x.permute(0, 2, 3, 1), self.weight, self.bias).permute(0, 3, 1, 2)
        return self._conv_forward(x, self.weight, self.bias)
