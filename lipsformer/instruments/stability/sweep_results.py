"""The committed results of a sweep: one compact JSON line per finished run, collected from the run folders.

The file (``results/stability/<dataset>.jsonl``) starts with one line holding the settings every run shared
(``{"settings": ...}``); each further line is one run, keyed by (arm, lr, seed, warmup epochs, torch version), with
what the report needs and nothing else: final and best test accuracy and the accuracy curve, the divergence step,
steps to a smoothed training loss of 0.6, the peak gradient norm, the final bound, the CPU, threads, and seconds (wall
and the process's CPU time).
A run the runner left out because its seed had already failed at consecutive lower rates (its folder holds
``not_run.json``, see :mod:`.pruning`) has a line of its own with the same key and ``not_run`` (why) instead of the
measurements.
Collecting merges: a run folder's record replaces the line of the same key and every other line is kept, so results
of other machines and other torch versions (each collected from its own run folders) are merged into one file; a
measured run is never replaced by a not-run line.
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
           'not_run_record', 'read_results', 'steps_to_loss']

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


def not_run_record(marker: dict[str, Any]) -> dict[str, Any]:
    """The results-file line of a run left out (from its ``not_run.json``): its key and why."""
    return {name: marker[name] for name in ('arm', 'lr', 'seed', 'warmup_epochs', 'torch', 'not_run')}


class Results:
    """The settings line, the run records and the lines of runs left out (``not_run``) of a results file."""

    def __init__(self, settings: dict[str, Any] | None, records: Iterable[dict[str, Any]],
                 not_run: Iterable[dict[str, Any]] = ()) -> None:
        self.settings = settings
        self.records = sorted(records, key=_order)
        self.not_run = sorted(not_run, key=_order)

    @property
    def dataset(self) -> str:
        return self.settings['dataset']

    def torch_versions(self) -> list[str]:
        """Versions by how many runs they have, most first (the report's main tables use the first)."""
        counts: dict[str, int] = {}
        for record in self.records:
            counts[record['torch']] = counts.get(record['torch'], 0) + 1
        return sorted(counts, key=lambda version: (-counts[version], version))

    def measured(self, settings: dict[str, Any], torch_version: str) -> dict[tuple[str, float, int], dict[str, Any]]:
        """The runs measured with ``settings`` under ``torch_version``, by (arm, lr, seed): none where the file holds
        another sweep (other settings), and no run of an arm whose warmup has changed since."""
        if self.settings != settings:
            return {}
        return {(r['arm'], r['lr'], r['seed']): r for r in self.records if r['torch'] == torch_version
                and r['arm'] in ARMS and r['warmup_epochs'] == ARMS[r['arm']].warmup_epochs}

    def write(self, path: Path) -> None:
        JsonLines(path).rewrite([{'settings': self.settings}, *self.records, *self.not_run])


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
    return Results(lines[0]['settings'], [line for line in lines[1:] if 'not_run' not in line],
                   [line for line in lines[1:] if 'not_run' in line])


def collect(out: Path, path: Path) -> tuple[int, int]:
    """Merge the finished runs, and the runs left out, under the grid folder ``out`` into the results file at ``path``.

    Returns:
        How many lines were added and how many replaced a line of the same key.

    Raises:
        ValueError: The runs were trained with other settings than the file's (or than each other): a results file
            holds one sweep.
    """
    results = read_results(path)
    settings = results.settings
    by_key = {key(record): record for record in [*results.records, *results.not_run]}
    added = replaced = 0
    for folder in sorted(p for p in Path(out).glob('torch-*/*/lr*/seed*') if p.is_dir()):
        files = RunFiles(folder)
        if files.done():
            found = read_json(files.result)
        elif files.not_run.exists():
            found = read_json(files.not_run)
        else:
            continue
        if settings is None:
            settings = found['settings']
        elif found['settings'] != settings:
            source = files.result if files.done() else files.not_run
            raise ValueError(f'{source} is of a run with settings {found["settings"]}, {path} holds runs with '
                             f'{settings}: collect it into another results file')
        record = compact_record(found, files.read_steps()) if files.done() else not_run_record(found)
        previous = by_key.get(key(record))
        if previous is None:
            added += 1
        elif 'not_run' in record and 'not_run' not in previous:
            continue  # measured elsewhere (another machine's runs merged into the file): the measurement stays
        else:
            replaced += previous != record
        by_key[key(record)] = record
    if settings is None:
        raise ValueError(f'no finished runs under {out} and no results in {path}')
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Results(settings, [r for r in by_key.values() if 'not_run' not in r],
            [r for r in by_key.values() if 'not_run' in r]).write(path)
    return added, replaced
