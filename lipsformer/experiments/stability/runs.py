"""The files of one run (``OUT/<arm>/lr<lr>/seed<seed>/``) and the lock that lets concurrent runners share a grid.

- ``lock``: created exclusively by the runner that claims the run, holding its pid; a lock whose pid is dead is
  stale and taken over.
- ``config.json``: the run's settings; resuming with different settings is refused.
- ``steps.jsonl``: one JSON record per optimizer step, appended every log interval.
- ``checkpoint.pt``: model, optimizer, scheduler, RNG and step, replaced atomically; deleted when the run finishes.
- ``result.json``: written atomically last; its presence means the run is done.
"""
import itertools
import os
from pathlib import Path
from typing import Any

from ...utils.io import JsonLines

__all__ = ['RunFiles', 'claim', 'release', 'run_dir']


def run_dir(out: Path, arm: str, lr: float, seed: int) -> Path:
    return Path(out) / arm / f'lr{lr:g}' / f'seed{seed}'


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _create_lock(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, 'w') as f:
        f.write(str(os.getpid()))
    return True


def claim(directory: Path) -> bool:
    """Take the run's lock; False if a live process holds it.

    A stale lock (its pid dead, or unreadable) is first renamed to a name of this process's own, which only one
    claimant can do; if what was renamed turns out not to be the stale lock read before (another runner took it
    over in between), it is put back.
    """
    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / 'lock'
    if _create_lock(lock):
        return True
    try:
        holder = lock.read_text()
    except FileNotFoundError:  # released in between
        return _create_lock(lock)
    if holder.isdigit() and _pid_alive(int(holder)):
        return False
    private = directory / f'lock.stale-{os.getpid()}'
    try:
        os.rename(lock, private)
    except FileNotFoundError:  # another runner took it over first
        return False
    if private.read_text() != holder:
        try:
            os.link(private, lock)
        except FileExistsError:
            pass
        private.unlink()
        return False
    private.unlink()
    return _create_lock(lock)


def release(directory: Path) -> None:
    """Remove the run's lock if this process holds it."""
    lock = directory / 'lock'
    try:
        if lock.read_text() == str(os.getpid()):
            lock.unlink()
    except FileNotFoundError:
        pass


class RunFiles:
    """Paths of one run's files and the reading and writing of its step records."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.config = self.directory / 'config.json'
        self.steps = self.directory / 'steps.jsonl'
        self.checkpoint = self.directory / 'checkpoint.pt'
        self.result = self.directory / 'result.json'

    def done(self) -> bool:
        return self.result.exists()

    def append_steps(self, records: list[dict[str, Any]]) -> None:
        JsonLines(self.steps).append(records)

    def read_steps(self) -> list[dict[str, Any]]:
        return JsonLines(self.steps).read()

    def truncate_steps(self, last_step: int) -> None:
        """Keep the records of steps up to ``last_step`` (those a checkpoint covers); drop a torn last line too."""
        steps = JsonLines(self.steps)
        steps.rewrite(itertools.takewhile(lambda record: record['step'] <= last_step, steps.read()))
