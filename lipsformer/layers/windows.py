"""Partitioning NHWC feature maps into rectangular windows (Swin windows, CSwin stripes) and back.

Partitioning is a permutation of tokens and zero padding an isometric embedding, so both are 1-Lipschitz: the
Lipschitz constant of windowed attention is that of the attention inside one window.
"""

import torch
import torch.nn.functional as F
from timm.models import register_notrace_function

__all__ = ['pad_to_multiple', 'window_partition', 'window_reverse', 'padding_key_mask']


@register_notrace_function  # the pad amounts depend on the input's (traced) size
def pad_to_multiple(x: torch.Tensor, window_h: int, window_w: int) -> torch.Tensor:
    """Zero-pad an NHWC map at the bottom and right so that H and W are multiples of the window."""
    _, height, width, _ = x.shape
    pad_h = (window_h - height % window_h) % window_h
    pad_w = (window_w - width % window_w) % window_w
    if pad_h or pad_w:
        x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    return x


def window_partition(x: torch.Tensor, window_h: int, window_w: int) -> torch.Tensor:
    """(B, H, W, C) with H, W multiples of the window -> (B * num_windows, window_h * window_w, C), row-major."""
    batch, height, width, channels = x.shape
    x = x.view(batch, height // window_h, window_h, width // window_w, window_w, channels)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, window_h * window_w, channels)


@register_notrace_function  # the output shape depends on the traced height and width
def window_reverse(windows: torch.Tensor, window_h: int, window_w: int, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`window_partition` for a padded map of ``height`` x ``width``."""
    channels = windows.shape[-1]
    x = windows.view(-1, height // window_h, width // window_w, window_h, window_w, channels)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(-1, height, width, channels)


@register_notrace_function  # data-dependent on the traced size
def padding_key_mask(
        height: int,
        width: int,
        window_h: int,
        window_w: int,
        batch: int,
        device: torch.device,
        dtype: torch.dtype,
) -> torch.Tensor | None:
    """Additive mask (B * num_windows, 1, 1, window area) that hides padded keys, or None without padding.

    Masking padded keys makes attention in a window cut by the map border the same as attention over its valid
    tokens alone, so the result does not depend on how much padding was added.
    """
    padded_h = height + (window_h - height % window_h) % window_h
    padded_w = width + (window_w - width % window_w) % window_w
    if padded_h == height and padded_w == width:
        return None
    valid = torch.zeros(1, padded_h, padded_w, 1, device=device, dtype=dtype)
    valid[:, :height, :width] = 1.0
    valid = window_partition(valid, window_h, window_w).squeeze(-1)  # num_windows, area
    mask = torch.zeros_like(valid).masked_fill(valid == 0, float('-inf'))
    return mask.repeat(batch, 1)[:, None, None, :]
