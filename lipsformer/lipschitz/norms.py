"""Operator norms of the parts of a network: matrices, convolutions as operators, activations.

The paper bounds a convolution by the spectral norm of its weight reshaped to (out, in * kh * kw), the matrix spectral
init normalises. That is the exact operator norm only when patches do not overlap (1x1 convs, stride = kernel); for
an overlapping kernel the operator on an H x W map (zero padding included) can be up to sqrt(kh * kw) times larger,
so the true operator norm is found by power iteration on conv^T conv at the map size.
"""
import functools
import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..layers import spectral_norm as weight_spectral_norm

__all__ = ['activation_lipschitz', 'conv_operator_norm', 'conv_overlap_factor', 'is_patchwise',
           'largest_singular_value', 'reshaped_norm']


@torch.no_grad()
def largest_singular_value(matrices: torch.Tensor) -> float:
    """The largest singular value of a matrix, or the largest over a stack of matrices (exact, float64).

    One matrix's value is :func:`lipsformer.layers.spectral_norm` (a tensor, of the (out, -1) reshape) as a float.
    """
    matrices = matrices.detach()
    if matrices.dim() == 2:
        return weight_spectral_norm(matrices).item()
    return max(weight_spectral_norm(m).item() for m in matrices.reshape(-1, *matrices.shape[-2:]))


@torch.no_grad()
def reshaped_norm(weight: torch.Tensor) -> float:
    """Spectral norm of a Linear or Conv weight reshaped to (out, -1), the matrix the paper bounds."""
    return weight_spectral_norm(weight.detach()).item()


def is_patchwise(conv: nn.Conv2d) -> bool:
    """Whether every output pixel reads its own input patch (1x1, or stride = kernel, no padding or dilation)."""
    return (tuple(conv.stride) == tuple(conv.kernel_size) and tuple(conv.padding) == (0, 0)
            and tuple(conv.dilation) == (1, 1))


def conv_overlap_factor(conv: nn.Conv2d) -> float:
    """sqrt(the most kernel taps that read one input pixel): operator norm <= this x reshaped norm (Cauchy-Schwarz)."""
    taps = [math.ceil(k / s) for k, s in zip(conv.kernel_size, conv.stride)]
    return math.sqrt(taps[0] * taps[1])


@torch.no_grad()
def conv_operator_norm(conv: nn.Conv2d, input_size: tuple[int, int], iterations: int = 200, tol: float = 1e-6,
                       seed: int = 0, candidates: int = 8) -> float:
    """Operator norm of the convolution (bias excluded) on one ``input_size`` map.

    Patchwise convolutions are block diagonal, so their norm is the reshaped weight's, exactly. Otherwise power
    iteration on conv^T conv, which approaches the norm from below and stops when the estimate changes by less than
    ``tol`` (relative).

    A depthwise convolution is block diagonal over channels, so each channel is normalised on its own and converges
    to its own norm. The spectrum of a convolution is dense near its top, where a random start needs hundreds of
    iterations; each channel starts instead from the plane wave at the peak of its kernel's Fourier transform, close
    to its top singular vector. After three iterations on all channels the ``candidates`` highest go on alone.
    """
    if is_patchwise(conv):
        return reshaped_norm(conv.weight)
    weight = conv.weight.detach().float()
    if conv.groups == conv.in_channels == conv.out_channels and tuple(conv.stride) == (1, 1):
        x = _plane_waves(weight, input_size)
        screened = _power_iteration(conv, weight, x, 3, 0.0, per_channel=True)
        keep = screened.topk(min(candidates, screened.numel())).indices
        return _power_iteration(conv, weight[keep], x[:, keep], iterations, tol, per_channel=True).max().item()
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(1, conv.in_channels, *input_size, generator=generator).to(weight.device)
    return _power_iteration(conv, weight, x, iterations, tol, per_channel=False).item()


def _power_iteration(conv: nn.Conv2d, weight: torch.Tensor, x: torch.Tensor, iterations: int, tol: float,
                     per_channel: bool) -> torch.Tensor:
    """Estimates ||conv x|| for unit x (per channel of a depthwise conv, or overall) after power iteration."""
    apply = functools.partial(F.conv2d, weight=weight, stride=conv.stride, padding=conv.padding,
                              dilation=conv.dilation, groups=weight.shape[0] if per_channel else conv.groups)
    dims = (-2, -1) if per_channel else (-3, -2, -1)
    with torch.enable_grad():
        probe = x.clone().requires_grad_(True)
        output = apply(probe)
    estimate = torch.zeros(())
    for _ in range(iterations):
        x = x / torch.linalg.vector_norm(x, dim=dims, keepdim=True).clamp_min(1e-30)
        y = apply(x)
        new_estimate = torch.linalg.vector_norm(y, dim=dims).flatten()
        with torch.enable_grad():  # the adjoint conv^T y, exactly as autograd computes it
            (x,) = torch.autograd.grad(output, probe, y, retain_graph=True)
        converged = (new_estimate - estimate).abs().max() <= tol * new_estimate.max()
        estimate = new_estimate
        if converged:
            break
    return estimate


def _plane_waves(weight: torch.Tensor, input_size: tuple[int, int]) -> torch.Tensor:
    """For each channel of a depthwise kernel, the plane wave on the map at its kernel's Fourier peak.

    Taps farther from the centre than the map is wide only ever meet zero padding, so they are dropped first.
    """
    height, width = input_size
    kernel_h, kernel_w = weight.shape[-2:]
    crop_h, crop_w = max(0, kernel_h // 2 - (height - 1)), max(0, kernel_w // 2 - (width - 1))
    kernels = weight[:, 0, crop_h:kernel_h - crop_h, crop_w:kernel_w - crop_w]
    grid = (max(64, 2 * height), max(64, 2 * width))
    peaks = torch.fft.fft2(kernels, s=grid).abs().flatten(1).argmax(dim=1)
    frequency_row = (peaks // grid[1]).to(weight.dtype)[:, None, None] / grid[0]
    frequency_col = (peaks % grid[1]).to(weight.dtype)[:, None, None] / grid[1]
    rows = torch.arange(height, device=weight.device, dtype=weight.dtype)[:, None]
    cols = torch.arange(width, device=weight.device, dtype=weight.dtype)[None, :]
    return (torch.cos(2 * math.pi * (frequency_row * rows + frequency_col * cols)) + 0.01).unsqueeze(0)


def _largest_slope(activation: Callable[[torch.Tensor], torch.Tensor]) -> float:
    grid = torch.linspace(-12.0, 12.0, 240001, dtype=torch.float64, requires_grad=True)
    (slope,) = torch.autograd.grad(activation(grid).sum(), grid)
    return slope.abs().max().item()


@functools.cache
def _gelu_lipschitz(approximate: str) -> float:
    return _largest_slope(nn.GELU(approximate=approximate))


def activation_lipschitz(activation: nn.Module) -> float:
    """Lipschitz constant of an elementwise activation: the largest |f'| on a 1e-4 grid over [-12, 12].

    Exact GELU gives 1.1289 (at x = sqrt(2)), its tanh approximation 1.1300, x * sigmoid(1.702 x) 1.0998, ReLU 1.
    """
    if isinstance(activation, nn.Identity):
        return 1.0
    if isinstance(activation, nn.GELU):
        return _gelu_lipschitz(activation.approximate)
    return _largest_slope(activation)
