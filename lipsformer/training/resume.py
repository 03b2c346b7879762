"""Continuing a run: which checkpoint, whether it fits this run, and restoring it."""
import logging
import os
from typing import Any

from ..checkpoint import CheckpointError
from .checkpoints import latest_checkpoint, list_checkpoints, load_checkpoint, mark_best, read_meta
from .config_io import config_to_dict, flat_dict
from .optim import best_metric_name
from .session import Session

_logger = logging.getLogger(__name__)


def checkpoint_to_resume(run_dir: str, resume: str | None) -> str | None:
    """The checkpoint folder to continue from; refuses to start over a run that already has checkpoints."""
    if resume is None:
        if list_checkpoints(run_dir):
            raise CheckpointError(f'{run_dir!r} already holds checkpoints of a run; continue it with --resume auto, '
                                  f'or give another --output')
        return None
    if resume == 'auto':
        found = latest_checkpoint(run_dir)
        _logger.info('resume auto: %s', f'continuing from {found}' if found else 'no checkpoint yet, starting fresh')
        return found
    if not os.path.isdir(resume):
        raise CheckpointError(f'--resume {resume!r}: no such folder; give a checkpoint folder, a run folder or auto')
    if os.path.isfile(os.path.join(resume, 'meta.json')):
        return resume
    found = latest_checkpoint(resume)
    if found is None:
        raise CheckpointError(f'--resume {resume!r}: neither a checkpoint folder (with meta.json) nor a run folder '
                              f'with checkpoints/')
    return found


def resume_session(session: Session, checkpoint: str) -> None:
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
        if os.path.isdir(os.path.join(session.run_dir, 'checkpoints', progress.best_checkpoint)):
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
