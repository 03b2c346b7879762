"""Pretrained weights that cannot be had, explained.

``timm.create_model(NAME, pretrained=True, ...)`` of a LipsFormer model fails as the package's commands do (the
models' builder loads pretrained weights inside :func:`explaining_pretrained_failures`, which ``import lipsformer``
gives it): a host that cannot be reached gives :func:`offline_message` (the two ways to use a copy of the weights
offline), a ``pretrained_cfg_overlay=dict(file=...)`` that is not there or not a weights file gives the words of
:func:`~.file_reading.load_file`, instead of urllib's traceback, an empty ``FileNotFoundError`` or torch's advice to
unpickle with ``weights_only=False``. The commands use the same pieces for names that carry their weights
(``hf-hub:``, ``local-dir:``; :mod:`lipsformer.weights.model_names`).
"""
import contextlib
import os
import socket
import urllib.error
import urllib.parse
from collections.abc import Iterator
from typing import Any

from huggingface_hub import constants as hf_constants
from huggingface_hub.utils import LocalEntryNotFoundError, OfflineModeIsEnabled
from timm.models import parse_model_name, resolve_pretrained_cfg, split_model_name_tag
from timm.models._builder import _resolve_pretrained_source

from ..models import CheckpointError
from .file_reading import load_file

__all__ = ['ModelSourceError', 'explaining_pretrained_failures', 'hub_errors', 'model_source', 'offline_message',
           'pretrained_source', 'unreachable']


class ModelSourceError(CheckpointError):
    """Weights that cannot be had from where they were asked for: a host that cannot be reached, or a
    ``local-dir:`` folder or ``hf-hub:`` repository that holds no usable timm model."""


def model_source(name: str) -> str | None:
    """``'hf-hub'`` or ``'local-dir'`` for a name that carries its weights; None for a registered model name."""
    try:
        return parse_model_name(name)[0]
    except ValueError:
        return None


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
            f'or python -m lipsformer.hub.convert {file} FOLDER --model {architecture} once, then the model name '
            f'local-dir:FOLDER (validate.py also takes the file as --checkpoint, train.py as model.init_checkpoint)')


def pretrained_source(model_name: str, kwargs: dict[str, Any]) -> tuple[str, Any]:
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


@contextlib.contextmanager
def explaining_pretrained_failures(variant: str, kwargs: dict[str, Any]) -> Iterator[None]:
    """Around the build of the registered model ``variant`` with pretrained weights (``kwargs``: what its entry point
    was given): a missing overlay file is refused before anything is built, and a failed load explained.

    Raises:
        ModelSourceError: The weights' host cannot be reached (or an ``hf-hub:`` source fails).
        CheckpointError: The overlay file is not there, or it is not a weights file lipsformer can read.
    """
    load_from, location = pretrained_source(variant, kwargs)
    tag = kwargs.get('pretrained_cfg') if isinstance(kwargs.get('pretrained_cfg'), str) else None
    asked = f'{variant}.{tag}' if tag else variant
    if load_from == 'file' and not os.path.isfile(location):
        raise CheckpointError(f'{asked}: pretrained_cfg_overlay=dict(file={location!r}): no such file; give the '
                              f'path of a downloaded copy of the weights')
    try:
        with hub_errors(asked, location if load_from in ('url', 'url-custom', 'hf-hub') else None):
            yield
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
