"""Model names that carry their weights: timm's ``hf-hub:REPO_ID`` and ``local-dir:FOLDER``, beside registered names.

Every command that takes a model name (train.py's ``model.name``, validate.py's ``--model``, ``python -m
lipsformer.lipschitz --model``, ``python -m lipsformer.benchmark --models``) accepts them through this module: a
``local-dir:`` folder is checked before anything is built, and a Hub download that fails names the model and the
way around it instead of a bare network error.

Pretrained weights at a URL (a registered tag such as ``lipsformer_swin_tiny.in1k``) are fetched into timm's cache
before the model is built, so that a machine without network fails in a second rather than after building a large
model. Any download of weights that cannot reach its host (``pretrained=True``, a tagged name, ``hf-hub:``) raises a
:class:`ModelSourceError` whose one line names what was asked for, from where, and the two ways to use a copy of the
weights offline: ``pretrained_cfg_overlay=dict(file=...)``, or ``python -m lipsformer.convert`` and ``local-dir:``.
"""
import contextlib
import difflib
import fnmatch
import functools
import os
import re
import socket
import urllib.error
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import timm
import torch
from huggingface_hub import constants as hf_constants
from huggingface_hub.utils import LocalEntryNotFoundError, OfflineModeIsEnabled
from timm.models import is_model, parse_model_name, resolve_pretrained_cfg, split_model_name_tag
from timm.models._builder import _resolve_pretrained_source
from timm.models._hub import download_cached_file
from timm.models._registry import _model_entrypoints

from .utils.io import read_json
from .weight_files import CheckpointError, load_file

__all__ = ['ModelSourceError', 'UnknownModelError', 'check_model_source', 'classifier_reset_note', 'create_model',
           'expand_model_names', 'explain_pretrained_failures', 'hub_errors', 'model_source', 'offline_message',
           'unaccepted_kwargs', 'unreachable']


_WEIGHT_SUFFIXES = ('.safetensors', '.bin', '.pth', '.pth.tar')


class UnknownModelError(ValueError):
    """A model name or wildcard that no registered model (or none with pretrained weights) answers."""


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
def hub_errors(name: str, location: str | None = None) -> Iterator[None]:
    """Turn a failed download for ``name`` into a :class:`ModelSourceError` saying what to do: a host that cannot be
    reached (any weights: ``location`` names the URL or Hub repository), or any other Hub failure of an ``hf-hub:``
    name (an unknown repository or file)."""
    try:
        yield
    except ModelSourceError:
        raise
    except Exception as e:  # noqa: BLE001  every network library raises its own types; the others are re-raised
        if unreachable(e):
            raise ModelSourceError(offline_message(name, location, e)) from e
        if model_source(name) != 'hf-hub' or not isinstance(e, OSError):
            raise
        raise ModelSourceError(
            f'{name}: cannot get its files from the Hugging Face Hub ({type(e).__name__}: {str(e)[:300]}). Without '
            f'network access a Hub model works only once it is in the local cache (HF_HOME); a copy of the model '
            f'folder works anywhere as local-dir:FOLDER') from e


def unreachable(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) says that a host could not be reached, or that downloads are off
    (HF_HUB_OFFLINE and nothing in the cache)."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (urllib.error.URLError, ConnectionError, TimeoutError, socket.gaierror,
                              LocalEntryNotFoundError, OfflineModeIsEnabled)):
            return True
        if type(error).__module__.startswith(('httpx', 'httpcore', 'requests', 'urllib3')) and any(
                word in type(error).__name__ for word in ('Connect', 'Timeout', 'Network', 'Proxy')):
            return True
        error = error.__cause__ or error.__context__
    return False


def offline_message(name: str, location: str | None, error: BaseException) -> str:
    """One line: what was asked for and from where, why it failed, and the two offline ways."""
    source = model_source(name)
    file = os.path.basename(urllib.parse.urlparse(location).path) if location and '://' in location else ''
    file = file or 'model.safetensors'
    if source == 'hf-hub' or location and '://' not in str(location):
        repo = location if location else parse_model_name(name)[1]
        location = f'the Hugging Face Hub repository {repo} at {hf_constants.ENDPOINT}'
    architecture = split_model_name_tag(name)[0] if not source else 'ARCHITECTURE'
    text = str(error).strip()
    reason = text.splitlines()[0].split('. ')[0].rstrip('.')[:200] if text else type(error).__name__
    copy = ('a copy of the repository\'s files (a folder with its config.json and model.safetensors is itself '
            'local-dir:FOLDER)' if source == 'hf-hub' else f'a copy of {file}')
    return (f'cannot download the weights of {name} from {location or "its host"}: {reason}. Offline, use {copy}: '
            f'timm.create_model(\'{architecture}\', pretrained=True, pretrained_cfg_overlay=dict(file=\'{file}\')), '
            f'or python -m lipsformer.convert {file} FOLDER --model {architecture} once, then the model name '
            f'local-dir:FOLDER (validate.py also takes the file as --checkpoint, train.py as model.init_checkpoint)')


def _pretrained_source(model_name: str, kwargs: dict[str, Any]) -> tuple[str, Any]:
    """Where timm will take a registered model's pretrained weights from, as timm decides it: ('url', URL),
    ('hf-hub', REPO_ID), ('file', PATH), ... or ('', '') for none or a cfg timm itself rejects (its own error then
    comes from create_model)."""
    try:
        cfg = resolve_pretrained_cfg(model_name, kwargs.get('pretrained_cfg'),
                                     kwargs.get('pretrained_cfg_overlay')).to_dict()
    except Exception:  # noqa: BLE001
        return '', ''
    load_from, location = _resolve_pretrained_source(cfg)
    return ('url-custom' if load_from == 'url' and cfg.get('custom_load') else load_from), location


def create_model(model_name: str, **kwargs: Any) -> torch.nn.Module:
    """``timm.create_model`` that checks a ``local-dir:`` folder first, gives a damaged or unsafe weights file there
    :mod:`lipsformer.weight_files`'s message instead of torch's, and explains failed ``hf-hub:`` downloads.

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
    load_from, location = _pretrained_source(model_name, kwargs) if kwargs.get('pretrained') and not source else (
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


def explain_pretrained_failures(model_names: Iterable[str]) -> None:
    """Make ``timm.create_model(NAME, pretrained=True, ...)`` of these registered models fail as the commands do: a
    host that cannot be reached gives :func:`offline_message`, a ``pretrained_cfg_overlay=dict(file=...)`` that is not
    there or not a weights file gives :mod:`lipsformer.weight_files`' error, instead of urllib's traceback, an empty
    ``FileNotFoundError`` or torch's advice to unpickle with ``weights_only=False``.

    Each model's timm entry point is wrapped in place (once); models built without pretrained weights are unaffected.
    """
    for name in model_names:
        entrypoint = _model_entrypoints[name]
        if not getattr(entrypoint, 'explains_pretrained_failures', False):
            _model_entrypoints[name] = _explaining(name, entrypoint)


def _explaining(name: str, entrypoint: Callable[..., torch.nn.Module]) -> Callable[..., torch.nn.Module]:
    @functools.wraps(entrypoint)
    def create(pretrained: bool = False, **kwargs: Any) -> torch.nn.Module:
        if not pretrained:
            return entrypoint(pretrained=pretrained, **kwargs)
        load_from, location = _pretrained_source(name, kwargs)
        tag = kwargs.get('pretrained_cfg') if isinstance(kwargs.get('pretrained_cfg'), str) else None
        asked = f'{name}.{tag}' if tag else name
        if load_from == 'file' and not os.path.isfile(location):
            raise CheckpointError(f'{asked}: pretrained_cfg_overlay=dict(file={location!r}): no such file; give the '
                                  f'path of a downloaded copy of the weights')
        try:
            with hub_errors(asked, location if load_from in ('url', 'url-custom', 'hf-hub') else None):
                return entrypoint(pretrained=True, **kwargs)
        except ModelSourceError:
            raise
        except Exception:
            if load_from != 'file':
                raise
            try:
                load_file(location)  # if it reads the file, timm's own error stands
            except CheckpointError as problem:
                raise problem from None  # torch's error, and its weights_only advice, left out of the traceback
            raise

    create.explains_pretrained_failures = True
    return create


def _unreadable_weights(folder: str) -> CheckpointError | None:
    """Our error for the first weights file in ``folder`` that :func:`lipsformer.weight_files.load_file` refuses."""
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
