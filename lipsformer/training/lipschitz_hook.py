"""The optional Lipschitz constraint applied after each optimizer update (``lipschitz.*`` in the config).

``lipschitz.target`` names a factory as ``module:callable``; it is called once as ``factory(model, **kwargs)`` with
the unwrapped model, and what it returns is called with no arguments after every update. When that object has
``state_dict`` / ``load_state_dict`` (cached power-iteration vectors, say) it is saved with the checkpoints.
"""
import importlib
from collections.abc import Callable

import torch

from .config import ConfigError, LipschitzConfig


def create_lipschitz_constraint(settings: LipschitzConfig, model: torch.nn.Module) -> Callable[[], None]:
    """Build the constraint named by ``settings.target`` for ``model``."""
    module_name, _, attribute = settings.target.partition(':')
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f'lipschitz.target: cannot import {settings.target!r} ({e}); give module:callable, or set '
                          f'lipschitz.enabled=false') from e
    try:
        constraint = factory(model, **settings.kwargs)
    except TypeError as e:
        raise ConfigError(f'lipschitz.kwargs: {settings.target} does not accept {settings.kwargs} ({e})') from e
    except ValueError as e:
        raise ConfigError(f'lipschitz.kwargs: {settings.target} rejects {settings.kwargs}: {e}') from e
    if not callable(constraint):
        raise ConfigError(f'lipschitz.target: {settings.target}(model, ...) returned a {type(constraint).__name__}, '
                          f'which cannot be called after each update')
    return constraint
