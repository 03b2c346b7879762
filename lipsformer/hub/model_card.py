"""A model card (the Hub's ``README.md``) for an exported model: ``python -m lipsformer.hub card RUN_DIR``.

The card goes into the export folder next to ``config.json`` and ``model.safetensors``, with the run's plots copied
into ``plots/`` beside it, so the folder is complete on its own: upload it as it is, or load it with ``local-dir:``.
It holds a Hub metadata header (library_name timm, license, tags, the data sets' Hub ids, metrics and a
``model-index`` with the top-1 / top-5 accuracy of each evaluated data set, which the Hub shows as its results
widget), the model with its parameters and GMACs, the data, the recipe's key config values, the exported epoch's
metrics (raw and EMA), the Lipschitz summary, the plots, how to run it with timm and with transformers, and the
paper's citation. Scores of ``validate.py --results-file`` runs on the exported weights (ImageNet val, ReaL, V2, any
data set) are added with ``--results``. A folder written by ``lipsformer.hub.convert`` has no run: its card says what
the folder alone tells.
"""
import glob
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

import timm
import torch
from huggingface_hub import EvalResult, ModelCardData
from timm.data import ImageNetInfo

from ..instruments.complexity import model_complexity
from ..lipschitz.analysis import analyze
from ..training import Config, ConfigError, load_config
from ..training.run_files import METRICS_FILE, PLOTS_DIR
from ..utils.io import JsonLines, atomic_path, file_sha256, read_json, write_text
from ..weights.weight_files import CheckpointError, check_state_dict, load_file, load_model_weights

__all__ = ['CITATION', 'Card', 'CardError', 'ExportFolder', 'build_card', 'find_export', 'hub_dataset', 'render_card',
           'save_card', 'write_card']

CARD_FILE = 'README.md'
WEIGHTS_FILE, EMA_WEIGHTS_FILE = 'model.safetensors', 'model_ema.safetensors'
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

# Hugging Face Hub ids (and names) of the data sets that runs (torch/<name>, hfds/<name>) and validate.py (imagenet,
# imagenet-real, imagenet-v2) know by other names. ReaL relabels ImageNet's validation images.
_HUB_DATASETS = {
    'imagenet': ('ILSVRC/imagenet-1k', 'ImageNet-1k'), 'imagenet-1k': ('ILSVRC/imagenet-1k', 'ImageNet-1k'),
    'imagenet-real': ('ILSVRC/imagenet-1k', 'ImageNet-ReaL'), 'imagenet-v2': ('vaishaal/ImageNetV2', 'ImageNet-V2'),
    'cifar10': ('uoft-cs/cifar10', 'CIFAR-10'), 'cifar100': ('uoft-cs/cifar100', 'CIFAR-100'),
    'mnist': ('ylecun/mnist', 'MNIST'), 'fashion_mnist': ('zalando-datasets/fashion_mnist', 'Fashion-MNIST'),
    'food101': ('ethz/food101', 'Food-101'), 'svhn': ('ufldl-stanford/svhn', 'SVHN'),
}
# A data set without a Hub id (an image folder) is described in the model-index as the Hub's generic image folder.
IMAGE_FOLDER = 'imagefolder'


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


@dataclass(frozen=True)
class Card:
    """A model card ready to be written or uploaded.

    Attributes:
        text: ``README.md``'s Markdown, metadata header included.
        plots: The run's plots it shows: path inside the export (``plots/loss.png``) -> the file to copy there.
    """
    text: str
    plots: dict[str, str] = field(default_factory=dict)


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
                    f'folder with config.json; finish a run (or python -m lipsformer.hub.convert) first')


def _run_facts(run_dir: str) -> tuple[Config, dict[str, Any]]:
    try:
        config = load_config(os.path.join(run_dir, 'config.yaml'))
    except ConfigError as e:
        raise CardError(f'cannot read the run config of {run_dir!r}: {e}') from e
    summary_path = os.path.join(run_dir, 'summary.json')
    return config, read_json(summary_path) if os.path.isfile(summary_path) else {}


def _exported_model(folder: str) -> torch.nn.Module:
    """The export's network with its weights, every weight file of the folder checked against it: a card describes
    weights that load, so one that cannot be read (truncated, mis-shaped) is refused before anything is written.

    Raises:
        CardError: ``model.safetensors`` (or ``model_ema.safetensors``) cannot be read or does not fit the
            architecture ``config.json`` names.
    """
    try:
        model = timm.create_model(f'local-dir:{folder}', pretrained=False)
    except (RuntimeError, TypeError, ValueError, KeyError) as e:
        raise CardError(f'the model {os.path.join(folder, "config.json")!r} describes cannot be built ({e}); no card '
                        f'was written. Export the run again, or convert the weights (python -m lipsformer.hub.convert)'
                        ) from e
    for name in (WEIGHTS_FILE, EMA_WEIGHTS_FILE):
        path = os.path.join(folder, name)
        if name == EMA_WEIGHTS_FILE and not os.path.isfile(path):
            continue
        try:
            if name == EMA_WEIGHTS_FILE:
                check_state_dict(model, load_file(path), source=path)
            else:
                load_model_weights(model, path)
        except (CheckpointError, FileNotFoundError) as e:
            raise CardError(f'the export\'s weights cannot be read, so no card was written: {e}') from e
    return model


def _lipschitz_summary(model: torch.nn.Module) -> dict[str, Any] | None:
    """Bounds (no empirical estimates) of the exported weights; None for a model the analysis does not know."""
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


def _run_plots(export: ExportFolder) -> dict[str, str]:
    """The plots a card shows: the run's PNGs (copied into ``<export>/plots``), else those already there."""
    sources = glob.glob(os.path.join(export.run_dir, PLOTS_DIR, '*.png')) if export.run_dir else []
    sources = sources or glob.glob(os.path.join(export.path, PLOTS_DIR, '*.png'))
    return {f'{PLOTS_DIR}/{os.path.basename(source)}': source for source in sorted(sources)}


def _number(value: Any, digits: int = 4) -> str:
    if isinstance(value, float):
        return 'unbounded' if value == float('inf') else f'{value:.{digits}g}'
    return str(value)


def _plural(count: int, singular: str, plural: str | None = None) -> str:
    return f'{count} {singular if count == 1 else plural or singular + "s"}'


def hub_dataset(name: str, label_names: list[str] | None = None) -> tuple[str | None, str]:
    """A data set's Hugging Face Hub id (None where it has none) and its name, from the name a run or validate.py
    gives it: ``torch/fashion_mnist``, ``hfds/<id>``, ``imagenet-real``, or ``''`` (an image folder, which is
    ImageNet-1k when its classes are the 1000 ImageNet synsets)."""
    kind, _, rest = name.partition('/')
    if kind.lower() in ('hfds', 'hfids'):
        return _HUB_DATASETS.get(rest.lower(), (rest, rest)) if '/' not in rest else (rest, rest.split('/')[-1])
    key = (rest or kind).lower()
    if key in _HUB_DATASETS:
        return _HUB_DATASETS[key]
    if label_names and list(label_names) == list(ImageNetInfo('imagenet-1k').label_names()):
        return _HUB_DATASETS['imagenet']
    return None, rest or kind


def _run_dataset(config: Config, label_names: list[str] | None) -> tuple[str | None, str]:
    hub_id, name = hub_dataset(config.data.dataset, label_names)
    if hub_id is None and not config.data.dataset:
        name = os.path.basename(os.path.normpath(config.data.data_dir or '')) or IMAGE_FOLDER
    return hub_id, name


@dataclass(frozen=True)
class _Score:
    """One evaluated data set of the card: top-1 and top-5 accuracy (%) of ``model.safetensors`` on it."""
    hub_id: str | None
    name: str
    split: str
    top1: float
    top5: float | None
    source: str


def _eval_results(title: str, scores: list[_Score]) -> list[EvalResult]:
    results = []
    for score in scores:
        for metric, value in (('Top-1 accuracy', score.top1), ('Top-5 accuracy', score.top5)):
            if value is not None:
                results.append(EvalResult(
                    task_type='image-classification', task_name='Image Classification',
                    dataset_type=score.hub_id or IMAGE_FOLDER, dataset_name=score.name, dataset_split=score.split,
                    metric_type='accuracy', metric_name=metric, metric_value=round(float(value), 3)))
    return results


def _header(model_name: str, title: str, scores: list[_Score], datasets: list[str]) -> list[str]:
    tags = ['image-classification', 'timm', 'lipsformer', 'vision-transformer', 'lipschitz',
            model_name.split('_')[1] if model_name.startswith('lipsformer_') else model_name]
    data = ModelCardData(library_name='timm', license='apache-2.0', pipeline_tag='image-classification',
                         tags=list(dict.fromkeys(tags)), datasets=list(dict.fromkeys(datasets)) or None,
                         metrics=['accuracy'], model_name=title, eval_results=_eval_results(title, scores) or None)
    return ['---', data.to_yaml().strip(), '---', '']


def _model_section(config_json: dict[str, Any], complexity: dict[str, Any]) -> list[str]:
    cfg = config_json['pretrained_cfg']
    size = 'x'.join(str(s) for s in cfg['input_size'])
    args = ', '.join(f'{k}={v}' for k, v in config_json.get('model_args', {}).items())
    return ['## Model', '',
            f'- architecture: `{config_json["architecture"]}` ({args})',
            f'- parameters: {complexity["params"] / 1e6:.2f}M; {complexity["gmacs"]:.3g} GMACs per image at {size} '
            f'(multiply-accumulates, attention matmuls included; `python -m lipsformer.instruments.complexity`)',
            f'- classes: {config_json["num_classes"]}' + (' (names in `config.json` `label_names`)'
                                                          if config_json.get('label_names') else ''),
            f'- preprocessing: input {size}, {cfg.get("interpolation")} interpolation, crop_pct {cfg.get("crop_pct")}, '
            f'mean {cfg.get("mean")}, std {cfg.get("std")}', '']


def _exported_epoch(export: ExportFolder, summary: dict[str, Any]) -> dict[str, Any]:
    """The metrics line of the epoch whose weights the export holds: the best one for ``export/best``, the last one
    for ``export/last`` (from the run's metrics.jsonl; the summary's final line when that is all there is)."""
    final = summary.get('final_metrics', {})
    path = os.path.join(export.run_dir, METRICS_FILE)
    if os.path.basename(export.path) != 'best' or summary.get('best_epoch') is None or not os.path.isfile(path):
        return final
    lines = [line for line in JsonLines(path).read() if line.get('epoch') == summary['best_epoch']]
    return next((line for line in lines if 'val_top1' in line), final)


def _run_score(config: Config, epoch: dict[str, Any], label_names: list[str] | None) -> _Score | None:
    if 'val_top1' not in epoch:
        return None
    hub_id, name = _run_dataset(config, label_names)
    return _Score(hub_id, name, config.data.val_split, epoch['val_top1'], epoch.get('val_top5'),
                  f'the run\'s evaluation after epoch {epoch.get("epoch", "?")}')


def _training_sections(config: Config, summary: dict[str, Any], epoch: dict[str, Any],
                       which: str | None) -> list[str]:
    data = config.data
    lines = ['## Data', '', f'- data set: `{data.dataset or "image folder"}`'
             + (f' from `{os.path.basename(os.path.normpath(data.data_dir))}`' if data.data_dir else ''),
             f'- training split `{data.train_split}`, evaluation split `{data.val_split}`', '',
             '## Recipe', '', f'`lipsformer` train.py, model `{config.model.name}`; the full config is the run\'s '
             '`config.yaml`.', '', '| key | value |', '|---|---|']
    lines += [f'| {section}.{key} | {getattr(getattr(config, section), key)} |' for section, key in _RECIPE_KEYS]
    epochs = summary.get('epochs_done')
    which = f'the {which} epoch of the run' if which in ('best', 'last') else 'the exported epoch'
    lines += ['', '## Results', '', f'Run status: {summary.get("status", "unknown")} after '
              f'{_plural(epochs, "epoch") if isinstance(epochs, int) else "? epochs"}. These weights are from epoch '
              f'{epoch.get("epoch", "?")} ({which}), on `{data.val_split}`:', '',
              '| weights | file | top-1 (%) | top-5 (%) | loss |', '|---|---|---:|---:|---:|']
    for label, prefix, file in (('raw', 'val', 'model.safetensors'), ('EMA', 'ema_val', 'model_ema.safetensors')):
        if f'{prefix}_top1' in epoch:
            lines.append(f'| {label} | `{file}` | {epoch[f"{prefix}_top1"]:.2f} | {epoch.get(f"{prefix}_top5", 0):.2f} '
                         f'| {epoch.get(f"{prefix}_loss", float("nan")):.4f} |')
    if summary.get('best_value') is not None:
        lines += ['', f'Best {summary["best_metric"]}: {summary["best_value"]:.2f} at epoch {summary["best_epoch"]}.']
    return lines + ['']


def _validate_scores(path: str, export: ExportFolder, label_names: list[str] | None) -> list[_Score]:
    """The data sets a ``validate.py --results-file`` JSON scored with this export's ``model.safetensors``.

    Raises:
        CardError: The file is not such a results file, or it scored other weights.
    """
    try:
        records = read_json(path)
    except (OSError, ValueError) as e:
        raise CardError(f'cannot read the results file {path!r}: {e}') from e
    records = records if isinstance(records, list) else [records]
    weights = os.path.realpath(os.path.join(export.path, 'model.safetensors'))
    weights_sha256 = None
    scores = []
    for record in records:
        if not isinstance(record, dict) or 'results' not in record:
            raise CardError(f'{path!r} is not a validate.py --results-file JSON (no "results" in it)')
        checkpoint, scored_sha256 = record.get('checkpoint'), record.get('checkpoint_sha256')
        ema = record.get('settings', {}).get('use_ema')
        if scored_sha256 is not None:  # bound by content: a moved or copied run folder keeps its scores
            weights_sha256 = weights_sha256 or file_sha256(weights)
            same_weights = scored_sha256 == weights_sha256
        else:  # a results file of an older validate.py names the weights by path only
            same_weights = checkpoint is not None and os.path.realpath(checkpoint) == weights
        if not same_weights or ema:
            scored = f'{checkpoint or record.get("model")}' + (f' (sha256 {scored_sha256})' if scored_sha256 else '')
            unhashed = '' if scored_sha256 or ema else (' as far as its path tells: it records no sha256 of the '
                                                        'weights it scored (an older validate.py)')
            raise CardError(f'{path!r} scores {scored}' + (' (EMA)' if ema else '')
                            + f', not this export\'s model.safetensors ({weights}'
                            + (f', sha256 {weights_sha256}' if weights_sha256 else '') + f'){unhashed}; score it with '
                              f'validate.py --checkpoint {export.path} --results-file FILE')
        for result in record['results']:
            name = result['dataset'] if result['dataset'] != 'imagefolder' else ''
            hub_id, title = hub_dataset(name, label_names)
            if hub_id is None:
                title = result.get('name') or title or IMAGE_FOLDER
            split = 'validation' if result['dataset'].startswith('imagenet') else result.get('name') or 'validation'
            scores.append(_Score(hub_id, title, split, result['top1'], result.get('top5'),
                                 f'validate.py on {result["count"]} images of {result["path"]}'))
    return scores


def _results_section(scores: list[_Score]) -> list[str]:
    lines = ['## Evaluations', '', 'The Hub\'s results widget shows these (the `model-index` above), for '
             '`model.safetensors`:', '', '| data set | Hub id | split | top-1 (%) | top-5 (%) | from |',
             '|---|---|---|---:|---:|---|']
    lines += [f'| {s.name} | {s.hub_id or "-"} | {s.split} | {s.top1:.2f} | '
              f'{"-" if s.top5 is None else f"{s.top5:.2f}"} | {s.source} |' for s in scores]
    return lines + ['']


def _lipschitz_section(lipschitz: dict[str, Any] | None, final: dict[str, Any]) -> list[str]:
    """The bounds of the exported weights and their alphas (``final``: the metrics line of their epoch)."""
    lines = ['## Lipschitz summary', '']
    if lipschitz:
        lines += [f'Bounds of these weights from their parts (`python -m lipsformer.lipschitz`, no empirical '
                  f'estimates): Theorem 2 product bound {_number(lipschitz["product_bound"])}, exp(kappa * sum alpha) '
                  f'form {_number(lipschitz["exp_kappa_bound"])} (kappa {_number(lipschitz["kappa"])}, sum alpha '
                  f'{_number(lipschitz["sum_alpha"])}) over '
                  f'{_plural(lipschitz["branches"], "weighted residual branch", "weighted residual branches")}'
                  + (f', {lipschitz["unbounded"]} of whose parts {"has" if lipschitz["unbounded"] == 1 else "have"} '
                     f'no bound (the authors\' attention with unnormalised v)' if lipschitz['unbounded'] else '') + '.']
    alphas = sorted(k[:-len('/mean')] for k in final if k.startswith('alpha/') and k.endswith('/mean'))
    if alphas:
        lines += ['', 'Residual weights alpha of these weights (mean ± std per stage): ' + ', '.join(
            f'{k.split("/")[1]} {final[f"{k}/mean"]:.3f} ± {final.get(f"{k}/std", 0):.3f}' for k in alphas) + '.']
    return lines + [''] if len(lines) > 2 else []


# Why transformers' image-classification pipeline cannot feed a model that is not RGB (checked by the tests against
# the installed transformers): its image processor is timm's evaluation transform of the folder's pretrained cfg,
# which has no channel conversion, and the pipeline makes every path or PIL image RGB first.
_PIPELINE_CHANNELS = ('. transformers\' `pipeline(\'image-classification\')` makes every file name, URL and PIL image '
                      'RGB (3 channels) before its image processor (timm\'s evaluation transform of `config.json`\'s '
                      'pretrained cfg, which has no setting to convert channels) sees it, so on a path or a PIL image '
                      'it needs a 3-channel model; this model takes {in_chans}, and fails there with "expected '
                      '{in_chans} input channels, got 3".')


def _usage_section(repo_id: str | None, has_ema: bool, in_chans: int, label_names: bool) -> list[str]:
    repo = repo_id or 'USER/REPO'
    mode = 'RGB' if in_chans == 3 else 'L' if in_chans == 1 else None
    image = f"image = Image.open('image.jpg').convert('{mode}')" if mode else \
        f"image = ...  # a PIL image with {in_chans} channels"
    names = "model.pretrained_cfg['label_names'][i]" if label_names else 'i'
    lines = ['## How to use', '', 'With timm:', '', '```python', 'import timm', 'import torch',
             'from PIL import Image', '', 'import lipsformer  # registers the LipsFormer architectures with timm', '',
             f"model = timm.create_model('hf-hub:{repo}', pretrained=True).eval()",
             "# or from a copy of this folder: timm.create_model('local-dir:path/to/this/folder', pretrained=True)",
             'config = timm.data.resolve_model_data_config(model)  # the preprocessing it was trained with',
             'transform = timm.data.create_transform(**config)', image, 'with torch.no_grad():',
             '    probabilities = model(transform(image).unsqueeze(0)).softmax(-1)[0]',
             'for p, i in zip(*probabilities.topk(min(5, model.num_classes))):',
             f"    print({names}, f'{{p.item():.3f}}')", '```', '',
             'With transformers (4.53 or later, whose TimmWrapper builds the architecture with `config.json`\'s '
             '`model_args`; `import lipsformer` registers it with timm, without which transformers reports an '
             'unknown architecture)' + (':' if in_chans == 3 else _PIPELINE_CHANNELS.format(in_chans=in_chans) + (
                 ' Give this one the image as an H x W x 1 array, which the pipeline of transformers 5 and later '
                 'takes and does not convert (4.x takes paths, URLs and PIL images only):' if in_chans == 1
                 else ' Run this one with the model and the transform above.')),
             '', '```python', 'import lipsformer',
             'from transformers import AutoModelForImageClassification, pipeline', '']
    if in_chans == 3:
        lines += [f"classifier = pipeline('image-classification', model='{repo}')",
                  "print(classifier('image.jpg'))  # labels from config.json's label_names", '']
    elif in_chans == 1:
        opening = len(lines) - 1 - lines[::-1].index('```python')  # the transformers block's
        lines.insert(opening + 1, 'import numpy as np')
        lines += [f"classifier = pipeline('image-classification', model='{repo}')",
                  "print(classifier(np.asarray(Image.open('image.jpg').convert('L'))[..., None]))", '']
    lines += [f"model = AutoModelForImageClassification.from_pretrained('{repo}').eval()",
              'logits = model(transform(image).unsqueeze(0)).logits  # the transform above', '```', '',
              'A new classifier for another class count: add `num_classes=N`; timm then leaves the classifier at its '
              'initialisation and loads every other weight. The same names work as `model.name` in `train.py` '
              '(with `model.pretrained: true`), as `--model` in `validate.py` and `python -m lipsformer.lipschitz`.']
    if has_ema:
        lines += ['', 'The EMA weights are in `model_ema.safetensors`: `validate.py --checkpoint FOLDER --use-ema`, or '
                  '`lipsformer.weights.weight_files.load_model_weights(model, \'model_ema.safetensors\')`.']
    return lines + ['']


def build_card(export: ExportFolder, repo_id: str | None = None, lipschitz: bool = True,
               results: tuple[str, ...] = ()) -> Card:
    """The card of ``export`` and the plots it shows (nothing is written: see :func:`save_card`).

    Args:
        export: The export (and its run) to describe.
        repo_id: The Hub repository the card's loading examples name (``USER/REPO`` when None).
        lipschitz: Compute the Lipschitz bounds of the weights (seconds for a full-size model).
        results: ``validate.py --results-file`` JSON files of this export's ``model.safetensors``: each data set
            scored there joins the card's results (and its ``model-index``).

    Raises:
        CardError: A results file that cannot be read or scores other weights, a run config that cannot be read, or
            weights that cannot be read or do not fit ``config.json``'s architecture.
    """
    config_json = read_json(os.path.join(export.path, 'config.json'))
    model = _exported_model(export.path)
    config, summary = _run_facts(export.run_dir) if export.run_dir else (None, {})
    label_names = config_json.get('label_names')
    epoch = _exported_epoch(export, summary) if export.run_dir else {}
    scores = [score for score in [_run_score(config, epoch, label_names)] if score] if config is not None else []
    for path in results:
        scores += _validate_scores(path, export, label_names)
    input_size = config_json['pretrained_cfg']['input_size']
    complexity = model_complexity(f'local-dir:{export.path}', img_size=tuple(input_size[1:]))
    name = config_json['architecture']
    title = repo_id.split('/')[-1] if repo_id else name
    datasets = [score.hub_id for score in scores if score.hub_id]
    if config is not None and not datasets:
        datasets = [hub_id for hub_id in [_run_dataset(config, label_names)[0]] if hub_id]
    lines = _header(name, title, scores, datasets) + [
        f'# {title}', '', f'A LipsFormer image classifier (`{name}`) for timm, written by the `lipsformer` package: '
        f'LipsFormer (Qi et al., ICLR 2023, [arXiv:2304.09856](https://arxiv.org/abs/2304.09856); the authors\' code: '
        f'[IDEA-Research/LipsFormer](https://github.com/IDEA-Research/LipsFormer)).', '']
    lines += _model_section(config_json, complexity)
    if config is not None:
        lines += _training_sections(config, summary, epoch, os.path.basename(export.path))
    else:
        lines += ['No training run beside this folder: data, recipe and metrics were not recorded with it.', '']
    if results:  # beside the run's own evaluation, shown above
        lines += _results_section(scores)
    lines += _lipschitz_section(_lipschitz_summary(model) if lipschitz else None, epoch)
    plots = _run_plots(export)
    if plots:
        lines += ['## Plots', ''] + [f'![{os.path.splitext(os.path.basename(p))[0]}]({p})' for p in plots] + ['']
    has_ema = os.path.isfile(os.path.join(export.path, 'model_ema.safetensors'))
    lines += _usage_section(repo_id, has_ema, input_size[0], bool(label_names))
    lines += ['## Citation', '', '```bibtex', CITATION, '```', '']
    return Card('\n'.join(lines), plots)


def render_card(export: ExportFolder, repo_id: str | None = None, lipschitz: bool = True,
                results: tuple[str, ...] = ()) -> str:
    """The card's Markdown text (:func:`build_card`'s)."""
    return build_card(export, repo_id, lipschitz, results).text


def save_card(export: ExportFolder, card: Card) -> str:
    """Write ``card`` into the export: its plots (copied, each atomically), then ``README.md``; returns its path.

    Raises:
        OSError: A file could not be written (a read-only folder, a full disk); its ``filename`` is the file meant,
            not the temporary one the write went to.
    """
    target = os.path.join(export.path, CARD_FILE)
    try:
        for relative, source in card.plots.items():
            target = os.path.join(export.path, relative)
            if os.path.abspath(source) == os.path.abspath(target):
                continue
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with atomic_path(target) as temporary:
                shutil.copyfile(source, temporary)
        target = os.path.join(export.path, CARD_FILE)
        write_text(target, card.text)
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), target) from e
    return target


def write_card(target: str | ExportFolder, repo_id: str | None = None, which: str = 'best',
               lipschitz: bool = True, results: tuple[str, ...] = ()) -> str:
    """Write ``README.md`` (and the run's plots) into the export ``target`` means; returns the card's path.

    Args:
        target: A training run folder or an export / model folder (or one :func:`find_export` found).
        repo_id: The Hub repository the card's loading example names (``USER/REPO`` when None).
        which: The run's export to describe: ``best`` or ``last``.
        lipschitz: Compute the Lipschitz bounds of the weights (seconds for a full-size model).
        results: ``validate.py --results-file`` JSON files of the export's weights, added to the card's results.
    """
    export = target if isinstance(target, ExportFolder) else find_export(target, which)
    return save_card(export, build_card(export, repo_id, lipschitz, results))
