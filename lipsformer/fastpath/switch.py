"""The one switch for the package's fast paths: on which device types the package gives its models their fast form.

A fast form computes what the plain module graph computes, the same function of the same parameters, with kernels
that are faster or keep fewer activations for backward (:mod:`.forms`). The package's training, validation and
benchmark give a model its fast form (``to_fast_form``) where this switch is on for the model's device: by default on
the devices in :data:`DEFAULT_DEVICES`, where the benchmark measures the fast form faster than the plain module graph
(docs/performance.md); :func:`set_fast_path` (or ``LIPSFORMER_FAST_PATH`` at import: ``1`` on every device, ``0`` on
none, ``auto`` or unset the defaults) overrides them, and timm's ``set_layer_config(exportable=True)`` or
``scriptable=True`` turns it off. What ``timm.create_model`` returns is always the plain module graph.
"""
import os

from timm.layers import is_exportable, is_scriptable

__all__ = ['DEFAULT_DEVICES', 'set_fast_path', 'use_fast_path']

_ENVIRONMENT_VARIABLE = 'LIPSFORMER_FAST_PATH'
_ON, _OFF, _AUTO = ('1', 'true', 'on', 'yes'), ('0', 'false', 'off', 'no'), ('auto', '')

# The device types on which the fast path is on unless switched: those where docs/performance.md measures it faster
# than the plain module graph (on CUDA: in training for both families, in inference for LipsFormer-Swin).
DEFAULT_DEVICES = frozenset({'cpu', 'cuda'})


def _from_environment() -> bool | None:
    value = os.environ.get(_ENVIRONMENT_VARIABLE, 'auto').strip().lower()
    if value not in _ON + _OFF + _AUTO:
        raise ValueError(f'{_ENVIRONMENT_VARIABLE}={os.environ[_ENVIRONMENT_VARIABLE]!r} is neither on {_ON}, off '
                         f'{_OFF} nor auto; set it to 0 to run the plain module graph, or unset it')
    return None if value in _AUTO else value in _ON


_enabled: bool | None = _from_environment()  # None: on for DEFAULT_DEVICES


class set_fast_path:  # noqa: N801 (a function that is also a context manager, as timm's set_layer_config)
    """Turn the fast paths on or off: ``set_fast_path(False)`` for the rest of the process, or
    ``with set_fast_path(False): ...`` for a block, after which the previous state returns.

    ``True`` turns them on for every device, ``False`` off for every device, ``None`` back to the defaults (on for
    :data:`DEFAULT_DEVICES`).
    """

    def __init__(self, enable: bool | None = True) -> None:
        global _enabled
        self.previous = _enabled
        _enabled = None if enable is None else bool(enable)

    def __enter__(self) -> 'set_fast_path':
        return self

    def __exit__(self, *exc_info: object) -> None:
        global _enabled
        _enabled = self.previous


def use_fast_path(device_type: str = 'cpu') -> bool:
    """Whether the fast paths are switched on for ``device_type`` (:func:`set_fast_path` or the defaults, and timm's
    layer config not exportable or scriptable)."""
    enabled = device_type in DEFAULT_DEVICES if _enabled is None else _enabled
    return enabled and not is_exportable() and not is_scriptable()

