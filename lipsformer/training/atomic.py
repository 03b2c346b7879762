"""Writes that survive a crash: data flushed to disk before a rename makes it visible."""
import json
import os
import shutil
from typing import Any

import torch
from safetensors.torch import save_file


def save_safetensors(state_dict: dict[str, torch.Tensor], path: str) -> None:
    """Save tensors as safetensors (CPU copies; tensors sharing storage are cloned) and flush them to disk."""
    seen: set[int] = set()
    tensors = {}
    for key, tensor in state_dict.items():
        tensor = tensor.detach().to('cpu').contiguous()
        pointer = tensor.untyped_storage().data_ptr()
        tensors[key] = tensor.clone() if pointer in seen else tensor  # safetensors refuses shared storage
        seen.add(pointer)
    save_file(tensors, path)
    fsync_file(path)


def save_torch(obj: Any, path: str) -> None:
    """``torch.save`` to a file, flushed to disk."""
    with open(path, 'wb') as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_json(path: str, data: Any) -> None:
    """Replace ``path`` with JSON ``data`` atomically (a temporary file, flushed, then renamed)."""
    tmp_path = f'{path}.tmp-{os.getpid()}'
    with open(tmp_path, 'w') as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp_path, path)


def fsync_file(path: str) -> None:
    """Flush a file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    """Flush a folder's entries (renames into it) to disk, where the file system allows it."""
    try:
        fsync_file(path)
    except OSError:  # some file systems cannot fsync a directory; the rename is still atomic
        pass


def replace_dir(source: str, target: str) -> None:
    """Rename ``source`` to ``target``; an existing ``target`` is moved aside first and deleted after."""
    if not os.path.exists(target):
        os.rename(source, target)
        return
    old = f'{os.path.dirname(target)}/.old-{os.path.basename(target)}'
    shutil.rmtree(old, ignore_errors=True)
    os.rename(target, old)
    os.rename(source, target)
    shutil.rmtree(old, ignore_errors=True)
