"""The grid of runs (arm x learning rate x seed): claim each unfinished run in turn, resume or start it.

Each run has its folder ``OUT/<arm>/lr<lr>/seed<seed>/`` (its files: :class:`~.training_run.RunFiles`) and a ``lock``
there, created exclusively by the runner that claims the run and holding its pid, so that several processes can work
on one grid; a lock whose pid is dead is stale and taken over.
"""
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .arms import ARMS
from .subsets import Subsets
from .training_run import RunFiles, RunSettings, train_run

__all__ = ['claim', 'release', 'run_dir', 'run_grid']

_logger = logging.getLogger(__name__)


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


def run_grid(out: Path, arms: Sequence[str], lrs: Sequence[float], seeds: Sequence[int], settings: RunSettings,
             subsets: Subsets, device: torch.device) -> int:
    """Run every unfinished, unclaimed run of the grid; return how many this process finished.

    Runs already done (result.json) are skipped, runs claimed by a live process are left to it, interrupted ones
    resume from their checkpoint. Several processes may work on the same ``out`` at once.
    """
    subsets = subsets.to(device)
    finished = 0
    for arm in arms:
        for lr in lrs:
            for seed in seeds:
                directory = run_dir(out, arm, lr, seed)
                files = RunFiles(directory)
                if files.done() or not claim(directory):
                    continue
                try:
                    if files.done():  # finished by another runner between the check and the claim
                        continue
                    start = time.perf_counter()
                    result = train_run(ARMS[arm], lr, seed, settings, subsets, files, device)
                    finished += 1
                    _logger.info('%s lr %g seed %d: %s in %.0f s', arm, lr, seed, _summary(result),
                                 time.perf_counter() - start)
                finally:
                    release(directory)
    return finished


def _summary(result: dict) -> str:
    if result['diverged']:
        return f'diverged at step {result["diverged_step"]}'
    return f'test accuracy {result["test_accuracy"]:.4f}'
