"""A model card (the Hub's ``README.md``) for an exported model: ``python -m lipsformer.hub card RUN_DIR``.

The card goes into the export folder next to ``config.json`` and ``model.safetensors``, with the run's plots copied
into ``plots/`` beside it, so the folder is complete on its own: upload it as it is, or load it with ``local-dir:``.
It holds a Hub metadata header (library_name timm, license, tags, datasets, metrics), the model with its parameters
and GMACs, the data, the recipe's key config values, the final metrics (raw and EMA), the Lipschitz summary, the
plots, how to load it and the paper's citation. A folder written by ``lipsformer.convert`` has no run: its card says
what the folder alone tells.
"""
import glob
import os
import shutil
from dataclasses import dataclass
from typing import Any

import timm
import torch

from ..complexity import model_complexity
from ..lipschitz.analysis import analyze
from ..training import Config, ConfigError, load_config
from ..utils.io import atomic_path, read_json, write_text

__all__ = ['CITATION', 'CardError', 'ExportFolder', 'find_export', 'render_card', 'write_card']

CARD_FILE = 'README.md'
PLOTS_DIR = 'plots'
CITATION = '''@inproceedings{qi2023lipsformer,
  title     = {LipsFormer: Introducing Lipschitz Continuity to Vision Transformers},
  author    = {Qi, Xianbiao and Wang, Jianan and Chen, Yihao and Shi, Yukai and Zhang, Lei},
  booktitle = {International Conference on Learning Representations (ICLR)},
  year      = {2023},
  url       = {https://arxiv.org/abs/2304.09856}
}'''
# The recipe values a card shows, as (config section, key).
_RECIPE_KEYS = [('model', 'drop_path_rate'), ('train', 'epochs'), ('train', 'batch_size'),
                ('train', 'grad_accum_steps'), ('train', 'mixed_precision'), ('train', 'seed'), ('optimizer', 'name'),
                ('optimizer', 'lr'), ('optimizer', 'lr_base_batch_size'), ('optimizer', 'weight_decay'),
                ('optimizer', 'betas'), ('optimizer', 'clip_grad'), ('scheduler', 'name'),
                ('scheduler', 'warmup_epochs'), ('scheduler', 'min_lr'), ('augment', 'auto_augment'),
                ('augment', 'mixup'), ('augment', 'cutmix'), ('augment', 'label_smoothing'), ('augment', 'reprob'),
                ('ema', 'enabled'), ('ema', 'decay'), ('lipschitz', 'enabled')]


class CardError(ValueError):
    """A folder that is neither a run with an export nor an export."""


@dataclass(frozen=True)
class ExportFolder:
    """An export (a timm model folder) and the training run it came from, if there is one.

    Attributes:
        path: The folder holding ``config.json`` and ``model.safetensors``.
        run_dir: The run folder (with ``config.yaml``) it was exported from, or None.
    """
    path: str
    run_dir: str | None


def find_export(target: str, which: str = 'best') -> ExportFolder:
    """The export a ``RUN_DIR`` or ``EXPORT`` argument means: a run's ``export/<which>`` (else the other one), or the
    folder itself when it holds ``config.json``.

    Raises:
        CardError: Neither.
    """
    target = os.path.abspath(target)
    if os.path.isfile(os.path.join(target, 'config.json')):
        run_dir = os.path.dirname(os.path.dirname(target))
        has_run = os.path.basename(os.path.dirname(target)) == 'export' and os.path.isfile(
            os.path.join(run_dir, 'config.yaml'))
        return ExportFolder(target, run_dir if has_run else None)
    for choice in (which, 'last' if which == 'best' else 'best'):
        folder = os.path.join(target, 'export', choice)
        if os.path.isfile(os.path.join(folder, 'config.json')):
            return ExportFolder(folder, target)
    raise CardError(f'{target!r} is neither a training run with export/{which} (or export/last) nor a timm model '
                    f'folder with config.json; finish a run (or python -m lipsformer.convert) first')


def _run_facts(run_dir: str) -> tuple[Config, dict[str, Any]]:
    try:
        config = load_config(os.path.join(run_dir, 'config.yaml'))
    except ConfigError as e:
        raise CardError(f'cannot read the run config of {run_dir!r}: {e}') from e
    summary_path = os.path.join(run_dir, 'summary.json')
    return config, read_json(summary_path) if os.path.isfile(summary_path) else {}


def _lipschitz_summary(folder: str) -> dict[str, Any] | None:
    """Bounds (no empirical estimates) of the exported weights; None for a model the analysis does not know."""
    model = timm.create_model(f'local-dir:{folder}', pretrained=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many small power iterations: one thread is much faster than all on a busy CPU
    try:
        report = analyze(model, empirical=False)
    except (AttributeError, TypeError, ValueError):  # not a LipsFormer
        return None
    finally:
        torch.set_num_threads(threads)
    return dict(product_bound=report['product_bound'], exp_kappa_bound=report['exp_kappa_bound'],
                kappa=report['kappa'], sum_alpha=report['sum_alpha'], unbounded=len(report['unbounded']),
                branches=len(report['branches']))


def _copy_plots(run_dir: str, folder: str) -> list[str]:
    """Copy the run's PNGs into ``<export>/plots``; returns their paths relative to the export."""
    copied = []
    for source in sorted(glob.glob(os.path.join(run_dir, PLOTS_DIR, '*.png'))):
        os.makedirs(os.path.join(folder, PLOTS_DIR), exist_ok=True)
        relative = f'{PLOTS_DIR}/{os.path.basename(source)}'
        with atomic_path(os.path.join(folder, relative)) as temporary:
            shutil.copyfile(source, temporary)
        copied.append(relative)
    return copied


def _number(value: Any, digits: int = 4) -> str:
    if isinstance(value, float):
        return 'unbounded' if value == float('inf') else f'{value:.{digits}g}'
    return str(value)


def _dataset_id(config: Config) -> str:
    """The data set's name as the run knew it: a Hub id for hfds/hfids, the torchvision name, or the folder."""
    kind, _, name = config.data.dataset.partition('/')
    if name:
        return name
    return os.path.basename(os.path.normpath(config.data.data_dir or '')) or 'image-folder'


def _header(config: Config | None, model_name: str) -> list[str]:
    tags = ['image-classification', 'timm', 'lipsformer', 'vision-transformer', 'lipschitz',
            model_name.split('_')[1] if model_name.startswith('lipsformer_') else model_name]
    lines = ['---', 'library_name: timm', 'license: apache-2.0', 'pipeline_tag: image-classification', 'tags:']
    lines += [f'- {tag}' for tag in dict.fromkeys(tags)]
    if config is not None:
        lines += ['datasets:', f'- {_dataset_id(config)}']
    return lines + ['metrics:', '- accuracy', '---', '']


def _model_section(config_json: dict[str, Any], complexity: dict[str, Any]) -> list[str]:
    cfg = config_json['pretrained_cfg']
    size = 'x'.join(str(s) for s in cfg['input_size'])
    args = ', '.join(f'{k}={v}' for k, v in config_json.get('model_args', {}).items())
    return ['## Model', '',
            f'- architecture: `{config_json["architecture"]}` ({args})',
            f'- parameters: {complexity["params"] / 1e6:.2f}M; {complexity["gmacs"]:.3g} GMACs per image at {size} '
            f'(multiply-accumulates, attention matmuls included; `python -m lipsformer.complexity`)',
            f'- classes: {config_json["num_classes"]}' + (' (names in `config.json` `label_names`)'
                                                          if config_json.get('label_names') else ''),
            f'- preprocessing: input {size}, {cfg.get("interpolation")} interpolation, crop_pct {cfg.get("crop_pct")}, '
            f'mean {cfg.get("mean")}, std {cfg.get("std")}', '']


def _training_sections(config: Config, summary: dict[str, Any]) -> list[str]:
    data = config.data
    lines = ['## Data', '', f'- data set: `{data.dataset or "image folder"}`'
             + (f' from `{os.path.basename(os.path.normpath(data.data_dir))}`' if data.data_dir else ''),
             f'- training split `{data.train_split}`, evaluation split `{data.val_split}`', '',
             '## Recipe', '', f'`lipsformer` train.py, model `{config.model.name}`; the full config is the run\'s '
             '`config.yaml`.', '', '| key | value |', '|---|---|']
    lines += [f'| {section}.{key} | {getattr(getattr(config, section), key)} |' for section, key in _RECIPE_KEYS]
    final = summary.get('final_metrics', {})
    lines += ['', '## Results', '', f'Run status: {summary.get("status", "unknown")} after '
              f'{summary.get("epochs_done", "?")} epochs. Final epoch on `{data.val_split}`:', '',
              '| weights | file | top-1 (%) | top-5 (%) | loss |', '|---|---|---:|---:|---:|']
    for label, prefix, file in (('raw', 'val', 'model.safetensors'), ('EMA', 'ema_val', 'model_ema.safetensors')):
        if f'{prefix}_top1' in final:
            lines.append(f'| {label} | `{file}` | {final[f"{prefix}_top1"]:.2f} | {final.get(f"{prefix}_top5", 0):.2f} '
                         f'| {final.get(f"{prefix}_loss", float("nan")):.4f} |')
    if summary.get('best_value') is not None:
        lines += ['', f'Best {summary["best_metric"]}: {summary["best_value"]:.2f} at epoch {summary["best_epoch"]}.']
    return lines + ['']


def _lipschitz_section(lipschitz: dict[str, Any] | None, final: dict[str, Any]) -> list[str]:
    lines = ['## Lipschitz summary', '']
    if lipschitz:
        lines += [f'Bounds of these weights from their parts (`python -m lipsformer.lipschitz`, no empirical '
                  f'estimates): Theorem 2 product bound {_number(lipschitz["product_bound"])}, exp(kappa * sum alpha) '
                  f'form {_number(lipschitz["exp_kappa_bound"])} (kappa {_number(lipschitz["kappa"])}, sum alpha '
                  f'{_number(lipschitz["sum_alpha"])}) over {lipschitz["branches"]} weighted residual branches'
                  + (f', {lipschitz["unbounded"]} of whose parts have no bound (the authors\' attention with '
                     f'unnormalised v)' if lipschitz['unbounded'] else '') + '.']
    alphas = sorted(k[:-len('/mean')] for k in final if k.startswith('alpha/') and k.endswith('/mean'))
    if alphas:
        lines += ['', 'Residual weights alpha at the end of training (mean ± std per stage): ' + ', '.join(
            f'{k.split("/")[1]} {final[f"{k}/mean"]:.3f} ± {final.get(f"{k}/std", 0):.3f}' for k in alphas) + '.']
    return lines + [''] if len(lines) > 2 else []


def _usage_section(repo_id: str | None, has_ema: bool) -> list[str]:
    hub_name = f'hf-hub:{repo_id}' if repo_id else 'hf-hub:USER/REPO'
    lines = ['## How to use', '', '```python', 'import timm', 'import lipsformer  # registers the LipsFormer models',
             '', f"model = timm.create_model('{hub_name}', pretrained=True).eval()",
             "# or from a copy of this folder", "model = timm.create_model('local-dir:path/to/this/folder', "
             "pretrained=True).eval()", '', '# preprocessing as trained',
             'config = timm.data.resolve_data_config(model=model)',
             'transform = timm.data.create_transform(**config)', '```', '',
             'A new classifier for another class count: add `num_classes=N`; timm then leaves the classifier at its '
             'initialisation and loads every other weight. The same names work as `model.name` in `train.py` '
             '(with `model.pretrained: true`), as `--model` in `validate.py` and `python -m lipsformer.lipschitz`.']
    if has_ema:
        lines += ['', 'The EMA weights are in `model_ema.safetensors`: `validate.py --checkpoint FOLDER --use-ema`, or '
                  '`lipsformer.checkpoint.load_model_weights(model, \'model_ema.safetensors\')`.']
    return lines + ['']


def render_card(export: ExportFolder, repo_id: str | None = None, lipschitz: bool = True) -> str:
    """The card's Markdown text (plots must already be in the export: see :func:`write_card`)."""
    config_json = read_json(os.path.join(export.path, 'config.json'))
    config, summary = _run_facts(export.run_dir) if export.run_dir else (None, {})
    size = tuple(config_json['pretrained_cfg']['input_size'][1:])
    complexity = model_complexity(f'local-dir:{export.path}', img_size=size)
    name = config_json['architecture']
    title = repo_id.split('/')[-1] if repo_id else name
    lines = _header(config, name) + [f'# {title}', '',
                                     f'A LipsFormer image classifier (`{name}`) for timm, written by the `lipsformer` '
                                     f'package: LipsFormer (Qi et al., ICLR 2023, [arXiv:2304.09856]'
                                     f'(https://arxiv.org/abs/2304.09856); the authors\' code: '
                                     f'[IDEA-Research/LipsFormer](https://github.com/IDEA-Research/LipsFormer)).', '']
    lines += _model_section(config_json, complexity)
    if config is not None:
        lines += _training_sections(config, summary)
    else:
        lines += ['No training run beside this folder: data, recipe and metrics were not recorded with it.', '']
    lines += _lipschitz_section(_lipschitz_summary(export.path) if lipschitz else None,
                                summary.get('final_metrics', {}))
    plots = sorted(glob.glob(os.path.join(export.path, PLOTS_DIR, '*.png')))
    if plots:
        lines += ['## Plots', ''] + [f'![{os.path.splitext(os.path.basename(p))[0]}]({PLOTS_DIR}/'
                                     f'{os.path.basename(p)})' for p in plots] + ['']
    has_ema = os.path.isfile(os.path.join(export.path, 'model_ema.safetensors'))
    lines += _usage_section(repo_id, has_ema) + ['## Citation', '', '```bibtex', CITATION, '```', '']
    return '\n'.join(lines)


def write_card(target: str | ExportFolder, repo_id: str | None = None, which: str = 'best',
               lipschitz: bool = True) -> str:
    """Write ``README.md`` (and the run's plots) into the export ``target`` means; returns the card's path.

    Args:
        target: A training run folder or an export / model folder (or one :func:`find_export` found).
        repo_id: The Hub repository the card's loading example names (``USER/REPO`` when None).
        which: The run's export to describe: ``best`` or ``last``.
        lipschitz: Compute the Lipschitz bounds of the weights (seconds for a full-size model).
    """
    export = target if isinstance(target, ExportFolder) else find_export(target, which)
    if export.run_dir:
        _copy_plots(export.run_dir, export.path)
    path = os.path.join(export.path, CARD_FILE)
    write_text(path, render_card(export, repo_id, lipschitz))
    return path
