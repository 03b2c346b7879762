"""Weight files (timm, exports, the authors' releases, training checkpoints): their weights found in any layout and
loaded into a model strictly, every file read by :func:`load_file` without executing code from it.

:func:`load_file`, :class:`CheckpointError` and :data:`READABLE_FORMATS` are the models' own
(:mod:`.file_reading`) and :class:`CheckpointError` the models' (``lipsformer.models.CheckpointError``), re-exported
here so that every reader of a file says the same about it.
"""
import os
import sys
from typing import Any

import torch

from ..models import CheckpointError
from .file_reading import READABLE_FORMATS, load_file

__all__ = ['READABLE_FORMATS', 'WRAPPER_PREFIXES', 'CheckpointError', 'check_state_dict', 'extract_state_dict',
           'load_checkpoint_dict', 'load_file', 'load_model_weights', 'strip_wrapper_prefixes']


def extract_state_dict(checkpoint: dict[str, Any], use_ema: bool = False) -> dict[str, torch.Tensor]:
    """The model weights inside a loaded checkpoint dict, in any of the common layouts.

    Understands a bare state dict, the authors' ``{'model': ...}`` files, timm's ``state_dict`` /
    ``state_dict_ema`` / ``model_ema`` entries, and DDP's ``module.`` and torch.compile's ``_orig_mod.`` prefixes.

    Args:
        checkpoint: What :func:`load_file` returned.
        use_ema: Take the EMA weights; an error if the checkpoint has none.
    """
    ema_keys = ('state_dict_ema', 'model_ema', 'ema')
    raw_keys = ('state_dict', 'model')
    keys = ema_keys if use_ema else raw_keys
    for key in keys:
        if isinstance(checkpoint.get(key), dict):
            state_dict = checkpoint[key]
            break
    else:
        if use_ema:
            raise CheckpointError(f'no EMA weights in checkpoint (looked for {ema_keys}); drop use_ema')
        state_dict = checkpoint
    tensors = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise CheckpointError(f'checkpoint holds no tensors under {keys} or at its top level')
    return strip_wrapper_prefixes(tensors)


# What wrappers put before every key of the model they wrap: DDP (and DataParallel), and torch.compile.
WRAPPER_PREFIXES = ('module.', '_orig_mod.')


def strip_wrapper_prefixes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state dict with the wrappers' prefixes (:data:`WRAPPER_PREFIXES`, in any nesting) that every key shares
    taken off, as the unwrapped model names its weights."""
    while state_dict:
        prefix = next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in state_dict)), None)
        if prefix is None:
            break
        state_dict = {k[len(prefix):]: v for k, v in state_dict.items()}
    return state_dict


def load_model_weights(model: torch.nn.Module, path: str | os.PathLike, use_ema: bool = False) -> None:
    """Load a checkpoint of any supported layout into ``model``, strictly.

    The model module's ``checkpoint_filter_fn`` (timm's convention) maps foreign layouts, such as the authors'
    files, to the model's own keys and raises a :class:`CheckpointError` naming any architecture mismatch.

    Args:
        model: The model to fill.
        path: A ``.safetensors``, timm ``.pth.tar``, this package's export, or an authors' ``.pth`` file.
        use_ema: Load the EMA weights of a checkpoint that has them.
    """
    load_checkpoint_dict(model, load_file(path), source=os.fspath(path), use_ema=use_ema)


def load_checkpoint_dict(model: torch.nn.Module, checkpoint: dict[str, Any], source: str = 'checkpoint',
                         use_ema: bool = False) -> None:
    """:func:`load_model_weights` for a checkpoint already read by :func:`load_file` (``source`` names it)."""
    state_dict = extract_state_dict(checkpoint, use_ema=use_ema)
    filter_fn = getattr(sys.modules[type(model).__module__], 'checkpoint_filter_fn', None)
    if filter_fn is not None:
        state_dict = filter_fn(state_dict, model)
    check_state_dict(model, state_dict, source=source)
    model.load_state_dict(state_dict, strict=True)


def check_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: str = 'checkpoint') -> None:
    """Raise a :class:`CheckpointError` that lists missing, unexpected and mis-shaped keys, if there are any."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    mis_shaped = [
        f'{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}'
        for k, v in state_dict.items() if k in expected and v.shape != expected[k].shape]
    if not (missing or unexpected or mis_shaped):
        return
    problems = []
    for title, keys in (('missing', missing), ('unexpected', unexpected), ('shape mismatch', mis_shaped)):
        if keys:
            shown = ', '.join(keys[:5]) + (f' ... ({len(keys)} in all)' if len(keys) > 5 else '')
            problems.append(f'{title}: {shown}')
    raise CheckpointError(
        f'{source} does not fit {type(model).__name__} ({"; ".join(problems)}). Check that the model name, '
        f'num_classes and architecture arguments match the ones the checkpoint was trained with.')
