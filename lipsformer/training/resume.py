"""Continuing a run from a checkpoint: which one, what must match, and what becomes of the checkpoints it overtakes.

- ``--resume auto`` takes the run's newest checkpoint; one with an unreadable file (truncated, corrupt, not the bytes
  whose SHA-256 ``meta.json`` records, or a missing or unreadable ``meta.json``) is moved to
  ``checkpoints/unreadable/`` and the newest readable one is taken, with a warning naming it. An explicit checkpoint
  that cannot be read is an error.
- Refused with a :class:`~lipsformer.weights.weight_files.CheckpointError`, before anything in the run folder changes:
  another model (name, or an architecture the weights do not fit), another ``optimizer.name``, other training classes,
  another batch layout, or other preprocessing (input size, mean, std, interpolation, crop): the weights, their
  exports and their scores keep the preprocessing they were trained with.
- Applied and said: the optimizer's settings (weight decay, betas, eps, momentum, ...) are the config's, and those
  that differ from the checkpoint's are logged; a changed schedule follows the config; every other changed key is
  listed with its old and new value and the step it applies from, and ``config.yaml`` takes the new values while the
  config of the steps before is kept as ``config.before_step_<step>.yaml`` (the checkpoint's, in a folder that did
  not hold it).
- Refused as well: changed keys on a run that has finished all its epochs, since nothing would train with them while
  ``config.yaml`` (which repeats the run) would claim them.
- An explicit ``--resume`` of an older checkpoint abandons the run's newer ones: they are moved to
  ``checkpoints/abandoned/``, so that a later ``--resume auto`` continues this branch, not the abandoned one.
"""
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from ..weights.weight_files import CheckpointError
from .config_io import config_to_dict, flat_dict
from .optim import best_metric_name, total_epochs
from .session import Session
from .train_state import (
    META_FILE,
    SavedState,
    checkpoints_root,
    damaged_checkpoints,
    list_checkpoints,
    read_checkpoint,
    restore_best_pointer,
    restore_checkpoint,
    set_aside,
)

__all__ = ['ConfigChange', 'log_config_change', 'resume_session', 'training_images']

_logger = logging.getLogger(__name__)


@dataclass
class ConfigChange:
    """Config keys a resume changed: from which step, ``key: old -> new`` each, and the checkpoint's config."""
    step: int
    keys: list[str]
    earlier: dict[str, Any]


def resume_session(session: Session, candidates: list[str], explicit: bool) -> ConfigChange | None:
    """Restore the first readable of ``candidates`` into the session, after checking that it fits.

    Args:
        session: The freshly built run.
        candidates: Checkpoint folders, the preferred first (:func:`~.train_state.checkpoints_to_resume`).
        explicit: The user named the checkpoint (no fallback; the run's newer checkpoints are abandoned).

    Returns:
        The config keys changed since the checkpoint (None when none did), for :func:`log_config_change` once
        ``config.yaml`` is written.

    Raises:
        CheckpointError: No candidate is readable, or the checkpoint does not fit the config.
    """
    saved = _first_readable(session, candidates, explicit)
    _check_fits(saved, session)
    changed = _changed_keys(saved.meta.get('config', {}), config_to_dict(session.config))
    _check_something_trains(saved, session, changed)
    changed_settings = restore_checkpoint(saved, session.training_objects())
    progress = session.progress = saved.progress
    session.earlier_wall_time_s = progress.wall_time_s
    session.scheduler.step_update(num_updates=progress.step)
    session.last_checkpoint = saved.folder
    in_this_run = os.path.dirname(os.path.abspath(saved.folder)) == os.path.abspath(checkpoints_root(session.run_dir))
    session.saved_at = progress.position() if in_this_run else None  # else this run saves its own copy
    if changed_settings:
        _logger.warning('the optimizer continues with the config\'s settings, not the checkpoint\'s: %s',
                        '; '.join(changed_settings))
    if session.accelerator.is_main_process:
        _set_aside_damaged(session.run_dir)
        if explicit:
            _abandon_newer(session.run_dir, progress.position())
        restore_best_pointer(session.run_dir, progress, best_metric_name(session.config))
    session.accelerator.wait_for_everyone()
    _logger.info('resumed from %s: epoch %d, micro-batch %d, step %d%s', saved.folder, progress.epoch + 1,
                 progress.batch_in_epoch, progress.step,
                 '; the last epoch\'s evaluation comes first' if progress.unscored else '')
    return ConfigChange(progress.step, changed, saved.meta.get('config', {})) if changed else None


def log_config_change(change: ConfigChange, kept: str | None) -> None:
    """Say which keys a resume changed, from which step, and which file holds the config of the steps before
    (``kept``, as :func:`~.run_files.write_config` returned it: only a file that exists is named)."""
    before = (f'{os.path.basename(kept)} what the steps before used' if kept is not None else
              'the checkpoint\'s meta.json what the steps before used')
    _logger.warning('resuming with config keys changed since the checkpoint, applied from step %d: %s; config.yaml '
                    'holds them, %s', change.step, ', '.join(change.keys), before)


def _all_processes(accelerator: Any, ok: bool) -> bool:
    if accelerator.num_processes == 1:
        return ok
    return bool(accelerator.reduce(torch.tensor(float(ok), device=accelerator.device), reduction='min').item())


def _first_readable(session: Session, candidates: list[str], explicit: bool) -> SavedState:
    accelerator = session.accelerator
    for folder in candidates:
        try:
            saved, problem = read_checkpoint(folder, accelerator.process_index), None
        except CheckpointError as e:
            saved, problem = None, e
        if _all_processes(accelerator, problem is None):
            return saved
        reason = str(problem or 'unreadable on another process').rstrip('.')
        if problem is not None and not os.path.isfile(os.path.join(folder, META_FILE)):
            reason = f'its {META_FILE} is missing'
        if explicit:
            raise CheckpointError(f'cannot resume from {folder!r}: {reason}. Resume from an older checkpoint, or with '
                                  f'--resume auto (which takes the newest readable one)')
        _logger.warning('%s cannot be read (%s); it is moved to checkpoints/unreadable/ and the run continues from '
                        'the newest checkpoint before it that can be read', folder, reason)
        if accelerator.is_main_process:
            set_aside(session.run_dir, folder, 'unreadable')
        accelerator.wait_for_everyone()
    raise CheckpointError(f'no checkpoint of {session.run_dir!r} can be read (each was moved to '
                          f'checkpoints/unreadable/); start a new run with another --output')


def _check_fits(saved: SavedState, session: Session) -> None:
    """Refuse what the restored states cannot carry: another model, optimizer, class list or batch layout."""
    config, where = session.config, saved.folder
    saved_config = saved.meta.get('config', {})
    for key in ('model.name', 'optimizer.name'):
        section, name = key.split('.')
        before, now = saved_config.get(section, {}).get(name), getattr(getattr(config, section), name)
        if before is not None and str(before).lower() != str(now).lower():
            raise CheckpointError(
                f'{where!r} was trained with {key}={before}, the config says {now}: its state cannot continue '
                f'another {section}. Resume with {key}={before}, or start a new run from its weights with '
                f'model.init_checkpoint={os.path.join(where, "model.safetensors")}')
    saved_classes = saved.meta.get('model', {}).get('class_names')
    if saved_classes and session.class_names and saved_classes != session.class_names:
        raise CheckpointError(
            f'{where!r} was trained on the classes {_head(saved_classes)}, the training split now has '
            f'{_head(session.class_names)}: the classifier\'s outputs would mean other classes. Resume with the '
            f'same class folders (or data.class_map)')
    _check_geometry(saved, session)
    _check_preprocessing(saved, session)


# The config keys that decide the preprocessing (timm's data config) besides the model's defaults.
PREPROCESSING_KEYS = ('data.mean', 'data.std', 'data.interpolation', 'data.crop_pct', 'model.img_size',
                      'model.in_chans')


def _check_preprocessing(saved: SavedState, session: Session) -> None:
    """Refuse other preprocessing than the checkpoint's: its weights were trained on inputs sized and normalised
    as it records (``data_config``, or its config's keys in checkpoints saved before that was recorded), and a run
    continued with other values would export and score them with preprocessing they never saw."""
    saved_flat, current_flat = flat_dict(saved.meta.get('config', {})), flat_dict(config_to_dict(session.config))
    changed = [f'{key}: {saved_flat.get(key)} -> {current_flat.get(key)}' for key in PREPROCESSING_KEYS
               if key in saved_flat and saved_flat.get(key) != current_flat.get(key)]
    recorded, now = saved.meta.get('data_config'), plain_data_config(session.spec.as_dict())
    if recorded and not changed:  # the same keys resolved otherwise (another model's defaults)
        changed = [f'{key} {recorded.get(key)} -> {now.get(key)}' for key in sorted(set(recorded) | set(now))
                   if recorded.get(key) != now.get(key)]
    if changed:
        raise CheckpointError(
            f'{saved.folder!r} was trained with other preprocessing ({"; ".join(changed)}): its weights, their exports '
            f'and their scores keep the preprocessing they were trained with. Resume without changing it (the '
            f'run\'s config.yaml as saved), or start a new run with the new preprocessing from its weights: '
            f'--output NEW_RUN model.init_checkpoint={os.path.join(saved.folder, "model.safetensors")}')


def plain_data_config(data_config: dict[str, Any]) -> dict[str, Any]:
    """A data config as ``meta.json`` records it (JSON: tuples become lists)."""
    return {key: list(value) if isinstance(value, tuple) else value for key, value in data_config.items()}


def _check_something_trains(saved: SavedState, session: Session, changed: list[str]) -> None:
    """Refuse changed keys on a run that has trained all its epochs: nothing would train with them."""
    epochs = total_epochs(session.config)
    if changed and saved.progress.epoch >= epochs:
        raise CheckpointError(
            f'{session.run_dir!r} has finished its {epochs} epoch(s): nothing would train with the changed keys '
            f'({", ".join(changed)}), and its config.yaml, which repeats the run, would no longer say how it was '
            f'trained. Resume without them, raise train.epochs to train on with them, or start a new run from its '
            f'weights with model.init_checkpoint={os.path.join(saved.folder, "model.safetensors")}')


def _head(names: list[str], limit: int = 6) -> str:
    return ', '.join(names[:limit]) + (f' ... ({len(names)} in all)' if len(names) > limit else '')


def training_images(session: Session) -> int:
    """The images of an epoch of training: the training split's, or ``data.train_num_samples`` of a stream."""
    batches = session.train_batches
    return session.config.data.train_num_samples if batches.iterable else len(batches.dataset)


def _check_geometry(saved: SavedState, session: Session) -> None:
    before, now = saved.meta.get('geometry', {}), session.geometry()
    mid_epoch = saved.progress.batch_in_epoch > 0
    where = 'mid-epoch' if mid_epoch else 'at an epoch boundary'
    keys = ('world_size', 'batch_size', 'grad_accum_steps') if mid_epoch else ('global_batch_size',)
    different = [f'{k} {before.get(k)} -> {now[k]}' for k in keys if before.get(k) != now[k]]
    if different:
        upe = [f'updates_per_epoch {before.get("updates_per_epoch")} -> {now["updates_per_epoch"]}'] if before.get(
            'updates_per_epoch') != now['updates_per_epoch'] else []
        raise CheckpointError(f'{saved.folder!r} was saved {where} with another batch layout '
                              f'({"; ".join(different + upe)}); resume with the same processes, train.batch_size and '
                              f'train.grad_accum_steps')
    if before.get('updates_per_epoch') != now['updates_per_epoch']:  # the same batches, so another data set
        saved_images, images = before.get('train_images'), training_images(session)
        counted = f'{saved_images} training images' if saved_images is not None else 'another training set'
        data = session.config.data
        raise CheckpointError(
            f'{saved.folder!r} was saved {where} with {counted} ({before.get("updates_per_epoch")} updates an epoch); '
            f'the training data now has {images} images ({now["updates_per_epoch"]} updates an epoch) with the same '
            f'batch layout: data.data_dir {data.data_dir!r} (split {data.train_split!r}) holds another data set than '
            f'the run trained on. Resume with that data, or start a new run from the weights with '
            f'model.init_checkpoint={os.path.join(saved.folder, "model.safetensors")}')


def _changed_keys(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for each key whose value differs between the checkpoint's config and the current one."""
    saved_flat, current_flat = flat_dict(saved), flat_dict(current)
    return [f'{k}: {saved_flat.get(k)} -> {current_flat.get(k)}' for k in sorted(set(saved_flat) | set(current_flat))
            if saved_flat.get(k) != current_flat.get(k)]


def _set_aside_damaged(run_dir: str) -> None:
    """Move the run's checkpoints whose ``meta.json`` cannot be read to ``checkpoints/unreadable/`` (those an explicit
    ``--resume`` did not try), so that no checkpoint saved from here replaces one of the same name."""
    for folder, reason in damaged_checkpoints(run_dir):
        moved = set_aside(run_dir, folder, 'unreadable')
        _logger.warning('%s cannot be read (%s); it is moved to %s', folder, reason, moved)


def _abandon_newer(run_dir: str, position: tuple[int, int, int]) -> None:
    """Move the run's checkpoints that are further on than ``position`` out of its list."""
    newer = [folder for at, folder in list_checkpoints(run_dir) if at > position]
    if newer:
        moved = [set_aside(run_dir, folder, 'abandoned') for folder in newer]
        _logger.warning('resuming from an earlier point abandons %d newer checkpoint(s) of this run (%s); they are '
                        'moved to %s so that --resume auto continues from here', len(newer),
                        ', '.join(os.path.basename(f) for f in newer), os.path.dirname(moved[0]))
