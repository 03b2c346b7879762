"""The committed results of a sweep: one compact JSON line per finished run, collected from the run folders.

The file (``results/stability/<dataset>.jsonl``) starts with one line holding the settings every run shared
(``{"settings": ...}``); each further line is one run, keyed by (arm, lr, seed, warmup epochs, torch version), with
what the report needs and nothing else: final and best test accuracy and the accuracy curve, the divergence step,
steps to a smoothed training loss of 0.6, the peak gradient norm, the final bound, the CPU, threads, and seconds (wall
and the process's CPU time).
Collecting merges: a run folder's record replaces the line of the same key and every other line is kept, so results
of other machines and other torch versions (each collected from its own run folders) are merged into one file.
"""
import math
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ...utils.io import JsonLines, read_json
from .arms import ARMS
from .training_run import RunFiles

__all__ = ['LOSS_THRESHOLD', 'SMOOTHING_STEPS', 'Results', 'collect', 'compact_record', 'key', 'moving_average',
           'read_results', 'steps_to_loss']

LOSS_THRESHOLD = 0.6
SMOOTHING_STEPS = 20  # the moving average of the training loss that must fall below LOSS_THRESHOLD

Key = tuple[str, float, int, int, str]


def key(record: dict[str, Any]) -> Key:
    """What identifies a run across machines and torch versions."""
    return record['arm'], record['lr'], record['seed'], record['warmup_epochs'], record['torch']


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to ``window`` values."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def steps_to_loss(steps: list[dict[str, Any]], threshold: float = LOSS_THRESHOLD,
                  window: int = SMOOTHING_STEPS) -> int | None:
    """First step at which the trailing ``window``-step mean training loss is below ``threshold`` (None if never)."""
    finite = [r for r in steps if r.get('loss') is not None]
    smoothed = moving_average([r['loss'] for r in finite], window)
    return next((r['step'] for r, loss in zip(finite, smoothed) if loss < threshold), None)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, digits)


def compact_record(result: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's line of the results file, from its result.json and steps.jsonl."""
    curve = [[step, round(accuracy, 4)] for step, accuracy in result['test_curve']]
    best_step, best = max(curve, key=lambda point: (point[1], -point[0])) if curve else (None, None)
    losses = [r['loss'] for r in steps if r.get('loss') is not None]
    grads = [r['grad_norm'] for r in steps if r.get('grad_norm') is not None]
    final_bound = result.get('final_lipschitz', {}).get('log10_bounded_parts')
    here = result['machine']
    record = {
        'arm': result['arm'], 'lr': result['lr'], 'seed': result['seed'], 'warmup_epochs': result['warmup_epochs'],
        'torch': result['torch'], 'final_accuracy': _round(result.get('test_accuracy'), 4), 'best_accuracy': best,
        'best_step': best_step, 'diverged_step': result['diverged_step'], 'curve': curve,
        'final_train_loss': _round(statistics.mean(losses[-SMOOTHING_STEPS:]), 4) if losses else None,
        'steps_to_loss': steps_to_loss(steps), 'peak_grad_norm': float(f'{max(grads):.4g}') if grads else None,
        'final_log10_bound': _round(final_bound, 2), 'cpu': here['cpu'], 'threads': here['threads'],
        'seconds': round(result['seconds']['total'], 1), 'cpu_seconds': round(result['seconds']['cpu'], 1),
        'finished_at': round(result['finished_at']),
    }
    if 'gpu' in here:
        record['gpu'] = here['gpu']
    if len(result['machines']) > 1:  # resumed elsewhere: say so, the numerics may differ
        record['machines'] = len(result['machines'])
    return record


class Results:
    """The settings line and the run records of a results file."""

    def __init__(self, settings: dict[str, Any] | None, records: Iterable[dict[str, Any]]) -> None:
        self.settings = settings
        self.records = sorted(records, key=_order)

    @property
    def dataset(self) -> str:
        return self.settings['dataset']

    def torch_versions(self) -> list[str]:
        """Versions by how many runs they have, most first (the report's main tables use the first)."""
        counts: dict[str, int] = {}
        for record in self.records:
            counts[record['torch']] = counts.get(record['torch'], 0) + 1
        return sorted(counts, key=lambda version: (-counts[version], version))

    def write(self, path: Path) -> None:
        JsonLines(path).rewrite([{'settings': self.settings}, *self.records])


def _order(record: dict[str, Any]) -> tuple:
    arms = list(ARMS)
    position = arms.index(record['arm']) if record['arm'] in arms else len(arms)
    return record['torch'], position, record['arm'], record['lr'], record['seed'], record['warmup_epochs']


def read_results(path: Path) -> Results:
    """The results file at ``path`` (an empty one when there is no file).

    Raises:
        ValueError: The file does not start with its settings line.
    """
    lines = JsonLines(path).read()
    if not lines:
        return Results(None, [])
    if 'settings' not in lines[0]:
        raise ValueError(f'{path}: the first line must be the settings ({{"settings": ...}}); found {lines[0]}')
    return Results(lines[0]['settings'], lines[1:])


def collect(out: Path, path: Path) -> tuple[int, int]:
    """Merge the finished runs under the grid folder ``out`` into the results file at ``path``.

    Returns:
        How many records were added and how many replaced a record of the same key.

    Raises:
        ValueError: The runs were trained with other settings than the file's (or than each other): a results file
            holds one sweep.
    """
    results = read_results(path)
    settings = results.settings
    by_key = {key(record): record for record in results.records}
    added = replaced = 0
    for result_path in sorted(Path(out).glob('torch-*/*/lr*/seed*/result.json')):
        result = read_json(result_path)
        if settings is None:
            settings = result['settings']
        elif result['settings'] != settings:
            raise ValueError(f'{result_path} was trained with settings {result["settings"]}, {path} holds runs with '
                             f'{settings}: collect it into another results file')
        record = compact_record(result, RunFiles(result_path.parent).read_steps())
        if key(record) in by_key:
            replaced += by_key[key(record)] != record
        else:
            added += 1
        by_key[key(record)] = record
    if settings is None:
        raise ValueError(f'no finished runs under {out} and no results in {path}')
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Results(settings, by_key.values()).write(path)
    return added, replaced
