"""Shims for APIs that only the newer releases inside the supported dependency range have.

Each shim uses the dependency's own function where it exists and otherwise does what the older release's own models
do, so behaviour never depends on which route was taken beyond what that release itself supports.
"""
from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = ['update_model_input_size']

try:  # timm >= 1.0.31 records a model's current input size (timm.models.get_model_input_config reads it back)
    from timm.models._input import update_model_input_size
except ImportError:  # older timm keeps no such record: its own models' set_input_size changes the modules only
    def update_model_input_size(model: nn.Module, img_size: int | Sequence[int] | None,
                                **model_args: Any) -> None:
        """No-op: this timm has no per-model input-size record to update (``pretrained_cfg`` stays the source's)."""
