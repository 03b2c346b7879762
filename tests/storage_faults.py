"""Real storage faults for tests: a small tmpfs that fills up, and a folder made read-only.

Mounting needs root (or CAP_SYS_ADMIN); where it is not permitted, the full disk is skipped with the reason, and a
read-only folder is a folder without write permission (which root would ignore, hence the mount for root).
"""
import contextlib
import os
import stat
import subprocess
from collections.abc import Iterator

import pytest


def _mount(*args: str) -> str | None:
    """Run ``mount`` with ``args``; None when it worked, else why not."""
    try:
        result = subprocess.run(['mount', *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    return None if result.returncode == 0 else (result.stderr.strip() or f'mount exited {result.returncode}')


def _unmount(path: str) -> None:
    subprocess.run(['umount', path], capture_output=True, timeout=30, check=False)


@contextlib.contextmanager
def full_disk(path: str, size: str = '256k') -> Iterator[str]:
    """A tmpfs of ``size`` mounted at ``path`` (created): writes there fail with ENOSPC once it is full. Skips the
    test where mounting is not permitted (not root, or a container without CAP_SYS_ADMIN)."""
    os.makedirs(path, exist_ok=True)
    refused = _mount('-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', path)
    if refused:
        pytest.skip(f'a small tmpfs cannot be mounted here to fill up ({refused}); needs root')
    try:
        yield path
    finally:
        _unmount(path)


@contextlib.contextmanager
def read_only(folder: str) -> Iterator[str]:
    """``folder`` read-only while the block runs: a read-only bind mount of it onto itself (EROFS, as a read-only
    file system gives), else, for a user who is not root, its write permission taken away (EACCES)."""
    if _mount('--bind', folder, folder) is None:
        try:
            if _mount('-o', 'remount,bind,ro', folder, folder) is None:
                yield folder
                return
        finally:
            _unmount(folder)
    if os.geteuid() == 0:
        pytest.skip('a folder cannot be made read-only here: mounting is refused and root ignores permissions')
    mode = stat.S_IMODE(os.stat(folder).st_mode)
    os.chmod(folder, mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        yield folder
    finally:
        os.chmod(folder, mode)
