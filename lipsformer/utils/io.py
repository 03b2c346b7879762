"""Writes that survive a crash: data reaches the disk before a rename makes it visible.

Every file is written under a hidden temporary name beside its target (``.<name>.tmp-<pid>-<random>``, so concurrent
writers never share one; created with the permissions a plain ``open`` gives), flushed to disk, then renamed over the
target, and the folder's entry is flushed as well. A process killed at any instant leaves the old file or the new one,
never a torn one; a write that raises removes its temporary file. Whole folders are written under ``.tmp-<name>`` and
swapped in (:func:`replace_dir`); :func:`remove_stale_temporaries` clears what a killed writer left.

A failed write is an :class:`OSError` wherever the failure came from: safetensors' errors that carry the operating
system's error code become one, and :func:`os_error_in_chain` finds the one behind another library's error (torch's
``inline_container`` "enforce fail" holds the ``OSError`` of the write in its context).
"""
import contextlib
import ctypes
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from typing import IO, Any

import torch
from safetensors.torch import save_file

__all__ = ['JsonLines', 'atomic_open', 'atomic_path', 'default_file_mode', 'file_sha256', 'fsync_dir',
           'os_error_in_chain', 'read_json', 'remove_dir', 'remove_stale_temporaries', 'replace_dir',
           'save_safetensors', 'save_torch', 'unusable_folder_reason', 'unwritable_file_reason', 'write_json',
           'write_remedy', 'write_text']

_logger = logging.getLogger(__name__)

TMP_DIR_PREFIX = '.tmp-'
_OLD_DIR_PREFIX = '.old-'
_TMP_FILE = re.compile(r'^\..+\.tmp-\d+-[0-9a-f]+$')  # what atomic_path names its temporary files
_RENAME_EXCHANGE = 2  # renameat2 flag (linux/fs.h): swap two existing paths in one step
_AT_FDCWD = -100
# How Rust's std::io::Error shows an operating-system error (safetensors' messages): "Os { code: 28, ..." or
# "... (os error 28)".
_RUST_OS_ERROR = re.compile(r'Os \{ code: (\d+)|\(os error (\d+)\)')


def _temporary_path(path: str) -> str:
    """The hidden name beside ``path`` that :func:`atomic_path` writes to (unique per process and call)."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f'.{name}.tmp-{os.getpid()}-{secrets.token_hex(3)}')


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """A temporary path to write ``path``'s new content to; on success it is flushed and renamed over ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    temporary = _temporary_path(os.path.abspath(path))
    try:
        yield temporary
        _fsync_file(temporary)
        os.replace(temporary, path)
    except BaseException:
        # On a read-only or vanished folder the removal fails as well; the write's own error is the one to report.
        with contextlib.suppress(OSError):
            os.remove(temporary)
        raise
    fsync_dir(folder)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = 'w') -> Iterator[IO]:
    """``open(path, mode)`` for writing (``'w'`` or ``'wb'``) that replaces ``path`` atomically when it closes."""
    if mode not in ('w', 'wb'):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', got {mode!r}")
    text = {} if 'b' in mode else {'encoding': 'utf-8', 'newline': ''}
    with atomic_path(path) as temporary, open(temporary, mode, **text) as f:
        yield f


def unwritable_file_reason(path: str | os.PathLike) -> str | None:
    """Why a file cannot be written at ``path``, or None when a write there would succeed as far as can be told
    beforehand (a disk that fills up later still fails the write itself).

    Folders that do not exist yet count as writable when their nearest existing parent is: the writers here create
    them. The check writes and removes a hidden probe file, so it holds for the user the process runs as (root too).
    """
    path = os.path.abspath(path)
    if os.path.isdir(path):
        return 'it is a folder; name a file in it'
    existing = _nearest_existing(os.path.dirname(path))
    if not os.path.isdir(existing):
        return f'{existing!r} is a file, not a folder'
    try:
        descriptor, probe = tempfile.mkstemp(prefix='.write-check-', dir=existing)
    except OSError as error:
        return f'files cannot be written in {existing!r} ({error.strerror})'
    os.close(descriptor)
    os.remove(probe)
    return None


def unusable_folder_reason(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be (or be made) a folder, or None: a file is there, or where a parent folder should be.
    Permissions and free space are left to the writes themselves."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return 'it is a file'
    existing = _nearest_existing(path)
    return None if os.path.isdir(existing) else f'{existing!r} is a file, not a folder'


def _nearest_existing(path: str) -> str:
    """``path``, or its nearest parent that exists."""
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def write_text(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` atomically."""
    with atomic_open(path) as f:
        f.write(text)


def write_json(path: str | os.PathLike, data: Any, indent: int = 2) -> None:
    """Replace ``path`` with ``data`` as JSON atomically."""
    write_text(path, json.dumps(data, indent=indent) + '\n')


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, as a hex string."""
    with open(path, 'rb') as f:
        return hashlib.file_digest(f, 'sha256').hexdigest()


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding='utf-8') as f:
        return json.load(f)


def save_torch(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` atomically."""
    with atomic_open(path, 'wb') as f:
        torch.save(obj, f)


def save_safetensors(state_dict: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Save tensors as safetensors atomically (CPU copies; tensors sharing storage are cloned), with the permissions
    of every other file written here (safetensors from 0.5 creates its files 0600).

    Raises:
        OSError: The write failed (disk full, permissions): safetensors' own error, with the operating system's code.
    """
    seen: set[int] = set()
    tensors = {}
    for key, tensor in state_dict.items():
        tensor = tensor.detach().to('cpu').contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        tensors[key] = tensor.clone() if pointer in seen else tensor  # safetensors refuses shared storage
        seen.add(pointer)
    with atomic_path(path) as temporary:
        try:
            save_file(tensors, temporary)
        except Exception as error:
            found = os_error_in_chain(error)
            if found is None:
                raise
            raise OSError(found.errno, found.strerror, os.fspath(path)) from error
        os.chmod(temporary, default_file_mode())


def default_file_mode() -> int:
    """The permissions ``open(path, 'w')`` gives a new file: 0o666 less the process's umask."""
    return 0o666 & ~_umask()


def _umask() -> int:
    try:
        with open('/proc/self/status') as f:  # Linux 4.7+: read without changing it
            for line in f:
                if line.startswith('Umask:'):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and put back at once
    os.umask(mask)
    return mask


def os_error_in_chain(error: BaseException) -> OSError | None:
    """The operating system's error behind ``error``: ``error`` itself, one in its cause / context chain, or one that
    a library reports only in its message (safetensors: ``IoError(Os { code: 28, ... })``); None when there is none.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        match = _RUST_OS_ERROR.search(str(current))
        if match:
            code = int(match.group(1) or match.group(2))
            return OSError(code, os.strerror(code))
        current = current.__cause__ or current.__context__
    return None


def write_remedy(error: OSError, elsewhere: str) -> str:
    """What to do about a write the system refused, by its cause: free space or fix the permissions where those are
    the cause, or else ``elsewhere`` (how to write it somewhere else, as the command takes it)."""
    if error.errno == errno.ENOSPC:
        return f'free space there, or {elsewhere}'
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f'fix the permissions, or {elsewhere}'
    return elsewhere


def replace_dir(source: str, target: str) -> None:
    """Flush every file of ``source`` to disk, then make it ``target`` so that ``target`` is at every instant either
    the old folder or the new complete one.

    An existing ``target`` is swapped with ``source`` in one system call (Linux ``renameat2(RENAME_EXCHANGE)``) and
    the old folder deleted after. Where the file system cannot swap, the old folder is renamed to ``.old-<name>``
    first; a process killed between that rename and the next leaves it there, and :func:`remove_stale_temporaries`
    puts it back.
    """
    for folder, _, files in os.walk(source):
        for name in files:
            _fsync_file(os.path.join(folder, name))
        fsync_dir(folder)
    parent = os.path.dirname(os.path.abspath(target))
    if not os.path.lexists(target):
        os.rename(source, target)
    elif _exchange(source, target):
        shutil.rmtree(source, ignore_errors=True)  # now the old folder
    else:
        old = os.path.join(parent, _OLD_DIR_PREFIX + os.path.basename(target))
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
        os.rename(source, target)
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(parent)


def remove_dir(path: str) -> None:
    """Delete the folder ``path`` so that at no instant it exists in part: it is renamed to a temporary name first
    (one system call), then deleted. A process killed while deleting leaves a ``.tmp-`` folder, which
    :func:`remove_stale_temporaries` clears, never a folder that still reads as complete with files missing."""
    parent, name = os.path.split(os.path.abspath(path))
    doomed = os.path.join(parent, f'{TMP_DIR_PREFIX}removed-{name}')
    shutil.rmtree(doomed, ignore_errors=True)  # left by a process killed while removing a folder of that name
    os.rename(path, doomed)
    fsync_dir(parent)
    shutil.rmtree(doomed, ignore_errors=True)


def _exchange(first: str, second: str) -> bool:
    """Swap two existing paths atomically; False where the C library or the file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not Linux, or a C library older than glibc 2.28
        return False
    renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # e.g. NFS, or an old kernel
        return False
    raise OSError(code, os.strerror(code), first, None, second)


def remove_stale_temporaries(folder: str) -> list[str]:
    """Clear what writers killed in ``folder`` left: put back a folder :func:`replace_dir` had moved aside, delete
    ``.tmp-<name>`` folders and :func:`atomic_path` temporary files. Returns the names removed or restored.

    Call it only while no writer is active in ``folder`` (a run's start).
    """
    if not os.path.isdir(folder):
        return []
    cleared = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.startswith(_OLD_DIR_PREFIX) and os.path.isdir(path):
            target = os.path.join(folder, name[len(_OLD_DIR_PREFIX):])
            if os.path.lexists(target):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.rename(path, target)
        elif name.startswith(TMP_DIR_PREFIX) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)  # not a link: rmtree refuses one, and it is left as it is
        elif _TMP_FILE.match(name) and os.path.isfile(path):
            os.remove(path)
        else:
            continue
        if not os.path.lexists(path):  # only what is gone is named as cleared
            cleared.append(name)
    if cleared:
        fsync_dir(folder)
    return cleared


def fsync_dir(path: str) -> None:
    """Flush a folder's entries (renames into it) to disk, where the file system allows it."""
    with contextlib.suppress(OSError):  # some file systems cannot fsync a folder; the rename is still atomic
        _fsync_file(path)


def _fsync_file(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


class JsonLines:
    """A JSON-lines file: one JSON object per line, appended and flushed to disk a batch at a time.

    A process killed during an append (or a full disk) can leave a torn last line; :meth:`read` stops before it and
    says so, and :meth:`rewrite` (which a resumed run calls with the records it keeps) removes it.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        with open(self.path, 'a', encoding='utf-8') as f:
            f.writelines(json.dumps(record) + '\n' for record in records)
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[dict[str, Any]]:
        """The records up to the first line that is not a whole JSON object (a torn write, logged as a warning); []
        when there is no file."""
        if not os.path.isfile(self.path):
            return []
        records = []
        with open(self.path, encoding='utf-8', errors='replace') as f:
            lines = [line for line in f if line.strip()]
        for number, line in enumerate(lines):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if not isinstance(record, dict):
                _logger.warning('%s: line %d is not a whole JSON record (%r); it and the %d line(s) after it are '
                                'dropped', self.path, number + 1, line.strip()[:60], len(lines) - number - 1)
                break
            records.append(record)
        return records

    def rewrite(self, records: Iterable[dict[str, Any]]) -> None:
        """Replace the file with exactly ``records``, atomically."""
        write_text(self.path, ''.join(json.dumps(record) + '\n' for record in records))
