"""A model in the form a test asks for: its fast form (``lipsformer.fastpath.to_fast_form``, switched on whatever the
device's default) or its plain module graph (``to_plain_form``)."""
import contextlib
from collections.abc import Iterator

import torch.nn as nn

from lipsformer.fastpath import in_fast_form, set_fast_path, to_fast_form, to_plain_form


def in_form(model: nn.Module, fast: bool, device_type: str | None = None) -> nn.Module:
    """``model`` itself, given its fast form (``fast``) or its plain module graph."""
    if not fast:
        return to_plain_form(model)
    with set_fast_path(True):
        return to_fast_form(model, device_type)


@contextlib.contextmanager
def form(model: nn.Module, fast: bool, device_type: str | None = None) -> Iterator[nn.Module]:
    """``model`` in that form inside the block, in its earlier form after it."""
    was_fast = in_fast_form(model)
    in_form(model, fast, device_type)
    try:
        yield model
    finally:
        in_form(model, was_fast, device_type)
