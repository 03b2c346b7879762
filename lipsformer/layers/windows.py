"""Token layouts of windowed attention: NHWC maps in rectangular windows (Swin windows, CSwin stripes) and heads.

Partitioning is a permutation of tokens and zero padding an isometric embedding, so both are 1-Lipschitz: the
Lipschitz constant of windowed attention is that of the attention inside one window.
"""

import torch
import torch.nn.functional as F
from timm.models import register_notrace_function

__all__ = ['pad_to_multiple', 'padded_size', 'padding_key_mask', 'split_heads', 'window_partition', 'window_reverse']


def padded_size(height: int, width: int, window_h: int, window_w: int) -> tuple[int, int]:
    """The map's height and width rounded up to multiples of the window."""
    return height + (window_h - height % window_h) % window_h, width + (window_w - width % window_w) % window_w


@register_notrace_function  # the pad amounts depend on the input's (traced) size
def pad_to_multiple(x: torch.Tensor, window_h: int, window_w: int) -> torch.Tensor:
    """Zero-pad a (B, H, W, ...) map at the bottom and right so that H and W are multiples of the window."""
    height, width = x.shape[1], x.shape[2]
    padded_h, padded_w = padded_size(height, width, window_h, window_w)
    if padded_h == height and padded_w == width:
        return x
    return F.pad(x, [0, 0] * (x.dim() - 3) + [0, padded_w - width, 0, padded_h - height])


@register_notrace_function  # reads the traced input's shape
def window_partition(x: torch.Tensor, window_h: int, window_w: int) -> torch.Tensor:
    """(B, H, W, ...) with H, W multiples of the window -> (B * num_windows, window_h * window_w, ...), row-major.

    One copy, whatever the strides of the trailing dimensions (a channel slice of a projection is read in place).
    """
    height, width = x.shape[1], x.shape[2]
    trailing: list[int] = list(x.shape[3:])
    x = x.reshape([-1, height // window_h, window_h, width // window_w, window_w] + trailing)
    x = x.permute([0, 1, 3, 2, 4] + list(range(5, x.dim())))
    return x.reshape([-1, window_h * window_w] + trailing)


@register_notrace_function  # the output shape depends on the traced height and width
def window_reverse(windows: torch.Tensor, window_h: int, window_w: int, height: int, width: int) -> torch.Tensor:
    """Inverse of :func:`window_partition` followed by :func:`pad_to_multiple`: (B * num_windows, area, ...) ->
    (B, height, width, ...), the padding cut off (a view of one copy)."""
    padded_h, padded_w = padded_size(height, width, window_h, window_w)
    trailing: list[int] = list(windows.shape[2:])
    x = windows.reshape([-1, padded_h // window_h, padded_w // window_w, window_h, window_w] + trailing)
    x = x.permute([0, 1, 3, 2, 4] + list(range(5, x.dim())))
    x = x.reshape([-1, padded_h, padded_w] + trailing)
    if padded_h != height or padded_w != width:
        x = x[:, :height, :width]
    return x


def split_heads(x: torch.Tensor, parts: int, num_heads: int) -> list[torch.Tensor]:
    """(N, L, parts * C) projections stacked along channels -> ``parts`` views (N, heads, L, C / heads).

    The parts are split before the heads are moved: the gradients of the parts are then stacked straight into the
    layout of x (one copy, none for a single part), not stacked and copied again into it.
    """
    if parts == 1:
        return [x.unflatten(-1, (num_heads, -1)).transpose(1, 2)]
    return [part.transpose(1, 2) for part in x.unflatten(-1, (parts, num_heads, -1)).unbind(2)]


@register_notrace_function  # data-dependent on the traced size
def padding_key_mask(height: int, width: int, window_h: int, window_w: int, device: torch.device,
                     dtype: torch.dtype) -> torch.Tensor | None:
    """Additive mask (num_windows, 1, 1, window area) that hides the keys padding adds to a height x width map, or
    None where no padding is needed.

    The same for every image: the callers view their (B * num_windows, ...) tensors as (B, num_windows, ...), so
    that the mask broadcasts over the batch and nothing depends on the batch size (which a tracer would bake into
    the graph). Masking padded keys makes attention in a window cut by the map border the same as attention over its
    valid tokens alone, so the result does not depend on how much padding was added.
    """
    padded_h, padded_w = padded_size(height, width, window_h, window_w)
    if padded_h == height and padded_w == width:
        return None
    valid = torch.zeros(1, padded_h, padded_w, 1, device=device, dtype=dtype)
    valid[:, :height, :width] = 1.0
    valid = window_partition(valid, window_h, window_w).squeeze(-1)  # num_windows, area
    return torch.zeros_like(valid).masked_fill(valid == 0, float('-inf'))[:, None, None, :]
