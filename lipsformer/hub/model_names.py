"""Model names that carry their weights: timm's ``hf-hub:REPO_ID`` and ``local-dir:FOLDER``, beside registered names.

Every command that takes a model name (train.py's ``model.name``, validate.py's ``--model``, ``python -m
lipsformer.lipschitz --model``, ``python -m lipsformer.benchmark --models``) accepts them through this module: a
``local-dir:`` folder is checked before anything is built, and a Hub download that fails names the model and the
way around it instead of a bare network error.
"""
import contextlib
import os
from collections.abc import Iterator
from typing import Any

import timm
import torch
from timm.models import is_model, parse_model_name

from ..checkpoint import CheckpointError, load_file
from ..utils.io import read_json

__all__ = ['ModelSourceError', 'check_model_source', 'classifier_reset_note', 'create_model', 'hub_errors',
           'model_source']


_WEIGHT_SUFFIXES = ('.safetensors', '.bin', '.pth', '.pth.tar')


class ModelSourceError(CheckpointError):
    """A ``local-dir:`` folder or ``hf-hub:`` repository that holds no usable timm model."""


def model_source(name: str) -> str | None:
    """``'hf-hub'`` or ``'local-dir'`` for a name that carries its weights; None for a registered model name."""
    try:
        return parse_model_name(name)[0]
    except ValueError:
        return None


def check_model_source(name: str) -> None:
    """Check what can be checked offline: a ``local-dir:`` folder holds a ``config.json`` naming a registered
    architecture, and weights.

    Raises:
        ModelSourceError: Saying what the folder lacks and how such a folder is made.
    """
    source, location = parse_model_name(name)
    if source != 'local-dir':
        return
    config_path = os.path.join(location, 'config.json')
    made_by = ('a timm model folder holds config.json and model.safetensors: a training run\'s export/best, or the '
               'output of python -m lipsformer.convert')
    if not os.path.isfile(config_path):
        what = 'does not exist' if not os.path.exists(location) else 'holds no config.json'
        raise ModelSourceError(f'{name}: {location!r} {what}; {made_by}')
    try:
        architecture = read_json(config_path).get('architecture')
    except (ValueError, OSError, AttributeError) as e:
        raise ModelSourceError(f'{name}: {config_path!r} is not a timm config.json ({e}); {made_by}') from e
    if not architecture or not is_model(architecture):
        raise ModelSourceError(f'{name}: {config_path!r} names the architecture {architecture!r}, which is not a '
                               f'registered timm model (LipsFormer models are registered by importing lipsformer)')
    weights = [n for n in os.listdir(location) if n.endswith(_WEIGHT_SUFFIXES)]
    if not weights:
        raise ModelSourceError(f'{name}: {location!r} has a config.json but no weights file; {made_by}')


@contextlib.contextmanager
def hub_errors(name: str) -> Iterator[None]:
    """Turn a failed Hub download for ``name`` (``hf-hub:...``) into a :class:`ModelSourceError` saying what to do."""
    try:
        yield
    except OSError as e:  # huggingface_hub's errors (offline, unknown repo or file) are OSErrors
        if model_source(name) != 'hf-hub' or isinstance(e, ModelSourceError):
            raise
        raise ModelSourceError(
            f'{name}: cannot get its files from the Hugging Face Hub ({type(e).__name__}: {str(e)[:300]}). Without '
            f'network access a Hub model works only once it is in the local cache (HF_HOME); a copy of the model '
            f'folder works anywhere as local-dir:FOLDER') from e


def create_model(model_name: str, **kwargs: Any) -> torch.nn.Module:
    """``timm.create_model`` that checks a ``local-dir:`` folder first, gives a damaged or unsafe weights file there
    :mod:`lipsformer.checkpoint`'s message instead of torch's, and explains failed ``hf-hub:`` downloads.

    Raises:
        ModelSourceError: The folder is not a timm model folder, or the Hub cannot be reached or lacks the repo.
        CheckpointError: The folder's weights file is damaged, not a checkpoint, or references code.
    """
    source = model_source(model_name)
    if source:
        check_model_source(model_name)
    cfg = kwargs.get('pretrained_cfg') if isinstance(kwargs.get('pretrained_cfg'), dict) else {}
    hub_name = f'hf-hub:{cfg["hf_hub_id"]}' if cfg.get('source') == 'hf-hub' else model_name
    folder = parse_model_name(model_name)[1] if source == 'local-dir' else (
        cfg.get('file') if cfg.get('source') == 'local-dir' else None)
    try:
        with hub_errors(hub_name):
            return timm.create_model(model_name, **kwargs)
    except Exception:
        problem = _unreadable_weights(folder) if folder and kwargs.get('pretrained') else None
        if problem is None:
            raise
        raise problem from None  # torch's error, and its weights_only advice, left out of the traceback


def _unreadable_weights(folder: str) -> CheckpointError | None:
    """Our error for the first weights file in ``folder`` that :func:`lipsformer.checkpoint.load_file` refuses."""
    for name in sorted(os.listdir(folder)):
        if name.endswith(_WEIGHT_SUFFIXES):
            try:
                load_file(os.path.join(folder, name))
            except CheckpointError as e:
                return e
    return None


def classifier_reset_note(model: torch.nn.Module) -> str | None:
    """What happened to the classifier when pretrained weights were loaded into a model with another class count
    (timm then leaves the classifier at its initialisation), or None if it was loaded."""
    cfg = getattr(model, 'pretrained_cfg', None) or {}
    trained = cfg.get('num_classes')
    if not cfg.get('classifier') or trained is None or trained == model.num_classes:
        return None
    return (f'the pretrained weights have a {trained}-class classifier and the model {model.num_classes} classes: '
            f'{cfg["classifier"]} starts from its initialisation, every other weight from the pretrained ones')
