"""The grid of runs (arm x learning rate x seed): claim each unfinished run in turn, resume or start it.

Each run has its folder ``OUT/torch-<version>/<arm>/lr<lr>/seed<seed>/`` (its files:
:class:`~.training_run.RunFiles`), so that runs of one grid under another torch (the numerics differ) are runs of
their own. A runner claims a run by taking the folder's :class:`~lipsformer.training.run_lock.RunLock` (the lock
train.py takes on its run folder), so that several processes can work on one grid: a run another live runner holds is
left to it, and the lock of a runner that has ended however it ended (a kill -9 included) is taken over.

The queue runs seed 0 of every (learning rate, arm) first, then seed 1, and so on, so that a grid stopped part-way
has one seed of every cell before it has three of any; within a seed it takes the rates in ascending order (every arm
at one rate, then every arm at the next), so that a seed's lower rates of an arm have finished when its higher ones
come up and a seed that has failed at several consecutive rates can be left out of the higher ones (:mod:`.pruning`).
"""
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ...training.run_lock import RunFolderInUseError, RunLock
from ...utils.io import read_json, write_json
from .arms import ARMS
from .pruning import failed_lower_rates, not_run_marker
from .subsets import Subsets
from .sweep_results import Results
from .training_run import RunFiles, RunSettings, train_run

__all__ = ['queue', 'run_dir', 'run_grid']

_logger = logging.getLogger(__name__)


def run_dir(out: Path, arm: str, lr: float, seed: int, torch_version: str | None = None) -> Path:
    """The run's folder (under this process's torch version unless another is given)."""
    return Path(out) / f'torch-{torch_version or torch.__version__}' / arm / f'lr{lr:g}' / f'seed{seed}'


def queue(arms: Sequence[str], lrs: Sequence[float], seeds: Sequence[int]) -> list[tuple[str, float, int]]:
    """The runs in the order they are taken: seed by seed, and within a seed every arm at each learning rate, the
    rates in ascending order."""
    return [(arm, lr, seed) for seed in seeds for lr in sorted(lrs) for arm in arms]


def run_grid(out: Path, arms: Sequence[str], lrs: Sequence[float], seeds: Sequence[int], settings: RunSettings,
             subsets: Subsets, device: torch.device, stop_after_failures: int = 0,
             recorded: Results | None = None) -> int:
    """Run every unfinished, unclaimed run of the grid; return how many this process finished.

    Runs already done (result.json) are skipped, and so are runs that ``recorded`` (the committed results file)
    holds as measured with the same settings under this torch: a grid resumed on another machine or from a fresh
    clone does not train again what is already in the repository. Runs claimed by a live process are left to it,
    interrupted ones resume from their checkpoint. Several processes may work on the same ``out`` at once. With
    ``stop_after_failures`` n > 0, a run whose seed has failed outright at n consecutive lower rates of its arm is left
    out instead (:mod:`.pruning`): its folder gets ``not_run.json``, and a later grid with a larger n (or 0) runs it.
    """
    shape = settings.shape
    if (subsets.in_chans, subsets.num_classes, subsets.img_size) != (shape.in_chans, shape.num_classes,
                                                                     shape.img_size):
        raise ValueError(f'the data has {subsets.in_chans} channel(s), {subsets.num_classes} classes and '
                         f'{subsets.img_size}x{subsets.img_size} images; the model shape expects {shape.in_chans}, '
                         f'{shape.num_classes} and {shape.img_size}x{shape.img_size}')
    if stop_after_failures < 0:
        raise ValueError(f'stop_after_failures must be 0 (run the full grid) or more, got {stop_after_failures}')
    measured = {} if recorded is None else recorded.measured(settings.as_dict(), str(torch.__version__))
    if recorded is not None and recorded.settings is not None:
        _logger.info('the results file holds %d runs of this grid\'s settings under torch %s: they are not trained '
                     'again%s', len(measured), torch.__version__,
                     '' if measured or recorded.settings == settings.as_dict() else ' (it holds another sweep)')
    subsets = subsets.to(device)
    finished = 0
    for arm, lr, seed in queue(arms, lrs, seeds):
        directory = run_dir(out, arm, lr, seed)
        files = RunFiles(directory)
        if files.done() or (arm, lr, seed) in measured:
            continue
        failed_at = failed_lower_rates([(rate, run_dir(out, arm, rate, seed), measured.get((arm, rate, seed)))
                                        for rate in lrs], lr, settings, stop_after_failures)
        marker = None if failed_at is None else not_run_marker(ARMS[arm], lr, seed, settings, stop_after_failures,
                                                               failed_at)
        if marker is not None and files.not_run.exists() and read_json(files.not_run) == marker:
            continue
        lock = RunLock(str(directory))
        try:
            lock.acquire()
        except RunFolderInUseError as busy:
            _logger.info('%s lr %g seed %d: left to the runner that holds it, %s', arm, lr, seed, busy.holder)
            continue
        try:
            if files.done():  # finished by another runner between the check and the claim
                continue
            if marker is not None:
                write_json(files.not_run, marker)
                _logger.info('%s lr %g seed %d: not run, that seed failed at lr %s', arm, lr, seed,
                             ' and '.join(f'{rate:g}' for rate in failed_at))
                continue
            files.not_run.unlink(missing_ok=True)
            start = time.perf_counter()
            result = train_run(ARMS[arm], lr, seed, settings, subsets, files, device)
            finished += 1
            _logger.info('%s lr %g seed %d: %s in %.0f s', arm, lr, seed, _summary(result),
                         time.perf_counter() - start)
        finally:
            lock.release()
    return finished


def _summary(result: dict) -> str:
    best = max((accuracy for _, accuracy in result['test_curve']), default=float('nan'))
    if result['diverged']:
        return f'diverged at step {result["diverged_step"]} (best test accuracy {best:.4f})'
    return f'test accuracy {result["test_accuracy"]:.4f} (best {best:.4f})'
