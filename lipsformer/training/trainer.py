"""The training run: epochs, evaluation, metrics, checkpoints, resuming, graceful stop and the final export."""
import logging
import os
import time
from typing import Any

import torch
from accelerate import Accelerator

from ..checkpoint import CheckpointError
from ..utils.env import peak_memory_mb
from .config import Config
from .config_io import config_to_dict, flat_dict
from .finish import finish_run
from .loop import EpochResult, alpha_statistics, train_epoch, validate
from .optim import best_metric_name, total_epochs
from .run_files import MetricsFile, attach_log_file, write_config
from .session import Session, create_accelerator, create_session, release_accelerator
from .signals import StopSignal
from .train_state import (
    checkpoint_to_resume,
    checkpoints_root,
    load_checkpoint,
    mark_best,
    prune_checkpoints,
    read_meta,
    save_checkpoint,
)

_logger = logging.getLogger(__name__)


def train(config: Config, run_dir: str, resume: str | None = None) -> dict[str, Any]:
    """Train (or continue training) a model as ``config`` says, writing everything into ``run_dir``.

    Args:
        config: A validated config (:func:`~lipsformer.training.config_io.load_config`).
        run_dir: The run folder (created if needed).
        resume: None for a new run; ``'auto'`` to continue from the newest checkpoint in ``run_dir`` if there is
            one; or a checkpoint folder (or run folder) to continue from.

    Returns:
        The run summary (also written to ``summary.json``): ``status`` is ``'finished'`` or ``'stopped'``.

    Raises:
        ConfigError: The config does not fit the data or the model.
        CheckpointError: The checkpoint to resume from is unusable.
        NonFiniteLossError: Training diverged.
    """
    accelerator = create_accelerator(config, run_dir)
    try:
        return _train(accelerator, config, run_dir, resume)
    finally:
        release_accelerator()


def _train(accelerator: Accelerator, config: Config, run_dir: str, resume: str | None) -> dict[str, Any]:
    if logging.getLogger('lipsformer').level == logging.NOTSET:  # progress from the main process only
        logging.getLogger('lipsformer').setLevel(logging.INFO if accelerator.is_main_process else logging.WARNING)
    start_time = time.perf_counter()
    checkpoint = checkpoint_to_resume(run_dir, resume)
    if accelerator.is_main_process:
        os.makedirs(run_dir, exist_ok=True)
        write_config(config, run_dir)
    log_handler = attach_log_file(run_dir, accelerator.is_main_process)
    try:
        session = create_session(config, run_dir, accelerator)
        if checkpoint is not None:
            resume_session(session, checkpoint)
        metrics = MetricsFile(run_dir)
        if accelerator.is_main_process:
            metrics.reset(session.progress.history)
        accelerator.init_trackers('tensorboard', config=flat_dict(config_to_dict(config)))  # <run>/tensorboard
        with StopSignal() as stop:
            status = _run_epochs(session, stop, metrics)
        summary = finish_run(session, status, time.perf_counter() - start_time)
        accelerator.end_training()
        return summary
    finally:
        if log_handler is not None:
            logging.getLogger('lipsformer').removeHandler(log_handler)
            log_handler.close()


def _run_epochs(session: Session, stop: StopSignal, metrics: MetricsFile) -> str:
    config, progress = session.config, session.progress
    while progress.epoch < total_epochs(config):
        if stop.requested:
            return 'stopped'
        result = train_epoch(session, stop, on_update=lambda: _periodic_checkpoint(session))
        if result.stopped:
            _save(session, f'step_{progress.step:08d}')
            _logger.info('stopped by %s at step %d; resume with --resume auto', stop.received, progress.step)
            return 'stopped'
        line = _end_epoch(session, result)
        if session.accelerator.is_main_process:
            metrics.append(line)
        session.accelerator.log({k: v for k, v in line.items() if isinstance(v, (int, float))}, step=progress.step)
    return 'finished'


def _end_epoch(session: Session, result: EpochResult) -> dict[str, Any]:
    """Evaluate, log, save the epoch checkpoint and update the best one; returns the metrics line."""
    config, progress, accelerator = session.config, session.progress, session.accelerator
    last_epoch = progress.epoch + 1 == total_epochs(config)
    line: dict[str, Any] = dict(epoch=progress.epoch + 1, step=progress.step, train_loss=result.loss,
                                lr=session.optimizer.param_groups[0]['lr'],
                                images_per_s=result.images / max(result.seconds, 1e-9),
                                epoch_time_s=result.seconds)
    if (progress.epoch + 1) % config.train.eval_interval == 0 or last_epoch:
        raw = validate(session.model, session.val_loader, accelerator)
        line.update(val_loss=raw['loss'], val_top1=raw['top1'], val_top5=raw['top5'], val_samples=raw['samples'])
        if session.ema is not None:
            ema = validate(session.ema.module, session.val_loader, accelerator)
            line.update(ema_val_loss=ema['loss'], ema_val_top1=ema['top1'], ema_val_top5=ema['top5'])
    line.update(peak_memory_mb=_max_over_processes(accelerator, peak_memory_mb(accelerator.device)),
                nonfinite_steps=progress.nonfinite_total, **alpha_statistics(session.unwrapped_model))
    progress.epoch += 1
    progress.batch_in_epoch = 0
    progress.history.append(line)
    name = f'epoch_{progress.epoch:04d}'
    metric = best_metric_name(config)
    improved = metric in line and (progress.best_value is None or line[metric] > progress.best_value)
    if improved:
        progress.best_value, progress.best_epoch, progress.best_checkpoint = line[metric], progress.epoch, name
    _save(session, name)
    if improved and accelerator.is_main_process:
        mark_best(session.run_dir, name, metric, line[metric], progress.epoch)
    _logger.info('epoch %d: %s', progress.epoch, ', '.join(f'{k} {v:.4g}' for k, v in line.items()
                                                           if isinstance(v, float) and not k.startswith('alpha')))
    return line


def resume_session(session: Session, checkpoint: str) -> None:
    """Restore ``checkpoint`` into the session, after checking that it was saved with the same batch layout."""
    meta = read_meta(checkpoint)
    _check_geometry(meta, session, checkpoint)
    session.progress, _ = load_checkpoint(checkpoint, session.training_objects())
    session.scheduler.step_update(num_updates=session.progress.step)
    session.last_checkpoint = checkpoint
    changed = _changed_keys(meta.get('config', {}), config_to_dict(session.config))
    if changed:
        _logger.warning('resuming with config keys changed since the checkpoint: %s', ', '.join(changed))
    progress = session.progress
    if session.accelerator.is_main_process and progress.best_checkpoint:
        if os.path.isdir(os.path.join(checkpoints_root(session.run_dir), progress.best_checkpoint)):
            mark_best(session.run_dir, progress.best_checkpoint, best_metric_name(session.config),
                      progress.best_value, progress.best_epoch)
    _logger.info('resumed from %s: epoch %d, micro-batch %d, step %d', checkpoint, progress.epoch + 1,
                 progress.batch_in_epoch, progress.step)


def _check_geometry(meta: dict[str, Any], session: Session, checkpoint: str) -> None:
    saved, now = meta.get('geometry', {}), session.geometry()
    mid_epoch = meta['progress']['batch_in_epoch'] > 0
    keys = ('world_size', 'batch_size', 'grad_accum_steps', 'updates_per_epoch') if mid_epoch else (
        'global_batch_size', 'updates_per_epoch')
    different = [f'{k} {saved.get(k)} -> {now[k]}' for k in keys if saved.get(k) != now[k]]
    if different:
        where = 'mid-epoch' if mid_epoch else 'at an epoch boundary'
        raise CheckpointError(f'{checkpoint!r} was saved {where} with another batch layout ({"; ".join(different)}); '
                              f'resume with the same processes, train.batch_size and train.grad_accum_steps')


def _changed_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    saved_flat, current_flat = flat_dict(saved), flat_dict(current)
    return sorted(k for k in set(saved_flat) | set(current_flat) if saved_flat.get(k) != current_flat.get(k))


def _periodic_checkpoint(session: Session) -> None:
    every = session.config.checkpoint.every_n_steps
    progress = session.progress
    at_epoch_end = progress.batch_in_epoch == session.updates_per_epoch * session.config.train.grad_accum_steps
    if every and progress.step % every == 0 and not at_epoch_end:
        _save(session, f'step_{progress.step:08d}')


def _save(session: Session, name: str) -> None:
    meta = dict(geometry=session.geometry(), config=config_to_dict(session.config), time=time.time())
    session.last_checkpoint = save_checkpoint(session.run_dir, name, session.training_objects(), session.progress,
                                              meta)
    if session.accelerator.is_main_process:
        prune_checkpoints(session.run_dir, session.config.checkpoint.keep_last)
    session.accelerator.wait_for_everyone()


def _max_over_processes(accelerator, value: float) -> float:
    if accelerator.num_processes == 1:
        return value
    return accelerator.reduce(torch.tensor(value, device=accelerator.device), reduction='max').item()


