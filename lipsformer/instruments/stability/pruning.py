"""Pruning the grid: a seed that has failed outright at ``n`` consecutive learning rates of an arm is not run at the
arm's higher rates (``--stop-after-failures n``; 0 runs the full grid).

Failed outright means diverged or finished stuck at chance, the report's own definitions
(:func:`.report.outright_failure`); 'degraded' is relative to the arm's best over all its rates, unknown while the
sweep runs, and does not count. A run left out gets ``not_run.json`` in its folder (its key, the grid's settings and
why: ``n`` and the rates that failed), which ``--collect`` turns into a ``not_run`` line of the results file; the
report shows such runs apart from measured failures and counts each as a failure of its seed for the highest stable
rate. The queue takes each arm's rates in ascending order, so that pruning acts once the lower rates have finished;
with several runners it is opportunistic: a higher rate another runner has already started is finished and reported
as measured.
"""
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ...utils.io import read_json
from .arms import Arm
from .report import outright_failure
from .sweep_results import compact_record
from .training_run import RunFiles, RunSettings

__all__ = ['failed_lower_rates', 'not_run_marker']


def _failed_outright(directory: Path, record: dict[str, Any] | None, settings: RunSettings) -> bool:
    """Whether the run in ``directory`` finished (with the grid's settings) and failed outright; a run with no
    finished folder here is judged by its ``record`` in the results file (None: not measured)."""
    files = RunFiles(directory)
    if not files.done():
        return record is not None and outright_failure(record, settings.as_dict()) is not None
    result = read_json(files.result)
    if result['settings'] != settings.as_dict():  # another sweep's run says nothing about this one
        return False
    return outright_failure(compact_record(result, files.read_steps()), result['settings']) is not None


def failed_lower_rates(runs: Sequence[tuple[float, Path, dict[str, Any] | None]], lr: float, settings: RunSettings,
                       n: int) -> list[float] | None:
    """The first ``n`` consecutive rates below ``lr`` at which one seed of one arm failed outright, or None.

    Args:
        runs: The learning rate, run folder and results-file record (None where it has none) of that arm and seed
            at every rate of the grid.
        lr: The rate about to be run.
        settings: The grid's settings (runs with others do not count).
        n: How many consecutive failures prune the higher rates (0: none do).
    """
    if n <= 0:
        return None
    streak: list[float] = []
    for rate, directory, record in sorted(runs, key=lambda run: run[0]):
        if rate >= lr:
            break
        streak = [*streak, rate] if _failed_outright(directory, record, settings) else []
        if len(streak) == n:
            return streak
    return None


def not_run_marker(arm: Arm, lr: float, seed: int, settings: RunSettings, n: int,
                   failed_at: list[float]) -> dict[str, Any]:
    """What ``not_run.json`` holds for a run left out after its seed failed at the rates ``failed_at``."""
    return {'arm': arm.name, 'lr': lr, 'seed': seed, 'warmup_epochs': arm.warmup_epochs,
            'torch': str(torch.__version__), 'settings': settings.as_dict(),
            'not_run': {'stop_after_failures': n, 'failed_at': failed_at}}
