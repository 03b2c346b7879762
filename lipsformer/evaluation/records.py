"""The results of a validate.py run: one record per model, printed as a table and written as JSON or CSV.

A record holds the model, checkpoint (its path and the SHA-256 of its bytes, which bind the scores to the weights
wherever the file is moved or copied), evaluation settings, package versions and a ``results`` list with one entry
per data set (see :class:`~lipsformer.evaluation.dataset_passes.DatasetResult`), each with timm validate.py's columns
too: ``top1``, ``top1_err``, ``top5``, ``top5_err``, ``param_count`` (millions), ``img_size``, ``crop_pct`` and
``interpolation``. The JSON file holds the record, or a list of
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

from ..utils.io import file_sha256, write_text
from .dataset_passes import DatasetResult

__all__ = ['model_record', 'package_versions', 'results_table', 'write_results']

_PACKAGES = ('lipsformer', 'timm', 'torch', 'torchvision', 'accelerate', 'pillow')
_CSV_RESULT_FIELDS = ('dataset', 'name', 'path', 'images', 'count', 'classes', 'num_classes', 'top1', 'top5',
                      'images_per_s', 'top1_err', 'top5_err', 'param_count', 'img_size')
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


def model_record(model_name: str, checkpoint: str | None, settings: dict, results: list[DatasetResult],
                 param_count: int) -> dict:
    """The JSON record of one evaluated model; ``checkpoint`` is its weights file (None: timm's pretrained weights),
    ``param_count`` its number of parameters."""
    millions = round(param_count / 1e6, 2)  # as timm's validate.py reports it
    return {
        'model': model_name,
        'checkpoint': checkpoint,
        'checkpoint_sha256': file_sha256(checkpoint) if checkpoint else None,
        'param_count': millions,
        'settings': settings,
        'versions': package_versions(),
        'results': [dict(asdict(result), **_timm_columns(result, settings, millions)) for result in results],
    }


def _timm_columns(result: DatasetResult, settings: dict, param_count: float) -> dict:
    """timm validate.py's result columns that a :class:`DatasetResult` does not hold."""
    def error(value: float | None) -> float | None:
        return None if value is None else round(100 - value, 4)
    return {'top1_err': error(result.top1), 'top5_err': error(result.top5), 'param_count': param_count,
            'img_size': settings['input_size'][-1], 'crop_pct': settings['crop_pct'],
            'interpolation': settings['interpolation']}


def _percent(value: float | None) -> str:
    return '-' if value is None else f'{value:.3f}'


def results_table(records: list[dict]) -> str:
    """A plain-text table, one line per model and data set."""
    header = ('model', 'dataset', 'name', 'images', 'count', 'skipped', 'classes', 'top1', 'top5', 'img/s')
    rows = [header]
    for record in records:
        for r in record['results']:
            rows.append((record['model'], r['dataset'], r['name'], str(r['images']), str(r['count']),
                         str(len(r['skipped'])), f'{r["classes"]}/{r["num_classes"]}', _percent(r['top1']),
                         _percent(r['top5']), f'{r["images_per_s"]:.1f}'))
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
