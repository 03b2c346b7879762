"""A run's resumable training state: checkpoint folders in ``<run>/checkpoints/<name>/``, written atomically.

A checkpoint folder holds ``model.safetensors`` (and ``ema.safetensors``): plain state dicts any tool can read;
``optimizer.pt`` and ``trainer_state.pt`` (optimizer keyed by parameter name, scheduler, loss scaler, only tensors
and plain data so they load with ``weights_only=True``); ``rng_state_<rank>.pt`` per process; and ``meta.json`` with
the position in training (epoch, micro-batch within it, optimizer update), the best metric so far, the metrics history,
the resolved config, the preprocessing the weights were trained with (``data_config``) and the SHA-256 of each file
(``sha256``), checked whenever the checkpoint is read back (a resume: the files a process reads; an evaluation: the
weights).

Everything is first written into ``checkpoints/.tmp-<name>``, flushed to disk, and the folder is then renamed into
place, so a process killed at any moment leaves every earlier checkpoint complete. An epoch's checkpoint is saved
before its evaluation, with the epoch's training metrics in ``progress.unscored``; once scored, its ``meta.json`` is
replaced (atomically) by one whose history holds the epoch's line. ``best.json`` names the best checkpoint, which
pruning never deletes. The newest checkpoint is the most advanced one by its recorded progress
(:func:`latest_checkpoint`; validate.py picks it the same way). Checkpoints a run cannot use (unreadable files, or
newer than the one an explicit ``--resume`` went back to) are moved into ``checkpoints/<why>/``, never deleted. A
checkpoint folder whose ``meta.json`` is missing or unreadable is one of them (:func:`damaged_checkpoints`): it is
never listed as a checkpoint, pruned, or replaced by a new one of its name.

Model and optimizer states are full ones, gathered from a model that may be wrapped (DDP, torch.compile) or sharded
(FSDP); optimizer states are keyed by parameter name (``torch.distributed.checkpoint.state_dict``), so a checkpoint
depends neither on the order in which parameters were handed to the optimizer nor on how the model was sharded. RNG
states are plain tensors and numbers.
"""
import dataclasses
import json
import logging
import os
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from ..utils.io import file_sha256, fsync_dir, remove_dir, replace_dir, save_safetensors, save_torch, write_json
from ..weights.weight_files import CheckpointError, check_state_dict, load_file, strip_wrapper_prefixes

__all__ = ['Progress', 'SavedState', 'TrainingObjects', 'best_checkpoint', 'check_file_hashes', 'checkpoints_root',
           'checkpoints_to_resume', 'damaged_checkpoints', 'is_sharded', 'latest_checkpoint',
           'list_checkpoints', 'mark_best', 'prune_checkpoints', 'read_checkpoint', 'read_meta', 'restore_best_pointer',
           'restore_checkpoint', 'save_checkpoint', 'set_aside', 'update_progress']

_logger = logging.getLogger(__name__)

CHECKPOINTS_DIR = 'checkpoints'
BEST_POINTER = 'best.json'
META_FILE = 'meta.json'
FORMAT_VERSION = 1
# The names the trainer gives its checkpoints: any other folder in checkpoints/ (a copy, notes) is the user's, and is
# never taken for a checkpoint of the run, pruned or set aside (nor are the folders set_aside moves checkpoints into).
CHECKPOINT_NAME = re.compile(r'^(?:epoch|step)_\d+$')
# The files of a checkpoint the main process writes, whose SHA-256 meta.json records (with every process's RNG state).
HASHED_FILES = ('model.safetensors', 'ema.safetensors', 'optimizer.pt', 'trainer_state.pt')


def _rng_file(process_index: int) -> str:
    return f'rng_state_{process_index}.pt'


@dataclass
class Progress:
    """Where training stands; saved in ``meta.json``.

    Attributes:
        epoch: Epochs completed; also the index of the epoch in progress.
        batch_in_epoch: Micro-batches of that epoch already used by each process.
        step: Optimizer updates so far, skipped non-finite ones included (the schedule's clock).
        best_value: Best value of the selection metric so far.
        best_epoch: Epoch (completed count) that reached it.
        best_checkpoint: Name of the checkpoint holding it.
        nonfinite_total: Updates skipped because the loss was not finite.
        nonfinite_in_a_row: The updates skipped since the last one applied, across epochs and resumes (the run stops
            at ``train.max_nonfinite_steps``).
        history: The metrics line of every finished and scored epoch.
        unscored: The training part of the metrics line of the last finished epoch while its evaluation is pending
            (between its checkpoint and its scores), else None.
        epoch_totals: In a mid-epoch checkpoint, the epoch's running loss sum and count over all processes, images,
            seconds, unreadable images skipped, and the images and seconds of the micro-batches that compiled the
            model so far (so that the resumed epoch reports what an uninterrupted one would), else None.
        wall_time_s: Seconds of wall time the run's starts took to reach this state (a start that ended without
            saving counts up to its last checkpoint).
    """
    epoch: int = 0
    batch_in_epoch: int = 0
    step: int = 0
    best_value: float | None = None
    best_epoch: int | None = None
    best_checkpoint: str | None = None
    nonfinite_total: int = 0
    nonfinite_in_a_row: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    unscored: dict[str, Any] | None = None
    epoch_totals: list[float] | None = None
    wall_time_s: float = 0.0

    def position(self) -> tuple[int, int, int]:
        """Where training stands, as checkpoints are ordered: (step, epoch, batch_in_epoch)."""
        return self.step, self.epoch, self.batch_in_epoch


@dataclass
class TrainingObjects:
    """What a checkpoint saves and restores; ``model`` and ``optimizer`` as returned by ``accelerator.prepare``."""
    accelerator: Any
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    ema: Any | None = None
    extra_states: dict[str, Any] = field(default_factory=dict)


def checkpoints_root(run_dir: str) -> str:
    return os.path.join(run_dir, CHECKPOINTS_DIR)


def save_checkpoint(run_dir: str, name: str, objects: TrainingObjects, progress: Progress,
                    meta_extra: dict[str, Any]) -> str:
    """Write a checkpoint atomically (call on every process: gathering sharded states is collective).

    Args:
        run_dir: The run folder.
        name: Folder name inside ``checkpoints/``.
        objects: What to save.
        progress: The position in training.
        meta_extra: More JSON data for ``meta.json`` (config, batch geometry).

    Returns:
        The checkpoint folder.
    """
    accelerator = objects.accelerator
    root = checkpoints_root(run_dir)
    final_dir = os.path.join(root, name)
    tmp_dir = os.path.join(root, f'.tmp-{name}')
    if accelerator.is_main_process:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp_dir, ignore_errors=True)  # left by a process killed while saving
        os.makedirs(tmp_dir)
    accelerator.wait_for_everyone()
    save_torch(capture_rng_state(), os.path.join(tmp_dir, _rng_file(accelerator.process_index)))
    model_state = model_state_dict(accelerator, objects.model)
    optimizer_state = optimizer_state_dict(accelerator, objects.model, objects.optimizer)
    if accelerator.is_main_process:
        save_safetensors(model_state, os.path.join(tmp_dir, 'model.safetensors'))
        if objects.ema is not None:
            save_safetensors(objects.ema.module.state_dict(), os.path.join(tmp_dir, 'ema.safetensors'))
        save_torch(optimizer_state, os.path.join(tmp_dir, 'optimizer.pt'))
        save_torch(_trainer_state(objects), os.path.join(tmp_dir, 'trainer_state.pt'))
    accelerator.wait_for_everyone()  # every process's RNG state is written
    if accelerator.is_main_process:
        files = [*HASHED_FILES, *(_rng_file(index) for index in range(accelerator.num_processes))]
        hashes = {file: file_sha256(os.path.join(tmp_dir, file)) for file in files
                  if os.path.isfile(os.path.join(tmp_dir, file))}
        meta = dict(format=FORMAT_VERSION, name=name, world_size=accelerator.num_processes,
                    progress=dataclasses.asdict(progress), sha256=hashes, **meta_extra)
        write_json(os.path.join(tmp_dir, META_FILE), meta)
        replace_dir(tmp_dir, final_dir)
    accelerator.wait_for_everyone()
    return final_dir


@dataclass
class SavedState:
    """Everything one process reads from a checkpoint folder, before any of it is put into a model."""
    folder: str
    meta: dict[str, Any]
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    trainer: dict[str, Any]
    ema: dict[str, torch.Tensor] | None
    rng: dict[str, Any] | None

    @property
    def progress(self) -> Progress:
        return Progress(**self.meta['progress'])


def read_checkpoint(checkpoint_dir: str, process_index: int = 0) -> SavedState:
    """Read every file of a checkpoint this process needs.

    Raises:
        CheckpointError: A file is missing, truncated, unreadable or not the one saved (its SHA-256 differs from the
            one ``meta.json`` records).
    """
    meta = read_meta(checkpoint_dir)
    ema_path = os.path.join(checkpoint_dir, 'ema.safetensors')
    rng_path = os.path.join(checkpoint_dir, _rng_file(process_index))
    saved = SavedState(  # weights saved from a wrapped model elsewhere load too
        folder=checkpoint_dir, meta=meta,
        model=strip_wrapper_prefixes(load_file(os.path.join(checkpoint_dir, 'model.safetensors'))),
        optimizer=load_file(os.path.join(checkpoint_dir, 'optimizer.pt')),
        trainer=load_file(os.path.join(checkpoint_dir, 'trainer_state.pt')),
        ema=strip_wrapper_prefixes(load_file(ema_path)) if os.path.isfile(ema_path) else None,
        rng=load_file(rng_path) if os.path.isfile(rng_path) else None)
    # after loading, whose errors say more about a truncated file
    check_file_hashes(checkpoint_dir, meta, (*HASHED_FILES, _rng_file(process_index)))
    return saved


def restore_checkpoint(saved: SavedState, objects: TrainingObjects) -> list[str]:
    """Put a checkpoint's states into the prepared objects and this process's RNG state.

    The optimizer's moments and step counts come from the checkpoint; its settings (weight decay, betas, eps,
    momentum, ...) stay those of the config, which built it.

    Returns:
        The optimizer settings that differ from the checkpoint's, as ``'group <i> <key>: <saved> -> <config>'``.

    Raises:
        CheckpointError: The checkpoint does not fit the model or the optimizer.
    """
    accelerator = objects.accelerator
    set_model_state(accelerator, objects.model, saved.model)
    changed = set_optimizer_state(accelerator, objects.model, objects.optimizer, saved.optimizer)
    _load_scheduler_state(objects.scheduler, saved.trainer['scheduler'])
    if accelerator.scaler is not None and saved.trainer.get('scaler'):
        accelerator.scaler.load_state_dict(saved.trainer['scaler'])
    for key, target in objects.extra_states.items():
        if key in saved.trainer.get('extra', {}):
            target.load_state_dict(saved.trainer['extra'][key])
    if objects.ema is not None:
        if saved.ema is not None:
            objects.ema.module.load_state_dict(saved.ema)
        else:
            _logger.warning('%s has no EMA weights; the EMA restarts from the current weights', saved.folder)
            objects.ema.module.load_state_dict(accelerator.unwrap_model(objects.model).state_dict())
    if saved.rng is not None:
        restore_rng_state(saved.rng)
    else:
        _logger.warning('%s has no RNG state for process %d (saved with %d processes); random streams restart',
                        saved.folder, accelerator.process_index, saved.meta.get('world_size', 0))
    return changed


def update_progress(checkpoint_dir: str, progress: Progress) -> None:
    """Replace the progress in a checkpoint's ``meta.json`` (atomically), as when its epoch has been scored."""
    meta = read_meta(checkpoint_dir)
    meta['progress'] = dataclasses.asdict(progress)
    write_json(os.path.join(checkpoint_dir, META_FILE), meta)


def read_meta(checkpoint_dir: str) -> dict[str, Any]:
    """The ``meta.json`` of a checkpoint folder, or a :class:`CheckpointError` saying what is wrong."""
    path = os.path.join(checkpoint_dir, META_FILE)
    if not os.path.isfile(path):
        raise CheckpointError(f'{checkpoint_dir!r} is not a training checkpoint of this package (no {META_FILE}); '
                              f'to start from weights alone use model.init_checkpoint')
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f'cannot read {path!r}: {e}') from e
    if meta.get('format') != FORMAT_VERSION or 'progress' not in meta:
        raise CheckpointError(f'{path!r} has an unknown checkpoint format {meta.get("format")!r}')
    return meta


def check_file_hashes(checkpoint_dir: str, meta: dict[str, Any], files: tuple[str, ...] = HASHED_FILES) -> None:
    """Check ``files`` of a checkpoint against the SHA-256 its ``meta.json`` records (checkpoints saved before
    hashes were recorded have none to check).

    Raises:
        CheckpointError: A recorded file is missing or its bytes are not the ones saved.
    """
    for name, expected in (meta.get('sha256') or {}).items():
        if name not in files:
            continue
        path = os.path.join(checkpoint_dir, name)
        if not os.path.isfile(path):
            raise CheckpointError(f'{path!r} is missing (meta.json records its SHA-256)')
        if file_sha256(path) != expected:
            raise CheckpointError(f'{path!r} is not the file that was saved: its SHA-256 differs from the one '
                                  f'meta.json records (a failing disk, a copy cut short or an edit changed it)')


def _checkpoint_folders(run_dir: str) -> list[str]:
    """The folders of ``checkpoints/`` that are the run's checkpoints, complete or damaged: named as the trainer names
    them (:data:`CHECKPOINT_NAME`; not temporaries, not set aside, not a folder of the user's)."""
    root = checkpoints_root(run_dir)
    if not os.path.isdir(root):
        return []
    return [os.path.join(root, name) for name in sorted(os.listdir(root))
            if CHECKPOINT_NAME.match(name) and os.path.isdir(os.path.join(root, name))]


def list_checkpoints(run_dir: str) -> list[tuple[tuple[int, int, int], str]]:
    """Complete checkpoints of a run, oldest first, as ((step, epoch, batch_in_epoch), folder); those whose
    ``meta.json`` cannot be read are :func:`damaged_checkpoints`."""
    found = []
    for folder in _checkpoint_folders(run_dir):
        try:
            progress = read_meta(folder)['progress']
        except CheckpointError:
            continue
        found.append(((progress['step'], progress['epoch'], progress['batch_in_epoch']), folder))
    return sorted(found)


def damaged_checkpoints(run_dir: str) -> list[tuple[str, str]]:
    """The checkpoint folders of a run whose ``meta.json`` is missing or unreadable, as (folder, what is wrong).

    Their place among the checkpoints is unknown, so none of them can be taken for the newest or pruned; a folder
    completes under ``checkpoints/.tmp-<name>`` and appears only whole, so a folder without it was damaged later.
    """
    damaged = []
    for folder in _checkpoint_folders(run_dir):
        try:
            read_meta(folder)
        except CheckpointError as e:
            damaged.append((folder, str(e) if os.path.isfile(os.path.join(folder, META_FILE)) else
                            f'its {META_FILE} is missing'))
    return damaged


def latest_checkpoint(run_dir: str) -> str | None:
    """The most advanced complete checkpoint of a run, or None."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def checkpoints_to_resume(run_dir: str, resume: str | None) -> list[str]:
    """The checkpoint folders to try to continue from, the preferred first ([] for a new run).

    ``None`` refuses to start over a run that already has checkpoints; ``'auto'`` gives the run's checkpoints, the
    newest first (the next is tried when one is unreadable); a folder gives that checkpoint, or the newest of that run.

    A checkpoint whose ``meta.json`` cannot be read counts as a checkpoint of the run: a new run is refused, ``auto``
    gives it first (so that it is moved to ``checkpoints/unreadable/`` before the readable ones are tried), and a run
    folder's newest checkpoint cannot be chosen while one is there.
    """
    damaged = damaged_checkpoints(run_dir) if resume in (None, 'auto') else []
    if resume is None:
        if list_checkpoints(run_dir) or damaged:
            raise CheckpointError(f'{run_dir!r} already holds checkpoints of a run; continue it with --resume auto, '
                                  f'or give another --output')
        return []
    if resume == 'auto':
        found = [folder for _, folder in reversed(list_checkpoints(run_dir))]
        if damaged:
            _logger.info('resume auto: %d checkpoint(s) of %s have no readable meta.json (%s); they are tried first, '
                         'to be moved to checkpoints/unreadable/', len(damaged), run_dir,
                         ', '.join(os.path.basename(folder) for folder, _ in damaged))
        elif found:
            _logger.info('resume auto: continuing from %s', found[0])
        else:
            _logger.info('resume auto: no checkpoint yet, starting fresh')
        return [folder for folder, _ in damaged] + found
    if os.path.isfile(resume):
        raise CheckpointError(f'--resume {resume!r} is a file; give the checkpoint folder that holds it '
                              f'({os.path.dirname(os.path.abspath(resume))!r}), a run folder or auto')
    if not os.path.isdir(resume):
        raise CheckpointError(f'--resume {resume!r}: no such folder; give a checkpoint folder, a run folder or auto')
    if os.path.isfile(os.path.join(resume, META_FILE)):
        return [resume]
    damaged = damaged_checkpoints(resume)
    if damaged:
        raise CheckpointError(f'--resume {resume!r}: which checkpoint of that run is the newest is unknown, since '
                              f'{_damaged_text(damaged)}; give the checkpoint folder to resume from, or continue the '
                              f'run with --output {resume} --resume auto (which moves such checkpoints to '
                              f'checkpoints/unreadable/)')
    found = latest_checkpoint(resume)
    if found is None:
        raise CheckpointError(f'--resume {resume!r}: neither a checkpoint folder (with meta.json) nor a run folder '
                              f'with checkpoints/')
    return [found]


def _damaged_text(damaged: list[tuple[str, str]]) -> str:
    return '; '.join(f'{os.path.basename(folder)} cannot be read ({reason})' for folder, reason in damaged)


def set_aside(run_dir: str, folder: str, why: str) -> str:
    """Move a checkpoint out of the run's list into ``checkpoints/<why>/<name>-<time>`` (never deleted)."""
    target_dir = os.path.join(checkpoints_root(run_dir), why)
    os.makedirs(target_dir, exist_ok=True)
    target = os.path.join(target_dir, f'{os.path.basename(folder)}-{time.strftime("%Y%m%d-%H%M%S")}')
    os.rename(folder, target)
    fsync_dir(checkpoints_root(run_dir))
    return target


def mark_best(run_dir: str, name: str, metric: str, value: float, epoch: int) -> None:
    """Record which checkpoint is the best (an atomic pointer file; the folder itself is not copied)."""
    write_json(os.path.join(checkpoints_root(run_dir), BEST_POINTER),
                dict(name=name, metric=metric, value=value, epoch=epoch))


def restore_best_pointer(run_dir: str, progress: Progress, metric: str) -> None:
    """Make ``best.json`` name the best checkpoint of ``progress`` (a resumed run's), or remove it if that is not in
    this run (it may name a checkpoint of an abandoned continuation)."""
    if progress.best_checkpoint and os.path.isdir(os.path.join(checkpoints_root(run_dir), progress.best_checkpoint)):
        mark_best(run_dir, progress.best_checkpoint, metric, progress.best_value, progress.best_epoch)
    elif os.path.isfile(os.path.join(checkpoints_root(run_dir), BEST_POINTER)):
        os.remove(os.path.join(checkpoints_root(run_dir), BEST_POINTER))


def best_checkpoint(run_dir: str) -> str | None:
    """The folder ``best.json`` points to, if it exists."""
    path = os.path.join(checkpoints_root(run_dir), BEST_POINTER)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        folder = os.path.join(checkpoints_root(run_dir), json.load(f)['name'])
    return folder if os.path.isdir(folder) else None


def prune_checkpoints(run_dir: str, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` checkpoints, never the best one."""
    best = best_checkpoint(run_dir)
    folders = [folder for _, folder in list_checkpoints(run_dir)]
    for folder in folders[:-keep_last]:
        if best is None or not os.path.samefile(folder, best):
            remove_dir(folder)  # a kill mid-deletion must not leave a folder that lists as a complete checkpoint


def _load_scheduler_state(scheduler: Any, saved: dict[str, Any]) -> None:
    """Restore the schedule unless the config now asks for another one (say, more epochs), which then wins.

    A timm schedule is a function of the update count and its settings; the loop sets the count after loading.
    """
    current = scheduler.state_dict()
    changed = sorted(k for k in current.keys() & saved.keys() if saved[k] != current[k])
    if changed:
        _logger.warning('the learning-rate schedule differs from the checkpoint\'s (%s); following the config',
                        ', '.join(changed))
        return
    scheduler.load_state_dict(saved)


def _trainer_state(objects: TrainingObjects) -> dict[str, Any]:
    scaler = objects.accelerator.scaler
    return dict(scheduler=objects.scheduler.state_dict(), scaler=scaler.state_dict() if scaler is not None else None,
                extra={key: target.state_dict() for key, target in objects.extra_states.items()})


def capture_rng_state() -> dict[str, Any]:
    """The states of Python's, NumPy's, torch's CPU and (if present) CUDA generators of this process."""
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        'python': random.getstate(),
        'numpy': {'kind': kind, 'keys': torch.from_numpy(keys.astype(np.int64)), 'position': int(position),
                  'has_gauss': int(has_gauss), 'cached_gaussian': float(cached_gaussian)},
        'torch': torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what :func:`capture_rng_state` returned."""
    version, internal, gauss_next = state['python']
    random.setstate((version, tuple(internal), gauss_next))
    numpy_state = state['numpy']
    np.random.set_state((numpy_state['kind'], numpy_state['keys'].numpy().astype(np.uint32),
                         numpy_state['position'], numpy_state['has_gauss'], numpy_state['cached_gaussian']))
    torch.set_rng_state(state['torch'])
    if 'cuda' in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state['cuda'])


def is_sharded(accelerator: Any) -> bool:
    """Whether the model is sharded over processes (FSDP), so that full states must be gathered."""
    return str(accelerator.distributed_type) in ('DistributedType.FSDP', 'FSDP')


def model_state_dict(accelerator: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict with plain parameter names (call on every process: FSDP gathers)."""
    if is_sharded(accelerator):
        state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return strip_wrapper_prefixes(state_dict)
    return accelerator.unwrap_model(model, keep_torch_compile=False).state_dict()


def set_model_state(accelerator: Any, model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load a full state dict into the (possibly wrapped or sharded) model; mismatches raise CheckpointError."""
    if is_sharded(accelerator):
        set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True))
        return
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    check_state_dict(unwrapped, state_dict, source='checkpoint model.safetensors')
    unwrapped.load_state_dict(state_dict)


def optimizer_state_dict(accelerator: Any, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    """The optimizer's full state keyed by parameter name (call on every process: FSDP gathers)."""
    sharded = is_sharded(accelerator)
    owner = model if sharded else accelerator.unwrap_model(model, keep_torch_compile=False)
    return get_optimizer_state_dict(owner, getattr(optimizer, 'optimizer', optimizer),
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=sharded))


def set_optimizer_state(accelerator: Any, model: torch.nn.Module, optimizer: Any,
                        state_dict: dict[str, Any]) -> list[str]:
    """Load what :func:`optimizer_state_dict` returned, keeping the optimizer's own settings (its param groups'
    hyperparameters); returns those that differ from the saved ones. A state for other parameters raises
    CheckpointError."""
    owner = model if is_sharded(accelerator) else accelerator.unwrap_model(model, keep_torch_compile=False)
    inner = getattr(optimizer, 'optimizer', optimizer)
    configured = [{key: value for key, value in group.items() if key != 'params'} for group in inner.param_groups]
    # The kernel is this optimizer's (a state saved by the multi-tensor form resumes into the fused one): torch places
    # the loaded step counts where the loaded group's kernel wants them.
    if 'param_groups' in state_dict:
        state_dict = dict(state_dict, param_groups=[
            {**saved, **{key: configured[index][key] for key in _KERNEL_SETTINGS if key in configured[index]}}
            if index < len(configured) else saved for index, saved in enumerate(state_dict['param_groups'])])
    # torch initialises the optimizer's state by stepping it on faked zero gradients, which it cannot do while the
    # parameters hold gradients (the buffers a model compiled with CUDA graphs keeps): they are set aside meanwhile.
    kept_gradients = {parameter: parameter.grad for parameter in owner.parameters() if parameter.grad is not None}
    for parameter in kept_gradients:
        parameter.grad = None
    try:
        set_optimizer_state_dict(owner, inner, state_dict, options=StateDictOptions(full_state_dict=True))
    except (KeyError, ValueError, RuntimeError) as e:
        raise CheckpointError(f'the optimizer state does not fit this model / optimizer ({e}); was the checkpoint '
                              f'saved with another model or optimizer.name?') from e
    finally:
        for parameter, gradient in kept_gradients.items():
            parameter.grad = gradient
    changed = []
    for index, (group, settings) in enumerate(zip(inner.param_groups, configured, strict=True)):
        for key, value in settings.items():
            saved = group.get(key)
            if key not in _UNCOMPARED_SETTINGS and _plain(saved) != _plain(value):
                changed.append(f'group {index} {key}: {_plain(saved)!r} -> {_plain(value)!r}')
            group[key] = value
    return changed


# Which kernel runs the update follows the device, not the recipe.
_KERNEL_SETTINGS = ('fused', 'foreach', 'capturable', 'differentiable')
# Settings a resume does not report as changed: the schedule sets the lr, the device the kernel.
_UNCOMPARED_SETTINGS = ('lr', 'initial_lr', *_KERNEL_SETTINGS)


def _plain(value: Any) -> Any:
    """A setting as compared and shown: a saved state turns tuples (Adam's betas) into lists."""
    return tuple(value) if isinstance(value, (list, tuple)) else value
