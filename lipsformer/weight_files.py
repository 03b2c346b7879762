"""Reading weight files (timm, exports, the authors' releases, training checkpoints) without executing code from them.

Every file goes through ``torch.load(weights_only=True)`` (or safetensors), never an unrestricted unpickler. Two
non-tensor objects that checkpoints users have carry are admitted by torch's restricted (weights-only) unpickler as
plain data, so that the tensors around them can be read:

- the authors' released checkpoints pickle a ``yacs.config.CfgNode`` under ``config``: it is read as an inert
  ``OrderedDict`` (yacs itself is never imported);
- timm's ``train.py`` saves its parsed arguments, an ``argparse.Namespace``, under ``args`` in every checkpoint: it
  is rebuilt as a Namespace (``object.__new__`` and an update of its ``__dict__``; no constructor or method runs),
  and each of its values must itself be admitted data, so a Namespace holding code is refused like any other pickle.
  It is admitted only while this module loads a file, as timm's own loaders admit it around theirs.

Nothing else is widened, and nothing in a file is called.
"""
import argparse
import io
import os
import pickletools
import sys
import zipfile
from collections import OrderedDict
from typing import Any

import torch
from safetensors.torch import load_file as load_safetensors

__all__ = ['READABLE_FORMATS', 'WRAPPER_PREFIXES', 'CheckpointError', 'check_state_dict', 'extract_state_dict',
           'load_checkpoint_dict', 'load_file', 'load_model_weights', 'strip_wrapper_prefixes']


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read or does not fit the model it is loaded into."""


# Pickled names that stand for plain configuration data in checkpoints users have (the authors' yacs config).
# A CfgNode is a dict subclass: read as an OrderedDict (already trusted by torch) it keeps its items as plain data.
# Registered process-wide so that timm's own weights-only loading (``pretrained=True`` with a file or URL) reads the
# authors' files too; the only effect is that such a config comes back as an OrderedDict instead of an error.
_INERT_GLOBALS = [(OrderedDict, 'yacs.config.CfgNode')]
torch.serialization.add_safe_globals(_INERT_GLOBALS)
# timm train.py's arguments, admitted while this module loads a file (timm's own checkpoint loaders do the same
# around theirs), so that nothing else in the process reads them without asking.
_ARGUMENTS = [argparse.Namespace]


# What load_file reads, said in every error about a file it cannot read.
READABLE_FORMATS = ('lipsformer reads .safetensors files and torch.save files (.pth, .pth.tar, .pt, .bin; zip or '
                    'legacy format) holding a state dict or a training checkpoint (timm\'s, this package\'s, the '
                    'authors\')')
_ZIP_MAGIC = b'PK\x03\x04'


def load_file(path: str | os.PathLike, map_location: str | torch.device = 'cpu', mmap: bool = False
              ) -> dict[str, Any]:
    """Read a checkpoint (``.safetensors``, or a torch file) without executing any code stored in it.

    A file that cannot be read gets a :class:`CheckpointError` that says what it is instead (empty, text, unknown
    bytes, a truncated or corrupt archive, a pickle that references code), its size and the formats read; never
    torch's advice to load it with ``weights_only=False``.

    Args:
        path: File to read.
        map_location: Device for the loaded tensors.
        mmap: Map the tensors of a torch.save (zip) file from the disk instead of reading them, to look at its other
            entries cheaply (other formats are read whole).

    Returns:
        The file's top-level dict (a safetensors file gives its tensors).

    Raises:
        CheckpointError: The file is missing, is not a checkpoint, is damaged, or its pickle asks to run code.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f'checkpoint {path!r} does not exist or is not a file')
    kind = _file_kind(path)
    if kind == 'safetensors' or path.endswith('.safetensors'):
        try:
            return load_safetensors(path, device=str(map_location))
        except Exception as e:
            raise _unreadable(path, f'a corrupt or truncated safetensors file ({_first_line(e)})') from None
    if kind not in ('zip', 'pickle'):
        raise _unreadable(path, kind)
    try:
        with torch.serialization.safe_globals(_ARGUMENTS):
            checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap and kind == 'zip')
    except Exception as e:  # torch raises many types for damaged files (RuntimeError, EOFError, KeyError, ...)
        raise _load_failure(path, kind, e) from None  # torch's text (and its weights_only=False advice) left out
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f'{path!r} holds a {type(checkpoint).__name__}, expected a dict of tensors')
    return checkpoint


def _file_kind(path: str) -> str:
    """'safetensors', 'zip' (torch.save's format), 'pickle' (its legacy format), or why the file is neither."""
    with open(path, 'rb') as f:
        head = f.read(512)
    if not head:
        return 'empty'
    header_length = int.from_bytes(head[:8], 'little') if len(head) >= 8 else 0
    if head[8:9] == b'{' and 0 < header_length < 2 ** 27:
        return 'safetensors'
    if head.startswith(_ZIP_MAGIC):
        return 'zip'
    if head[:1] == b'\x80' and 2 <= head[1] <= 5 or _pickle_globals(path) is not None:  # PROTO 2-5, or 0/1
        return 'pickle'
    try:
        text = head.decode('utf-8')
    except UnicodeDecodeError:
        text = None
    if text is not None and all(c.isprintable() or c in '\t\r\n' for c in text):
        first_line = text.strip().splitlines()[0][:60] if text.strip() else text
        return f'a text file (it begins {first_line!r})'
    return f'neither a safetensors file nor a torch.save archive or pickle (it begins with bytes {head[:8].hex(" ")})'


def _unreadable(path: str, what: str) -> CheckpointError:
    size = os.path.getsize(path)
    if what == 'empty':
        return CheckpointError(f'{path!r} is empty (0 bytes), not a checkpoint: was it still being written or copied? '
                               f'{READABLE_FORMATS}.')
    return CheckpointError(f'{path!r} ({size:,} bytes) is not a checkpoint lipsformer can read: it is {what}. '
                           f'{READABLE_FORMATS}.')


def _load_failure(path: str, kind: str, error: Exception) -> CheckpointError:
    """Why torch could not read a zip or pickle file: code it references, or damage."""
    admitted = _admitted_globals()
    references = _pickle_globals(path, zipped=kind == 'zip') or []
    code = list(dict.fromkeys(n for n in references if n.replace('__builtin__.', 'builtins.', 1) not in admitted))
    if code:
        return CheckpointError(
            f'refusing to load {path!r} ({os.path.getsize(path):,} bytes): its pickle references code '
            f'({", ".join(code[:5])}), which a weights-only load never runs. If the file comes from a source you '
            f'trust, re-save its tensors alone (torch.save(model.state_dict(), ...) or safetensors) there.')
    archive = 'torch.save archive' if kind == 'zip' else 'torch.save (legacy format) or pickle file'
    detail = _first_line(error)
    return _unreadable(path, f'a truncated or corrupt {archive}' + (f' ({detail})' if detail else '')
                       + '; copy or save it again')


def _admitted_globals() -> set[str]:
    """The globals torch's weights-only unpickler admits (tensor storage, plain containers, registered ones)."""
    arguments = {f'{cls.__module__}.{cls.__qualname__}' for cls in _ARGUMENTS}
    try:  # private, but the one list of what a weights-only load accepts
        from torch import _weights_only_unpickler as unpickler
        return set(unpickler._get_allowed_globals()) | set(unpickler._get_user_allowed_globals()) | arguments
    except (ImportError, AttributeError):  # a torch without the list: storage, dtypes and containers only
        return {'collections.OrderedDict', 'builtins.set', 'torch._utils._rebuild_tensor_v2', 'torch.Size',
                'torch.FloatStorage', 'torch.LongStorage', 'yacs.config.CfgNode'} | arguments


def _first_line(error: Exception) -> str:
    """The first line of an error message, unless it is torch's advice about weights_only."""
    sentence = str(error).strip().split('\n')[0].split('. ')[0].rstrip('.')
    return '' if 'weights_only' in sentence else sentence[:200]


def _pickle_globals(path: str, zipped: bool = False) -> list[str] | None:
    """The globals (module.name) the file's pickles reference, read opcode by opcode without running any; None
    if it holds no complete pickle. Legacy torch.save files are several pickles followed by raw tensor bytes."""
    try:
        if zipped:
            with zipfile.ZipFile(path) as archive:
                name = next(n for n in archive.namelist() if n.endswith('data.pkl'))
                stream = io.BytesIO(archive.read(name))
        else:
            with open(path, 'rb') as f:
                stream = io.BytesIO(f.read(2 ** 20))  # the pickles come first; tensor data follows
    except (zipfile.BadZipFile, StopIteration, OSError, RuntimeError):
        return None
    found: list[str] = []
    for _ in range(5):
        names = _globals_of_one_pickle(stream)
        if names is None:
            break
        found += names
    return found if found or stream.tell() else None


def _globals_of_one_pickle(stream: io.BytesIO) -> list[str] | None:
    start, strings, names = stream.tell(), [], []
    try:
        # dis checks the stack and memo as a load would: about one random file in 200 begins with bytes that
        # genops alone reads as a whole pickle (a lone STOP), one in 5000 passes dis
        pickletools.dis(stream, out=io.StringIO())
        stream.seek(start)
        for opcode, argument, _ in pickletools.genops(stream):
            if opcode.name in ('GLOBAL', 'INST'):
                names.append(argument.replace(' ', '.'))
            elif opcode.name == 'STACK_GLOBAL' and len(strings) >= 2:
                names.append(f'{strings[-2]}.{strings[-1]}')
            elif isinstance(argument, str):
                strings.append(argument)
    except Exception:  # not a (whole) pickle: genops raises ValueError and friends on bad bytes
        stream.seek(start)
        return None
    return names


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
