"""Reading one weights file without executing code from it: every reader of a file in the package goes through
:func:`load_file` (:mod:`.weight_files`), and so does the explanation of a failed ``pretrained=True`` load
(:mod:`.pretrained_sources`), which says what a file is instead of torch's advice to unpickle it with
``weights_only=False``.

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
import zipfile
from collections import OrderedDict
from typing import Any

import torch
from safetensors.torch import load_file as load_safetensors

from ..models import CheckpointError

__all__ = ['READABLE_FORMATS', 'CheckpointError', 'load_file']


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
