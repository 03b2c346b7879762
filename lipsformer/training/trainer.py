"""The training run: epochs, evaluation, metrics, checkpoints, resuming, graceful stop and the final export.

An epoch ends in this order: its checkpoint is saved (the training state is complete), then the model and its EMA are
evaluated, then the scores are recorded (in the checkpoint's ``meta.json``, ``best.json``, ``metrics.jsonl`` and the
trackers). A failed or interrupted evaluation loses no training, and a stop signal during an evaluation cuts it short:
the resumed run evaluates that epoch before it trains on. No state is saved twice, and ``config.yaml`` is written only
once the run has started (a refused resume leaves the folder as it was).

The main process holds the run folder's lock (:mod:`.run_lock`) from before it clears or reads anything there until the
run has ended, so a second start on the same folder (a relaunch, a requeued job) is refused, or waits, and never
touches the files of the run in progress.
"""
import logging
import math
import os
import time
import traceback
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from ..utils.env import peak_memory_mb
from ..utils.io import remove_stale_temporaries
from ..utils.processes import distributed_summary, end_processes, release_accelerator
from .config import Config, check_config
from .config_io import config_to_dict
from .finish import finish_run
from .loop import EpochResult, NonFiniteLossError, alpha_statistics, stop_agreed, train_epoch, validate, weights_finite
from .optim import best_metric_name, scheduled_lr, total_epochs
from .resume import log_config_change, plain_data_config, resume_session, training_images
from .run_files import (
    CONFIG_FILE,
    EXPORT_DIR,
    LOG_FILE,
    MetricsFile,
    attach_log_file,
    check_run_folder_shared,
    write_config,
)
from .run_lock import RunFolderGoneError, RunFolderInUseError, RunLock
from .session import (
    Session,
    check_config_callables,
    create_accelerator,
    create_session,
)
from .signals import StopSignal
from .trackers import start_trackers
from .train_state import (
    checkpoints_root,
    checkpoints_to_resume,
    mark_best,
    prune_checkpoints,
    save_checkpoint,
    update_progress,
)

_logger = logging.getLogger(__name__)

_LOG_FORMAT = '%(asctime)s %(levelname)s %(name)s: %(message)s'  # train.log's, as run_files.attach_log_file writes it


def train(config: Config, run_dir: str, resume: str | None = None, *, wait_for_lock: float = 0.0,
          trusted_callables: tuple[str, ...] = ()) -> dict[str, Any]:
    """Train (or continue training) a model as ``config`` says, writing everything into ``run_dir``.

    Args:
        config: A validated config (:func:`~lipsformer.training.config_io.load_config`).
        run_dir: The run folder (created if needed).
        resume: None for a new run; ``'auto'`` to continue from the newest readable checkpoint in ``run_dir`` if
            there is one; or a checkpoint folder (or run folder) to continue from.
        wait_for_lock: Seconds to wait for another run that holds ``run_dir`` to end (0: refuse at once).
        trusted_callables: ``module:callable`` names the config may choose besides the package's own
            (``lipschitz.target``); a config is data and names no other code.

    Returns:
        The run summary (also written to ``summary.json``): ``status`` is ``'finished'`` or ``'stopped'`` (a run
        that diverges writes ``summary.json`` with ``'diverged'``, exports nothing and raises).

    Raises:
        ConfigError: The config does not fit the data, the model or the run folder, or names code not trusted.
        DatasetError: A split is missing, holds no readable image, or its classes do not fit (DatasetNotFoundError:
            data not on disk).
        CheckpointError: The checkpoint to resume from is unusable or does not fit the config.
        RunFolderInUseError: Another process holds ``run_dir``.
        LaunchError: The processes launched do not form one group.
        NonFiniteLossError: Training diverged: ``train.max_nonfinite_steps`` updates in a row had a non-finite loss
            (across epochs), or the weights or an evaluation's loss became non-finite.
    """
    check_config(config)  # a Config built or changed in Python skips the checks of reading a file
    check_config_callables(config, trusted_callables)
    try:
        accelerator = create_accelerator(config, run_dir)
        return _train(accelerator, config, run_dir, resume, wait_for_lock, trusted_callables)
    except BaseException as error:
        # An error raised in a loader worker holds the loader's iterator in its traceback, in a reference cycle only
        # the garbage collector breaks; the workers ignore SIGTERM (signals.ignore_stop_signals), so an interpreter
        # that exits while they live waits for them forever. Clearing the finished frames lets them go now.
        traceback.clear_frames(error.__traceback__)
        raise
    finally:
        release_accelerator()


def _train(accelerator: Accelerator, config: Config, run_dir: str, resume: str | None, wait_for_lock: float,
           trusted_callables: tuple[str, ...]) -> dict[str, Any]:
    if logging.getLogger('lipsformer').level == logging.NOTSET:  # progress from the main process only
        logging.getLogger('lipsformer').setLevel(logging.INFO if accelerator.is_main_process else logging.WARNING)
    start_time = time.perf_counter()
    run = _RunEnd(run_dir)
    try:
        run.lock = _lock_run_folder(accelerator, run_dir, wait_for_lock)
        if accelerator.is_main_process:
            _clear_interrupted_writes(run_dir)
        check_run_folder_shared(accelerator, run_dir)
        run.folder_checked = True
        candidates = checkpoints_to_resume(run_dir, resume)
        run.log_handler = attach_log_file(run_dir, accelerator.is_main_process)
        _say_distribution(accelerator)
        session = run.session = create_session(config, run_dir, accelerator, trusted_callables)
        session.started_at = start_time
        change = resume_session(session, candidates, explicit=resume != 'auto') if candidates else None
        metrics = MetricsFile(run_dir)
        if accelerator.is_main_process:
            kept = write_config(config, run_dir, session.progress.step, change.earlier if change else None,
                                resumed=bool(candidates))
            if change is not None:
                log_config_change(change, kept)
            metrics.reset(session.progress.history, resumed=bool(candidates))
        start_trackers(accelerator, config, run_dir)
        session.check_run_folder = lambda: _check_run_folder(accelerator, run.lock, session.progress.step)
        run.training = True
        with StopSignal() as stop:
            try:
                status = _run_epochs(session, stop, metrics)
                session.check_run_folder()  # before the summary and the exports go into it
            except NonFiniteLossError:  # summary.json says so, whatever an earlier start wrote; nothing is exported
                finish_run(session, 'diverged', session.wall_time_s())
                raise
            except (RunFolderGoneError, OSError) as error:
                gone = error if isinstance(error, RunFolderGoneError) else _folder_gone_under(accelerator, run.lock)
                if gone is None:
                    raise
                raise _keep_state(run, str(gone)) from None
        summary = finish_run(session, status, session.wall_time_s())
        run.session = session = None  # the DDP wrapper, before the process group goes
        end_processes(accelerator)
        return summary
    except BaseException as error:
        ended = run.ended_by(error, accelerator)
        if ended is error:
            raise
        raise ended from error
    finally:
        run.close()


class _RunEnd:
    """What a run holds that its end must deal with: the lock, the log file, the session (for the message of an error
    that ends it), and how far it got (which errors every process raises alike)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.lock: RunLock | None = None
        self.rescue_lock: RunLock | None = None
        self.log_handler: logging.Handler | None = None
        self.session: Session | None = None
        self.folder_checked = False  # every process sees the run folder: any of them may append to train.log
        self.training = False  # past the set-up, where every process checks the same config, data and checkpoint

    def ended_by(self, error: BaseException, accelerator: Accelerator) -> BaseException:
        """``error``, or the error that says what it means (another process died), marked for :func:`report_end`."""
        rank, processes = accelerator.process_index, accelerator.num_processes
        died = _peer_died(error, rank, processes, self.session)
        if died is not None:
            error = died
        if isinstance(error, (RunFolderGoneError, NonFiniteLossError)) or (
                not self.training and not isinstance(error, (PeerProcessDiedError, KeyboardInterrupt))
                and _raised_alike(error)):
            error._lipsformer_every_process = True  # the main process reports it for the run
        log_here = self.log_handler is not None or (
            self.folder_checked and processes > 1 and not getattr(error, '_lipsformer_every_process', False))
        if log_here:
            error._lipsformer_run_log = os.path.join(self.run_dir, LOG_FILE)
        if processes > 1 and not accelerator.is_main_process:
            error._lipsformer_process = rank
        return error

    def close(self) -> None:
        if self.log_handler is not None:
            logging.getLogger('lipsformer').removeHandler(self.log_handler)
            self.log_handler.close()
        for lock in (self.lock, self.rescue_lock):
            if lock is not None:
                lock.release()


def _raised_alike(error: BaseException) -> bool:
    """Whether every process raises ``error`` when it comes from the set-up: they all read the same config, data,
    run folder and checkpoint (a refusal of the lock is shared by the main process)."""
    from ..data import DatasetError  # the training package imports data through session; no cycle here
    from ..utils.processes import LaunchError
    from ..weights.weight_files import CheckpointError
    from .config import ConfigError
    return isinstance(error, (ConfigError, CheckpointError, DatasetError, RunFolderInUseError, LaunchError))


def report_end(logger: logging.Logger, level: int, message: str, error: BaseException | None) -> None:
    """Log the reason a run ended, as train.py's last line: on the console of the process that has something to say
    (the main process alone for what every process raised alike, each process for its own), and in the run's
    ``train.log`` too where the run got as far as its own folder (never into a folder another run holds).

    Args:
        logger: The command's logger.
        level: The level on the process that reports it.
        message: The reason, with the exit status.
        error: The error that ended the run (None: one found before the run started).
    """
    if error is not None and getattr(error, '_lipsformer_process', None) is not None:
        if getattr(error, '_lipsformer_every_process', False):
            level = logging.DEBUG  # the main process says it; a line per process would repeat it
        else:
            message = f'process {error._lipsformer_process}: {message}'
    run_log = getattr(error, '_lipsformer_run_log', None) if level >= logging.WARNING else None
    handler = None
    if run_log is not None:
        try:
            handler = logging.FileHandler(run_log)
        except OSError:  # the folder is gone or read-only: the console has the line
            handler = None
        else:
            handler.setFormatter(logging.Formatter(_LOG_FORMAT))
            handler.setLevel(level)
            logger.addHandler(handler)
    try:
        logger.log(level, '%s', message)
    finally:
        if handler is not None:
            logger.removeHandler(handler)
            handler.close()


class PeerProcessDiedError(RuntimeError):
    """Another process of a multi-process run ended (killed, crashed) while this one waited for it in a collective
    operation; the message names it where it can and the checkpoint to continue from."""


# What torch's process-group backends say when the process at the other end of a connection is gone.
_PEER_GONE = ('closed by peer', 'reset by peer', 'Broken pipe', 'Connection refused', 'NCCL communicator was aborted',
              'remote worker crashing')


def _peer_died(error: BaseException, rank: int, processes: int, session: Session | None) -> PeerProcessDiedError | None:
    """The meaning of a collective's connection error in a multi-process run: another process died."""
    if processes < 2 or isinstance(error, PeerProcessDiedError) or not isinstance(error, RuntimeError):
        return None
    text = str(error)
    if not any(sign in text for sign in _PEER_GONE):
        return None
    who = f'process {1 - rank}' if processes == 2 else f'one of the other {processes - 1} processes'
    said = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    said = said.split('] ', 1)[-1].split('. ')[0][:200]  # gloo's source position first: its first sentence only
    last = session.last_checkpoint if session is not None else None
    saved = (f'the last checkpoint saved is {last}' if last else 'no checkpoint was saved before it')
    return PeerProcessDiedError(
        f'another process of the run died ({who}; this is process {rank} of {processes}): its connection closed '
        f'during a collective operation ({said}). Its own output, or the launcher\'s, says why it ended; {saved}, '
        f'every checkpoint saved is whole: continue with --resume auto once the cause is fixed')


def _check_run_folder(accelerator: Accelerator, lock: RunLock | None, step: int) -> None:
    """Stop the run on every process when the main process finds its lock file gone (a collective operation)."""
    reason = lock.lost() if lock is not None else None
    if accelerator.num_processes > 1:
        reason = broadcast_object_list([reason])[0]
    if reason is not None:
        raise RunFolderGoneError(reason)


def _folder_gone_under(accelerator: Accelerator, lock: RunLock | None) -> RunFolderGoneError | None:
    """After a failed write: whether it failed because the run folder went (asked of the main process's lock). Every
    process of a run fails a save alike (they all wait for the main process's writes)."""
    reason = lock.lost() if lock is not None else None
    if accelerator.num_processes > 1:
        try:
            reason = broadcast_object_list([reason])[0]
        except RuntimeError:
            return None
    return RunFolderGoneError(reason) if reason is not None else None


def _keep_state(run: _RunEnd, reason: str) -> RunFolderGoneError:
    """Save what the run holds in memory into its run folder made again, under a lock of its own, and return the error
    that says so (call on every process). Nothing is saved into a folder another run has taken meanwhile."""
    session = run.session
    accelerator, run_dir, progress = session.accelerator, run.run_dir, session.progress
    session.check_run_folder = None
    where = (f'{reason} while the run trained (noticed at step {progress.step}); '
             f'the run stops rather than write into a folder that no lock guards.')
    refusal = None
    if accelerator.is_main_process:
        try:
            run.rescue_lock = RunLock(run_dir)
            run.rescue_lock.acquire()  # makes the folder again
        except (RunFolderInUseError, OSError) as e:
            run.rescue_lock, refusal = None, f'{type(e).__name__}: {e}'
    if accelerator.num_processes > 1:
        refusal = broadcast_object_list([refusal])[0]
    if refusal is not None:
        return RunFolderGoneError(f'{where} The state it held in memory is not saved: {refusal}')
    try:
        if accelerator.is_main_process:
            if run.log_handler is not None:  # the old train.log went with the folder: the new one says what happened
                logging.getLogger('lipsformer').removeHandler(run.log_handler)
                run.log_handler.close()
            run.log_handler = attach_log_file(run_dir, True)
            write_config(session.config, run_dir, progress.step)
        session.saved_at = None  # the checkpoint of this position, if any, went with the folder
        name = (f'epoch_{progress.epoch:04d}' if progress.batch_in_epoch == 0 and progress.epoch
                else f'step_{progress.step:08d}')
        _save(session, name)
    except OSError as e:
        return RunFolderGoneError(f'{where} Saving the state it held into {os.path.abspath(run_dir)!r} made again '
                                  f'failed too ({e}); nothing of it is kept')
    return RunFolderGoneError(
        f'{where} The state it held in memory is saved in {session.last_checkpoint} (the folder made again, with '
        f'config.yaml; the epochs scored so far come back into metrics.jsonl on resuming): continue with --config '
        f'{os.path.join(run_dir, CONFIG_FILE)} --output {run_dir} --resume auto, or remove the folder if the run was '
        f'meant to end')


def _say_distribution(accelerator: Accelerator) -> None:
    if not accelerator.is_main_process:
        return
    distribution = distributed_summary(accelerator)
    if distribution['processes'] > 1:
        _logger.info('%d processes train as one group (%s) on %s', distribution['processes'], distribution['type'],
                     accelerator.device.type)
    if distribution['note']:
        _logger.warning('%s', distribution['note'])


def _lock_run_folder(accelerator: Accelerator, run_dir: str, wait_s: float) -> RunLock | None:
    """Take the run folder's lock in the main process; every process learns whether it got it (a refusal is raised
    on all of them, so that none waits for the others)."""
    lock, refusal = None, None
    if accelerator.is_main_process:
        lock = RunLock(run_dir, wait_s)
        try:
            lock.acquire()
        except RunFolderInUseError as e:
            lock, refusal = None, str(e)
        except BaseException as e:
            if accelerator.num_processes > 1:
                broadcast_object_list([f'the main process could not lock the run folder: {type(e).__name__}: {e}'])
            raise
    if accelerator.num_processes > 1:
        refusal = broadcast_object_list([refusal])[0]
    if refusal is not None:
        raise RunFolderInUseError(refusal)
    return lock


def _clear_interrupted_writes(run_dir: str) -> None:
    for folder in (run_dir, checkpoints_root(run_dir), os.path.join(run_dir, EXPORT_DIR)):
        cleared = remove_stale_temporaries(folder)
        if cleared:
            _logger.info('%s: cleared what an interrupted write left: %s', folder, ', '.join(cleared))


def _run_epochs(session: Session, stop: StopSignal, metrics: MetricsFile) -> str:
    config, progress, accelerator = session.config, session.progress, session.accelerator
    if progress.unscored is not None and not _score_epoch(session, stop, metrics):
        return _stopped(session, stop, f'during the evaluation of epoch {progress.epoch}')
    while progress.epoch < total_epochs(config):
        if stop_agreed(accelerator, stop):
            return _stopped(session, stop, f'before epoch {progress.epoch + 1}')
        result = train_epoch(session, stop, on_update=lambda: _periodic_checkpoint(session))
        if not result.completed:
            _save(session, f'step_{progress.step:08d}')
            return _stopped(session, stop, f'at step {progress.step}')
        _close_epoch(session, result)
        if stop_agreed(accelerator, stop) or not _score_epoch(session, stop, metrics):
            return _stopped(session, stop, f'after epoch {progress.epoch}, before its evaluation finished')
    return 'finished'


def _stopped(session: Session, stop: StopSignal, when: str) -> str:
    """Log a stop, naming the checkpoint the run continues from (none where a stop came before the first save)."""
    saved = (f'the checkpoint is {session.last_checkpoint}' if session.last_checkpoint is not None else
             'no checkpoint was saved, since nothing has trained yet')
    _logger.info('stopped by %s %s; %s, continue with --resume auto', stop.received or 'a signal to another process',
                 when, saved)
    return 'stopped'


def _close_epoch(session: Session, result: EpochResult) -> None:
    """Save the checkpoint of the epoch just trained, its training metrics waiting for its evaluation."""
    progress = session.progress
    progress.epoch += 1
    progress.batch_in_epoch = 0
    progress.epoch_totals = None
    progress.unscored = dict(epoch=progress.epoch, step=progress.step, train_loss=result.loss,
                             lr=scheduled_lr(session.optimizer),
                             images_per_s=result.images_per_s(),
                             epoch_time_s=result.seconds,
                             skipped_images=result.skipped)
    _save(session, f'epoch_{progress.epoch:04d}')


def _score_epoch(session: Session, stop: StopSignal, metrics: MetricsFile) -> bool:
    """Evaluate the last finished epoch (when due) and record its line; False when a stop cut the evaluation short."""
    config, progress, accelerator = session.config, session.progress, session.accelerator
    line = dict(progress.unscored)
    if line['epoch'] % config.train.eval_interval == 0 or line['epoch'] == total_epochs(config):
        raw = validate(session.model, session.val_loader, accelerator, stop, pad_batches=session.static_shapes)
        if raw is None:
            return False
        line.update(val_loss=raw['loss'], val_top1=raw['top1'], val_top5=raw['top5'], val_samples=raw['samples'],
                    val_skipped_images=raw['skipped'])
        if session.ema is not None:
            ema = validate(session.ema.module, session.val_loader, accelerator, stop)
            if ema is None:
                return False
            line.update(ema_val_loss=ema['loss'], ema_val_top1=ema['top1'], ema_val_top5=ema['top5'])
        _check_scores_finite(session, line)
    line.update(peak_memory_mb=_max_over_processes(accelerator, peak_memory_mb(accelerator.device)),
                nonfinite_steps=progress.nonfinite_total, **alpha_statistics(session.unwrapped_model))
    progress.unscored = None
    progress.history.append(line)
    name, metric = f'epoch_{line["epoch"]:04d}', best_metric_name(config)
    improved = metric in line and (progress.best_value is None or line[metric] > progress.best_value)
    if improved:
        progress.best_value, progress.best_epoch, progress.best_checkpoint = line[metric], line['epoch'], name
    _record_scores(session, name)
    if accelerator.is_main_process:
        if improved:
            mark_best(session.run_dir, name, metric, line[metric], line['epoch'])
        prune_checkpoints(session.run_dir, config.checkpoint.keep_last)
        metrics.append(line)
    accelerator.log({k: v for k, v in line.items() if isinstance(v, (int, float))}, step=progress.step)
    _logger.info('epoch %d: %s', line['epoch'], ', '.join(f'{k} {v:.4g}' for k, v in line.items()
                                                          if isinstance(v, float) and not k.startswith('alpha')))
    accelerator.wait_for_everyone()
    return True


def _check_scores_finite(session: Session, line: dict[str, Any]) -> None:
    """Refuse an epoch whose evaluation loss is not finite: the model's outputs are not numbers, so the run has
    diverged (the epoch stays unscored, never the best, and nothing is exported)."""
    losses = {key: line[key] for key in ('val_loss', 'ema_val_loss') if key in line}
    if all(math.isfinite(value) for value in losses.values()):
        return
    best = session.progress.best_checkpoint
    good = os.path.join(checkpoints_root(session.run_dir), best) if best else None
    raise NonFiniteLossError(
        f'the evaluation of epoch {line["epoch"]} gave {", ".join(f"{k} {v:.4g}" for k, v in losses.items())}: the '
        f'model\'s outputs are not finite, the run diverged ({session.progress.nonfinite_total} updates skipped for a '
        f'non-finite loss so far, {session.progress.nonfinite_in_a_row} of them in a row). '
        + _divergence_advice(good if good and os.path.isdir(good) else None))


def _divergence_advice(good: str | None) -> str:
    """The end of a divergence message: the checkpoint to go back to, and what to change."""
    if good is None:
        return ('No checkpoint before it is good: start the run again with a lower optimizer.lr or with '
                'optimizer.clip_grad, or check the data.')
    return (f'The last good checkpoint is {good}. Lower optimizer.lr, enable optimizer.clip_grad or check the data, '
            f'then resume from it with --resume.')


def _record_scores(session: Session, name: str) -> None:
    """Put the scored progress into the epoch's checkpoint: its meta.json when this run saved it, else a new save."""
    checkpoint = os.path.join(checkpoints_root(session.run_dir), name)
    if session.saved_at == session.progress.position() and os.path.isdir(checkpoint):
        if session.accelerator.is_main_process:
            update_progress(checkpoint, session.progress)
    else:  # resumed from another run's checkpoint of this epoch
        _save(session, name)


def _periodic_checkpoint(session: Session) -> bool:
    every = session.config.checkpoint.every_n_steps
    progress = session.progress
    if session.check_run_folder is not None and progress.step % session.config.train.log_interval == 0:
        session.check_run_folder()  # as often as a log line: a stat, and on several processes one broadcast
    at_epoch_end = progress.batch_in_epoch == session.updates_per_epoch * session.config.train.grad_accum_steps
    if every and progress.step % every == 0 and not at_epoch_end:
        return _save(session, f'step_{progress.step:08d}')
    return False


def _save(session: Session, name: str) -> bool:
    """Save a checkpoint unless this state is the last one saved (call on every process); returns whether it did."""
    progress = session.progress
    if session.saved_at == progress.position():
        return False
    if session.check_run_folder is not None:  # never a checkpoint into a folder removed or taken meanwhile
        session.check_run_folder()
    if not weights_finite(session):  # a checkpoint, and so an export, never holds them
        raise NonFiniteLossError(f'the weights are not finite after step {progress.step}: the run diverged, and '
                                 f'they are not saved. {_divergence_advice(session.last_checkpoint)}')
    if progress.batch_in_epoch:
        progress.epoch_totals = session.tally.totals(session.accelerator)
    progress.wall_time_s = session.wall_time_s()
    meta = dict(geometry=dict(session.geometry(), train_images=training_images(session)),
                config=config_to_dict(session.config), data_config=plain_data_config(session.spec.as_dict()),
                time=time.time(), model=dict(name=session.config.model.name, kwargs=session.model_kwargs,
                                             class_names=session.class_names))
    session.last_checkpoint = save_checkpoint(session.run_dir, name, session.training_objects(), progress, meta)
    session.saved_at = progress.position()
    if session.accelerator.is_main_process:
        prune_checkpoints(session.run_dir, session.config.checkpoint.keep_last)
    session.accelerator.wait_for_everyone()
    return True


def _max_over_processes(accelerator, value: float) -> float:
    if accelerator.num_processes == 1:
        return value
    return accelerator.reduce(torch.tensor(value, device=accelerator.device), reduction='max').item()
