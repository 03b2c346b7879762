"""Model names that carry their weights: timm's ``hf-hub:REPO_ID`` and ``local-dir:FOLDER``, beside registered names.

Every command that takes a model name (train.py's ``model.name``, validate.py's ``--model``, ``python -m
lipsformer.lipschitz --model``, ``python -m lipsformer.instruments.benchmark --models``) accepts them through this
module: a ``local-dir:`` folder is checked before anything is built, and a Hub download that fails names the model and
the way around it instead of a bare network error.

Pretrained weights at a URL (a registered tag such as ``lipsformer_swin_tiny.in1k``) are fetched into timm's cache
before the model is built, so that a machine without network fails in a second rather than after building a large
model. Any download of weights that cannot reach its host (``pretrained=True``, a tagged name, ``hf-hub:``) raises a
:class:`ModelSourceError` whose one line names what was asked for, from where, and the two ways to use a copy of the
weights offline: ``pretrained_cfg_overlay=dict(file=...)``, or ``python -m lipsformer.hub.convert`` and ``local-dir:``.
"""
import difflib
import fnmatch
import inspect
import os
import re
from typing import Any

import timm
import torch
from timm.models import is_model, parse_model_name, split_model_name_tag
from timm.models._hub import download_cached_file

from ..utils.io import read_json
from .pretrained_sources import (
    ModelSourceError,
    hub_errors,
    model_source,
    offline_message,
    pretrained_source,
    unreachable,
)
from .weight_files import CheckpointError, load_file

__all__ = ['ModelSourceError', 'UnknownModelError', 'check_model_source', 'classifier_reset_note', 'create_model',
           'expand_model_names', 'hub_errors', 'meant_argument', 'model_source', 'offline_message', 'unaccepted_kwargs',
           'unreachable']


_WEIGHT_SUFFIXES = ('.safetensors', '.bin', '.pth', '.pth.tar')


class UnknownModelError(ValueError):
    """A model name or wildcard that no registered model (or none with pretrained weights) answers."""


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
               'output of python -m lipsformer.hub.convert')
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


def create_model(model_name: str, **kwargs: Any) -> torch.nn.Module:
    """``timm.create_model`` that checks a ``local-dir:`` folder first, gives a damaged or unsafe weights file there
    :mod:`lipsformer.weights.weight_files`'s message instead of torch's, and explains failed ``hf-hub:`` downloads.

    Raises:
        ModelSourceError: The folder is not a timm model folder, or the Hub cannot be reached or lacks the repo.
        CheckpointError: The folder's weights file is damaged, not a checkpoint, or references code.
    """
    source = model_source(model_name)
    if source:
        check_model_source(model_name)
    cfg = kwargs.get('pretrained_cfg') if isinstance(kwargs.get('pretrained_cfg'), dict) else {}
    asked = f'{model_name}.{cfg["tag"]}' if cfg.get('tag') and not split_model_name_tag(model_name)[1] else model_name
    hub_name = f'hf-hub:{cfg["hf_hub_id"]}' if cfg.get('source') == 'hf-hub' else asked
    folder = parse_model_name(model_name)[1] if source == 'local-dir' else (
        cfg.get('file') if cfg.get('source') == 'local-dir' else None)
    load_from, location = pretrained_source(model_name, kwargs) if kwargs.get('pretrained') and not source else (
        '', None)
    try:
        if load_from == 'url':  # into timm's cache, where timm finds it: a failure costs no model build
            with hub_errors(asked, location):
                download_cached_file(location, check_hash=False, progress=False, cache_dir=kwargs.get('cache_dir'))
        with hub_errors(hub_name, location if load_from in ('url', 'url-custom', 'hf-hub') else None):
            return timm.create_model(model_name, **kwargs)
    except Exception:
        problem = _unreadable_weights(folder) if folder and kwargs.get('pretrained') else None
        if problem is None:
            raise
        raise problem from None  # torch's error, and its weights_only advice, left out of the traceback


def _unreadable_weights(folder: str) -> CheckpointError | None:
    """Our error for the first weights file in ``folder`` that :func:`lipsformer.weights.weight_files.load_file`
    refuses."""
    for name in sorted(os.listdir(folder)):
        if name.endswith(_WEIGHT_SUFFIXES):
            try:
                load_file(os.path.join(folder, name))
            except CheckpointError as e:
                return e
    return None


def unaccepted_kwargs(error: TypeError, given: Any) -> list[str]:
    """The keyword arguments among ``given`` that a constructor's ``error`` rejects: the one Python names (``got an
    unexpected keyword argument 'window_size'``), else all of them."""
    named = re.findall(r"unexpected keyword argument '(\w+)'", str(error))
    return [name for name in named if name in given] or sorted(given)


def classifier_reset_note(model: torch.nn.Module) -> str | None:
    """What happened to the classifier when pretrained weights were loaded into a model with another class count
    (timm then leaves the classifier at its initialisation), or None if it was loaded."""
    cfg = getattr(model, 'pretrained_cfg', None) or {}
    trained = cfg.get('num_classes')
    if not cfg.get('classifier') or trained is None or trained == model.num_classes:
        return None
    return (f'the pretrained weights have a {trained}-class classifier and the model {model.num_classes} classes: '
            f'{cfg["classifier"]} starts from its initialisation, every other weight from the pretrained ones')


def expand_model_names(spec: str, with_weights: bool = False) -> list[str]:
    """Model names from a name, a comma list, or wildcards (``lipsformer_cswin_*``) over registered models, in order
    and each once; ``hf-hub:`` and ``local-dir:`` names are checked and kept as they are.

    Args:
        spec: The command's model argument (validate.py's ``--model``, the benchmark's and complexity's
            ``--models``).
        with_weights: Wildcards match only models with pretrained weights (tagged names, as timm lists them).

    Raises:
        UnknownModelError: A name or wildcard matches no registered model (the message names close ones), or a
            wildcard matches none with pretrained weights where they are asked for.
        ModelSourceError: A ``local-dir:`` folder is not a timm model folder.
    """
    names = []
    for part in (p.strip() for p in spec.split(',') if p.strip()):
        if any(c in part for c in '*?['):
            matches = timm.list_models(part, pretrained=with_weights)
            found = matches or timm.list_models(part)
            if found and not matches:
                raise UnknownModelError(f'{part!r} matches {len(found)} registered models, none with pretrained '
                                        f'weights')
        elif model_source(part):
            check_model_source(part)
            matches = [part]
        else:
            matches = [part] if is_model(split_model_name_tag(part)[0]) else []
        if not matches:
            registered = timm.list_models()
            close = (fnmatch.filter(registered, f'*{part.strip("*")}*')
                     or difflib.get_close_matches(part.strip('*'), registered, n=5, cutoff=0.6))[:5]
            raise UnknownModelError(f'no timm model matches {part!r}' + (f'; did you mean {close}?' if close else '')
                                    + ' (timm.list_models() lists the registered ones; LipsFormer models are '
                                    'registered by `import lipsformer`)')
        names.extend(matches)
    return list(dict.fromkeys(names))


def meant_argument(error: TypeError, also: tuple[str, ...] = ()) -> str | None:
    """The argument a constructor's ``got an unexpected keyword argument 'X'`` most likely meant: the closest of the
    model class's keyword arguments (and ``also``), or None."""
    match = re.search(r"unexpected keyword argument '(\w+)'", str(error))
    owner = re.search(r'(\w+)\.__init__\(\)', str(error))
    if match is None:
        return None
    known = [*also, *_constructor_parameters(owner.group(1) if owner else '')]
    near = difflib.get_close_matches(match.group(1), known, n=1, cutoff=0.6)
    return near[0] if near else None


def _constructor_parameters(class_name: str) -> list[str]:
    """The keyword arguments of the model class ``class_name`` (of the package or of timm) and of its subclasses,
    which hand it theirs: a LipsFormer family's ``window_size`` too."""
    import timm.models

    from ..models import _base, lipsformer_cswin, lipsformer_swin
    classes = [getattr(module, class_name, None) for module in (_base, lipsformer_swin, lipsformer_cswin, timm.models)]
    cls = next((found for found in classes if isinstance(found, type)), None)
    if cls is None:
        return []
    names = []
    for candidate in (cls, *cls.__subclasses__()):
        names += [name for name, parameter in inspect.signature(candidate.__init__).parameters.items()
                  if name != 'self' and parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD)]
    return names
