"""Writes that survive a crash: data reaches the disk before a rename makes it visible.

Every file is written under a hidden temporary name beside its target (``.<name>.tmp-<pid>-<random>``, so concurrent
writers never share one; created with the permissions a plain ``open`` gives), flushed to disk, then renamed over the
target, and the folder's entry is flushed as well. A process killed at any instant leaves the old file or the new one,
never a torn one; a write that raises removes its temporary file.
"""
import contextlib
import json
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator
from typing import IO, Any

import torch
from safetensors.torch import save_file

__all__ = ['JsonLines', 'atomic_open', 'atomic_path', 'fsync_dir', 'read_json', 'replace_dir', 'save_safetensors',
           'save_torch', 'write_json', 'write_text']


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """A temporary path to write ``path``'s new content to; on success it is flushed and renamed over ``path``."""
    folder, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(folder, f'.{name}.tmp-{os.getpid()}-{secrets.token_hex(3)}')
    try:
        yield temporary
        _fsync_file(temporary)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
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


def write_text(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` atomically."""
    with atomic_open(path) as f:
        f.write(text)


def write_json(path: str | os.PathLike, data: Any, indent: int = 2) -> None:
    """Replace ``path`` with ``data`` as JSON atomically."""
    write_text(path, json.dumps(data, indent=indent) + '\n')


def read_json(path: str | os.PathLike) -> Any:
    with open(path, encoding='utf-8') as f:
        return json.load(f)


def save_torch(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` atomically."""
    with atomic_open(path, 'wb') as f:
        torch.save(obj, f)


def save_safetensors(state_dict: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Save tensors as safetensors atomically (CPU copies; tensors sharing storage are cloned)."""
    seen: set[int] = set()
    tensors = {}
    for key, tensor in state_dict.items():
        tensor = tensor.detach().to('cpu').contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        tensors[key] = tensor.clone() if pointer in seen else tensor  # safetensors refuses shared storage
        seen.add(pointer)
    with atomic_path(path) as temporary:
        save_file(tensors, temporary)


def replace_dir(source: str, target: str) -> None:
    """Flush every file of ``source`` to disk, then rename it to ``target`` (an existing ``target`` is moved aside
    first and deleted after), so that ``target`` is at every instant either the old folder or the new complete one."""
    for folder, _, files in os.walk(source):
        for name in files:
            _fsync_file(os.path.join(folder, name))
        fsync_dir(folder)
    parent = os.path.dirname(os.path.abspath(target))
    if os.path.exists(target):
        old = os.path.join(parent, f'.old-{os.path.basename(target)}')
        shutil.rmtree(old, ignore_errors=True)
        os.rename(target, old)
        os.rename(source, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(source, target)
    fsync_dir(parent)


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

    A process killed during an append can leave a torn last line; :meth:`read` stops before it, and :meth:`rewrite`
    (which a resumed run calls with the records it keeps) removes it.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)

    def append(self, records: Iterable[dict[str, Any]]) -> None:
        with open(self.path, 'a', encoding='utf-8') as f:
            f.writelines(json.dumps(record) + '\n' for record in records)
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[dict[str, Any]]:
        """The records up to the first line that is not whole JSON (a torn write); [] when there is no file."""
        if not os.path.isfile(self.path):
            return []
        records = []
        with open(self.path, encoding='utf-8') as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    break
        return records

    def rewrite(self, records: Iterable[dict[str, Any]]) -> None:
        """Replace the file with exactly ``records``, atomically."""
        write_text(self.path, ''.join(json.dumps(record) + '\n' for record in records))
