"""The results of a validate.py run: one record per model, printed as a table and written as JSON or CSV.

A record holds the model, checkpoint, evaluation settings, package versions and a ``results`` list with one entry
per data set (see :class:`~lipsformer.evaluation.datasets.DatasetResult`). The JSON file holds the record, or a list of
records when several models were evaluated; the CSV has one row per model and data set. Files are written
atomically, so an interrupted run never leaves a half-written results file over an earlier one.
"""
import csv
import io
import json
import os
import platform
from dataclasses import asdict
from importlib import metadata

from ..utils.io import write_text
from .datasets import DatasetResult

__all__ = ['package_versions', 'model_record', 'format_table', 'write_results']

_PACKAGES = ('lipsformer', 'timm', 'torch', 'torchvision', 'accelerate', 'pillow')
_CSV_RESULT_FIELDS = ('dataset', 'name', 'path', 'images', 'count', 'top1', 'top5', 'images_per_s')
_CSV_SETTING_FIELDS = ('input_size', 'crop_pct', 'crop_mode', 'interpolation', 'amp')


def package_versions() -> dict[str, str]:
    """Versions of Python and of the packages that decide the numbers."""
    versions = {'python': platform.python_version()}
    for package in _PACKAGES:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = 'not installed'
    return versions


def model_record(model_name: str, checkpoint: str | None, settings: dict, results: list[DatasetResult]) -> dict:
    """The JSON record of one evaluated model."""
    return {
        'model': model_name,
        'checkpoint': checkpoint,
        'settings': settings,
        'versions': package_versions(),
        'results': [asdict(result) for result in results],
    }


def _percent(value: float | None) -> str:
    return '-' if value is None else f'{value:.3f}'


def format_table(records: list[dict]) -> str:
    """A plain-text table, one line per model and data set."""
    header = ('model', 'dataset', 'name', 'images', 'count', 'skipped', 'top1', 'top5', 'img/s')
    rows = [header]
    for record in records:
        for r in record['results']:
            rows.append((record['model'], r['dataset'], r['name'], str(r['images']), str(r['count']),
                         str(len(r['skipped'])), _percent(r['top1']), _percent(r['top5']), f'{r["images_per_s"]:.1f}'))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return '\n'.join('  '.join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def _csv_text(records: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(('model', 'checkpoint', 'use_ema', *_CSV_RESULT_FIELDS, 'skipped', *_CSV_SETTING_FIELDS))
    for record in records:
        settings = record['settings']
        for r in record['results']:
            writer.writerow((record['model'], record['checkpoint'] or '', settings.get('use_ema'),
                             *(r[key] for key in _CSV_RESULT_FIELDS), len(r['skipped']),
                             *(settings.get(key) for key in _CSV_SETTING_FIELDS)))
    return buffer.getvalue()


def write_results(path: str | os.PathLike, records: list[dict], results_format: str = 'json') -> None:
    """Write ``records`` to ``path`` as ``json`` or ``csv``, atomically."""
    if results_format == 'json':
        text = json.dumps(records[0] if len(records) == 1 else records, indent=2) + '\n'
    elif results_format == 'csv':
        text = _csv_text(records)
    else:
        raise ValueError(f'unknown results format {results_format!r}; use json or csv')
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_text(path, text)
