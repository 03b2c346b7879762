"""The grid of runs (arm x learning rate x seed): claim each unfinished run in turn, resume or start it."""
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .arms import ARMS
from .data import Subsets
from .runs import RunFiles, claim, release, run_dir
from .trainer import RunSettings, train_run

__all__ = ['run_grid']

_logger = logging.getLogger(__name__)


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
