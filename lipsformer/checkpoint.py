"""Loading checkpoint files without executing code from them.

Every file goes through ``torch.load(weights_only=True)`` (or safetensors), never an unrestricted unpickler. The one
non-tensor object the authors' released checkpoints carry, a pickled ``yacs.config.CfgNode`` under ``config``, is
admitted by torch's restricted (weights-only) unpickler as an inert ``OrderedDict`` so that the tensors around it
can be read; yacs itself is never imported and nothing in the file is called.
"""
import os
import pickle
import sys
from collections import OrderedDict
from typing import Any

import torch
from safetensors.torch import load_file as load_safetensors

__all__ = ['CheckpointError', 'load_file', 'extract_state_dict', 'load_model_weights', 'check_state_dict']


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read or does not fit the model it is loaded into."""


# Pickled names that stand for plain configuration data in checkpoints users have (the authors' yacs config).
# A CfgNode is a dict subclass: read as an OrderedDict (already trusted by torch) it keeps its items as plain data.
# Registered process-wide so that timm's own weights-only loading (``pretrained=True`` with a file or URL) reads the
# authors' files too; the only effect is that such a config comes back as an OrderedDict instead of an error.
_INERT_GLOBALS = [(OrderedDict, 'yacs.config.CfgNode')]
torch.serialization.add_safe_globals(_INERT_GLOBALS)


def _unpickling_reason(error: Exception) -> str | None:
    """The line of torch's weights-only error naming the global it refused, or None if it refused none."""
    lines = [line.strip() for line in str(error).splitlines() if 'GLOBAL' in line]
    return lines[0] if lines else None


def load_file(path: str | os.PathLike, map_location: str | torch.device = 'cpu') -> dict[str, Any]:
    """Read a checkpoint (``.safetensors``, or a torch file) without executing any code stored in it.

    Args:
        path: File to read.
        map_location: Device for the loaded tensors.

    Returns:
        The file's top-level dict (a safetensors file gives its tensors).

    Raises:
        CheckpointError: The file is missing, is not a checkpoint, or its pickle asks to run code.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f'checkpoint {path!r} does not exist or is not a file')
    if path.endswith('.safetensors'):
        try:
            return load_safetensors(path, device=str(map_location))
        except Exception as e:
            raise CheckpointError(f'{path!r} is not a readable safetensors file: {e}') from e
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        reason = _unpickling_reason(e)
        if reason is None:
            raise CheckpointError(f'{path!r} is not a readable PyTorch checkpoint: {e}') from e
        raise CheckpointError(
            f'refusing to load {path!r}: its pickle references code that a weights-only load does not run '
            f'({reason}). Re-save the tensors alone (torch.save(model.state_dict(), ...) or safetensors) from a '
            f'trusted environment.') from e
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f'{path!r} is not a readable PyTorch checkpoint: {e}') from e
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f'{path!r} holds a {type(checkpoint).__name__}, expected a dict of tensors')
    return checkpoint


def extract_state_dict(checkpoint: dict[str, Any], use_ema: bool = False) -> dict[str, torch.Tensor]:
    """The model weights inside a loaded checkpoint dict, in any of the common layouts.

    Understands a bare state dict, the authors' ``{'model': ...}`` files, timm's ``state_dict`` /
    ``state_dict_ema`` / ``model_ema`` entries and DDP's ``module.`` prefix.

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
    if all(k.startswith('module.') for k in tensors):
        tensors = {k[len('module.'):]: v for k, v in tensors.items()}
    return tensors


def load_model_weights(model: torch.nn.Module, path: str | os.PathLike, use_ema: bool = False) -> None:
    """Load a checkpoint of any supported layout into ``model``, strictly.

    The model module's ``checkpoint_filter_fn`` (timm's convention) maps foreign layouts, such as the authors'
    files, to the model's own keys and raises a :class:`CheckpointError` naming any architecture mismatch.

    Args:
        model: The model to fill.
        path: A ``.safetensors``, timm ``.pth.tar``, this package's export, or an authors' ``.pth`` file.
        use_ema: Load the EMA weights of a checkpoint that has them.
    """
    state_dict = extract_state_dict(load_file(path), use_ema=use_ema)
    filter_fn = getattr(sys.modules[type(model).__module__], 'checkpoint_filter_fn', None)
    if filter_fn is not None:
        state_dict = filter_fn(state_dict, model)
    check_state_dict(model, state_dict, source=os.fspath(path))
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
