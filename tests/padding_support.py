"""What reaches the tokens the models pad: a recorder of the tensors they pad, for the padding tests on CPU and CUDA."""
import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

from lipsformer.layers import pad_to_multiple
from lipsformer.models import lipsformer_cswin, lipsformer_swin
from lipsformer.models.lipsformer_cswin import StripeAttention


@contextlib.contextmanager
def recording_padding() -> Iterator[list[tuple[torch.Tensor, int, int]]]:
    """Within the block, each tensor the models pad (Swin's projection, CSwin's q, k and v) is recorded with the
    height and width of its unpadded part, its gradient retained."""
    padded_tensors = []

    def recording_pad(x: torch.Tensor, window_h: int, window_w: int) -> torch.Tensor:
        padded = pad_to_multiple(x, window_h, window_w)
        if padded is not x and padded.requires_grad:
            padded.retain_grad()
            padded_tensors.append((padded, x.shape[1], x.shape[2]))
        return padded

    with mock.patch.object(lipsformer_swin, 'pad_to_multiple', recording_pad), \
            mock.patch.object(lipsformer_cswin, 'pad_to_multiple', recording_pad):
        yield padded_tensors


def zero_lepe(model: torch.nn.Module) -> None:
    """Zero CSwin's LePE weights: its conv reads padded v as the zero padding at a stripe's edge, and so has a gradient
    there, as a convolution has at its own zero padding, which the padding's backward drops."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, StripeAttention):
                module.lepe.weight.zero_()


def assert_no_gradient_at_the_padding(padded_tensors: list[tuple[torch.Tensor, int, int]]) -> None:
    """Every recorded tensor's gradient is finite, exactly zero at its padded rows and columns and not all zero."""
    assert padded_tensors
    for padded, height, width in padded_tensors:
        assert padded.grad is not None and torch.isfinite(padded.grad).all()
        assert not padded.grad[:, height:].any() and not padded.grad[:, :, width:].any()
        assert padded.grad[:, :height, :width].any()
