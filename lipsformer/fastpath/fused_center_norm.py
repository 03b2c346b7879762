"""CenterNorm through LayerNorm's fused kernel (a fast path of ``lipsformer.layers.CenterNorm``).

LayerNorm divides the centred x by sqrt(var + eps). With eps = 2^60, which any variance below 2^36 leaves unchanged
in float32 arithmetic, that divisor is exactly 2^30, so a weight scaled by 2^30 gives D / (D - 1) gamma (x - mean) +
beta: CenterNorm. Powers of two multiply without rounding; the variance's share of the gradient is below var / 2^60.
One fused kernel, forward and backward, instead of the centring expression's several passes.
"""
import torch
import torch.nn.functional as F

__all__ = ['center_norm']

_LAYER_NORM_EPS = 2.0 ** 60
_LAYER_NORM_RSTD_INV = 2.0 ** 30


def center_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """``weight * scale * (x - mean(x)) + bias`` over the last dimension, contiguous like LayerNorm's output.

    float16 inputs take the centring expression: the LayerNorm form's weight (about 1e9) does not fit in float16.
    """
    # Contiguous: elementwise ops keep their input's layout, and an NHWC view of NCHW memory (timm's PatchEmbed
    # output) would otherwise reach the conv shortcuts channels-first, where CPU depthwise convolutions are slower.
    x = x.contiguous()
    if x.dtype == torch.float16:
        return torch.addcmul(bias, x - x.mean(-1, keepdim=True), weight * scale)
    return F.layer_norm(x, [x.shape[-1]], weight * (scale * _LAYER_NORM_RSTD_INV), bias, eps=_LAYER_NORM_EPS)
