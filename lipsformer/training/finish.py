"""The end of a run: final weights in timm's format, PNG curves of the metrics and ``summary.json``.

``export/<which>/model.safetensors`` (+ ``model_ema.safetensors``) and the ``config.json`` that
``timm.models.save_for_hf`` writes (:func:`lipsformer.weights.model_folder.save_model_folder`: transformers' TimmWrapper
loads it too), so that both

    timm.create_model('local-dir:<run>/export/best', pretrained=True)
    timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file='<run>/export/best/model.safetensors'))

rebuild the trained network (the second needs the same architecture kwargs as the training config, and for a class
count other than 1000 ``num_classes`` in the overlay too, or timm drops the trained classifier). The plots (loss,
accuracy, alpha per stage) need matplotlib, an optional dependency.
"""
import hashlib
import logging
import os
import re
import shutil
from typing import Any

import timm
import torch
from accelerate.utils import gather_object

from ..utils.io import atomic_open, default_file_mode, replace_dir, write_json
from ..utils.processes import distributed_summary
from ..weights.model_folder import save_model_folder
from ..weights.weight_files import load_file, strip_wrapper_prefixes
from .optim import best_metric_name
from .run_files import EXPORT_DIR, PLOTS_DIR, SUMMARY_FILE
from .session import Session
from .train_state import best_checkpoint, is_sharded, read_meta

_logger = logging.getLogger(__name__)



def finish_run(session: Session, status: str, wall_time: float) -> dict[str, Any]:
    """Export the weights, draw the plots and write ``summary.json`` (on the main process); ``wall_time`` is the
    run's, over all its starts."""
    accelerator, config = session.accelerator, session.config
    # With FSDP each process holds a shard, so there is nothing to compare.
    digests = [] if is_sharded(accelerator) else gather_object([_weights_digest(session.unwrapped_model)])
    summary: dict[str, Any] = dict(status=status, epochs_done=session.progress.epoch, step=session.progress.step,
                                   wall_time_s=wall_time, best_metric=best_metric_name(config),
                                   best_value=session.progress.best_value, best_epoch=session.progress.best_epoch,
                                   nonfinite_steps=session.progress.nonfinite_total, rank_weight_sha256=digests,
                                   ranks_identical=len(set(digests)) <= 1, last_checkpoint=session.last_checkpoint,
                                   distributed=distributed_summary(accelerator), **_skipped_images(session.progress))
    summary['compile'] = session.compile_record()  # scope, mode and this start's first micro-batch, or null
    # whether cuDNN autotuned (train.cudnn_benchmark), so that a speed figure says which kernels it timed
    summary['cudnn_benchmark'] = torch.backends.cudnn.benchmark
    if session.progress.history:
        summary['final_metrics'] = session.progress.history[-1]
    if accelerator.is_main_process:
        if status == 'finished' and config.checkpoint.export:
            summary['exports'] = _export(session)
        if config.log.plots:
            summary['plots'] = write_plots(session.progress.history, session.run_dir)
        write_json(os.path.join(session.run_dir, SUMMARY_FILE), summary)
    if not summary['ranks_identical']:
        _logger.error('processes ended with different weights (sha256 %s); DDP synchronisation failed', digests)
    accelerator.wait_for_everyone()
    return summary


def _skipped_images(progress: Any) -> dict[str, int]:
    """Unreadable images skipped over the run: in training (the scored epochs, the one awaiting its evaluation and
    the part of an epoch a stop cut short) and in the evaluations."""
    lines = [*progress.history, *([progress.unscored] if progress.unscored else [])]
    train = sum(line.get('skipped_images', 0) for line in lines)
    if progress.batch_in_epoch and progress.epoch_totals and len(progress.epoch_totals) > 4:
        train += int(progress.epoch_totals[4])
    return dict(skipped_images=train, val_skipped_images=sum(line.get('val_skipped_images', 0) for line in lines))


def _export(session: Session) -> dict[str, str]:
    exports = {}
    for which, folder in (('last', session.last_checkpoint), ('best', best_checkpoint(session.run_dir))):
        if folder is None:
            continue
        # the preprocessing its weights were trained with, as the checkpoint records it (older ones: the run's)
        data_config = read_meta(folder).get('data_config') or dict(session.spec.as_dict())
        exports[which] = export_checkpoint(session.run_dir, which, folder, session.config.model.name,
                                           session.model_kwargs, data_config, session.class_names,
                                           dataset_tag(session.config))
        _logger.info('exported %s weights to %s', which, exports[which])
    return exports


def dataset_tag(config: Any) -> str | None:
    """The pretrained tag of weights trained as ``config`` says: the data set's name (``torch/fashion_mnist`` ->
    ``fashion_mnist``; a folder's name for an image-folder tree), in the letters timm's tags use."""
    data = config.data
    name = data.dataset.rstrip('/').rsplit('/', 1)[-1] if data.dataset else os.path.basename(
        os.path.normpath(data.data_dir)) if data.data_dir else ''
    tag = re.sub(r'[^a-z0-9]+', '_', name.lower()).strip('_')
    return tag or None


def _weights_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def export_checkpoint(run_dir: str, which: str, checkpoint_dir: str, model_name: str, model_kwargs: dict[str, Any],
                      data_config: dict[str, Any], class_names: list[str] | None, tag: str | None = None) -> str:
    """Write ``export/<which>`` from a training checkpoint folder, atomically.

    Args:
        run_dir: The run folder.
        which: ``last`` or ``best``.
        checkpoint_dir: The checkpoint whose weights to export.
        model_name: timm model name.
        model_kwargs: The keyword arguments the model was created with (recorded in config.json).
        data_config: input_size / mean / std / interpolation / crop_pct for the pretrained config.
        class_names: Label names in index order, when the dataset has them.
        tag: The pretrained tag ``config.json`` gives the weights (:func:`dataset_tag`); None leaves none, rather than
            the tag of the model's default (ImageNet) weights.

    Returns:
        The export folder.
    """
    with torch.device('meta'):  # no initialisation work: every saved tensor comes from the checkpoint
        model = timm.create_model(model_name, pretrained=False, **model_kwargs)
    model.load_state_dict(strip_wrapper_prefixes(load_file(os.path.join(checkpoint_dir, 'model.safetensors'))),
                          assign=True)
    if getattr(model, 'pretrained_cfg', None) is not None:  # timm's models: it says which weights these are
        model.pretrained_cfg = {**{key: value for key, value in model.pretrained_cfg.items() if key != 'tag'},
                                **({'tag': tag} if tag else {})}
    final_dir = os.path.join(run_dir, EXPORT_DIR, which)
    tmp_dir = os.path.join(run_dir, EXPORT_DIR, f'.tmp-{which}')
    shutil.rmtree(tmp_dir, ignore_errors=True)
    model_config = {'label_names': class_names} if class_names else None
    save_model_folder(model, tmp_dir, model_config=model_config, data_config=data_config)
    ema_path = os.path.join(checkpoint_dir, 'ema.safetensors')
    if os.path.isfile(ema_path):
        shutil.copyfile(ema_path, os.path.join(tmp_dir, 'model_ema.safetensors'))
    for name in os.listdir(tmp_dir):  # safetensors from 0.5 writes 0600: the export is as readable as the rest
        os.chmod(os.path.join(tmp_dir, name), default_file_mode())
    replace_dir(tmp_dir, final_dir)
    return final_dir


def write_plots(history: list[dict[str, Any]], run_dir: str) -> list[str]:
    """Draw ``loss.png``, ``accuracy.png`` and ``alpha.png`` into ``<run>/plots``; returns the files written.

    Without matplotlib nothing is drawn and a hint to install it is logged.
    """
    if not history:
        return []
    try:  # an optional dependency, imported only when plots are drawn
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        _logger.info('plots skipped: matplotlib is not installed (pip install "lipsformer[plots]")')
        return []
    folder = os.path.join(run_dir, PLOTS_DIR)
    os.makedirs(folder, exist_ok=True)
    panels = [
        ('loss.png', 'loss', [('train_loss', 'train'), ('val_loss', 'val'), ('ema_val_loss', 'val (EMA)')]),
        ('accuracy.png', 'accuracy (%)', [('val_top1', 'top-1'), ('val_top5', 'top-5'),
                                          ('ema_val_top1', 'top-1 (EMA)'), ('ema_val_top5', 'top-5 (EMA)')]),
    ]
    figures = [(filename, ylabel, [(label, _series(history, key), None) for key, label in series
                                   if _series(history, key)]) for filename, ylabel, series in panels]
    stages = sorted({k[:-len('/mean')] for line in history for k in line if k.startswith('alpha/')
                     and k.endswith('/mean')})
    figures.append(('alpha.png', 'alpha (mean ± std)', [_alpha_curve(history, stage) for stage in stages]))
    return [_draw(plt, os.path.join(folder, filename), ylabel, curves) for filename, ylabel, curves in figures
            if curves]


def _series(history: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(line['epoch'], line[key]) for line in history if key in line]


def _alpha_curve(history: list[dict[str, Any]], prefix: str) -> tuple[str, list[tuple[int, float]], list[float]]:
    """Mean and std of one stage's alphas over epochs (the paper's Figure 5)."""
    means, stds = _series(history, f'{prefix}/mean'), dict(_series(history, f'{prefix}/std'))
    return prefix.split('/', 1)[1], means, [stds.get(epoch, 0.0) for epoch, _ in means]


def _draw(plt, path: str, ylabel: str, curves: list[tuple[str, list[tuple[int, float]], list[float] | None]]) -> str:
    """One PNG of curves over epochs: (label, points, spread shaded around them or None)."""
    figure, axis = plt.subplots(figsize=(6, 4))
    for label, points, spread in curves:
        epochs, values = zip(*points, strict=True)
        axis.plot(epochs, values, marker='o', markersize=3, label=label)
        if spread is not None:
            axis.fill_between(epochs, [v - s for v, s in zip(values, spread, strict=True)],
                              [v + s for v, s in zip(values, spread, strict=True)], alpha=0.2)
    axis.set_xlabel('epoch')
    axis.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    axis.set_ylabel(ylabel)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    with atomic_open(path, 'wb') as f:
        figure.savefig(f, format='png', dpi=120)
    plt.close(figure)
    return path
