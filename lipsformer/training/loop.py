"""One training epoch, one evaluation pass, and the alpha statistics logged after each epoch.

Accumulation is explicit: gradients are synchronised only on the last micro-batch of each window
(``accelerator.no_sync`` before it), epochs hold whole windows, and checkpoints fall on window boundaries, so a
resumed run splits its batches into the same windows. The host synchronises once per update, to agree across
processes on a non-finite loss or a stop signal; the running loss stays on the device between log lines. Every stop
decision (after an update, between epochs, between evaluation batches) is agreed by all processes, so none of them
waits in a collective operation that the others have left.
"""
import logging
import math
import re
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from timm.utils import accuracy
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from ..data import skipped_images
from .optim import scheduled_lr
from .session import Session
from .signals import StopSignal
from .train_state import Progress

_logger = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The run diverged: too many consecutive updates had a non-finite loss (counted across epochs), or the weights
    or the validation loss are no longer finite; the message names the step and the last good checkpoint."""


@dataclass
class EpochResult:
    """What one call of :func:`train_epoch` did: the epoch's mean loss (over its finite losses; NaN when none was),
    images, seconds and unreadable images skipped (a resumed epoch's included), whether it ran to its end (a stop
    on its last update still completes it), and the images and seconds of the micro-batches that compiled the
    model (one a start of a compiled run, left out of :meth:`images_per_s`)."""
    loss: float
    images: int
    seconds: float
    completed: bool
    skipped: int = 0
    compile_images: int = 0
    compile_seconds: float = 0.0

    def images_per_s(self) -> float:
        """The epoch's training speed, the micro-batches that compiled left out (NaN when they were all it had)."""
        return _speed(self.images, self.seconds, self.compile_images, self.compile_seconds)


def _speed(images: int, seconds: float, compile_images: int, compile_seconds: float) -> float:
    """Images a second once the micro-batches that compiled are left out; NaN where nothing else was trained."""
    timed = images - compile_images
    return timed / max(seconds - compile_seconds, 1e-9) if timed > 0 else float('nan')


@dataclass
class EpochTally:
    """Running totals of an epoch, kept on the device so that logging does not synchronise every step.

    A mid-epoch checkpoint saves them (:meth:`totals`) and a resumed epoch starts from them.
    """
    loss_sum: torch.Tensor
    loss_count: torch.Tensor
    window_bad: torch.Tensor
    window_loss: torch.Tensor  # the current update's loss, summed over its micro-batches
    start_time: float
    images: int = 0
    earlier_seconds: float = 0.0
    skipped_so_far: Callable[[], int] = lambda: 0  # this process's count of unreadable images skipped
    skipped_at_start: int = 0
    earlier_skipped: int = 0
    compile_images: int = 0  # the micro-batches that compiled the model (one a start), earlier starts' included
    compile_seconds: float = 0.0

    @classmethod
    def start(cls, device: torch.device, progress: Progress, is_main: bool,
              skipped_so_far: Callable[[], int] = lambda: 0) -> 'EpochTally':
        zero = torch.zeros((), device=device)
        tally = cls(zero.clone(), zero.clone(), torch.zeros((), dtype=torch.bool, device=device), zero.clone(),
                    time.perf_counter(), skipped_so_far=skipped_so_far, skipped_at_start=skipped_so_far())
        if progress.batch_in_epoch and progress.epoch_totals:
            # older checkpoints hold 4 values (no skipped count) or 5 (no compiling micro-batches)
            loss_sum, loss_count, images, seconds, *later = progress.epoch_totals
            if is_main:  # the saved sums are over all processes
                tally.loss_sum += loss_sum
                tally.loss_count += loss_count
                tally.earlier_skipped = int(later[0]) if later else 0
            tally.images, tally.earlier_seconds = int(images), seconds
            if len(later) >= 3:
                tally.compile_images, tally.compile_seconds = int(later[1]), later[2]
        return tally

    def seconds(self) -> float:
        """The epoch's seconds so far, of the starts before a resume too."""
        return self.earlier_seconds + time.perf_counter() - self.start_time

    def images_per_s(self) -> float:
        """The epoch's speed so far: its images over its seconds, of the starts before a resume too, the micro-batches
        that compiled the model left out (NaN while they are all it trained)."""
        return _speed(self.images, self.seconds(), self.compile_images, self.compile_seconds)

    def mean_loss(self) -> torch.Tensor:
        """The mean of the epoch's finite losses so far; NaN while there is none (never a made-up 0)."""
        return torch.where(self.loss_count > 0, self.loss_sum / self.loss_count.clamp(min=1), float('nan'))

    def totals(self, accelerator) -> list[float]:
        """Loss sum and count over all processes, images, seconds, unreadable images skipped (over all processes),
        and the images and seconds of the micro-batches that compiled, of the epoch so far (call on every process)."""
        skipped = self.skipped_so_far() - self.skipped_at_start + self.earlier_skipped
        sums = torch.stack([self.loss_sum, self.loss_count, torch.tensor(float(skipped), device=self.loss_sum.device)])
        if accelerator.num_processes > 1:
            sums = accelerator.reduce(sums, reduction='sum')
        loss_sum, loss_count, skipped = sums.tolist()
        return [loss_sum, loss_count, self.images, self.seconds(), int(skipped), self.compile_images,
                self.compile_seconds]


def train_epoch(session: Session, stop: StopSignal, on_update: Callable[[], bool]) -> EpochResult:
    """Train the rest of ``session.progress.epoch``, from ``progress.batch_in_epoch``.

    Args:
        session: The run; ``session.tally`` holds the epoch's running totals while it trains.
        stop: Polled after each update; when set (on any process) the epoch ends after that update.
        on_update: Called after every update (periodic checkpoints); returns whether it saved a checkpoint, after
            which a stop requested meanwhile ends the epoch at once, without another update.

    Raises:
        NonFiniteLossError: ``train.max_nonfinite_steps`` consecutive updates had a non-finite loss (counted across
            epochs: ``progress.nonfinite_in_a_row``).
    """
    accelerator = session.accelerator
    dataset = session.train_batches.dataset  # not the session: a closure over it would keep it alive in a cycle
    tally = session.tally = EpochTally.start(accelerator.device, session.progress, accelerator.is_main_process,
                                             lambda: skipped_images(dataset))
    session.model.train()
    bar = _progress_bar(session)
    with logging_redirect_tqdm(loggers=[logging.getLogger('lipsformer')]) if bar is not None else nullcontext():
        _train_batches(session, stop, on_update, tally, bar)
    if bar is not None:
        bar.close()
    loss_sum, loss_count, images, seconds, skipped, compile_images, compile_seconds = tally.totals(accelerator)
    completed = session.progress.batch_in_epoch == session.updates_per_epoch * session.config.train.grad_accum_steps
    return EpochResult(loss=loss_sum / loss_count if loss_count else float('nan'), images=int(images), seconds=seconds,
                       completed=completed, skipped=skipped, compile_images=compile_images,
                       compile_seconds=compile_seconds)


def stop_agreed(accelerator, stop: StopSignal) -> bool:
    """Whether any process has been asked to stop (a collective operation: call it on every process)."""
    if accelerator.num_processes == 1:
        return stop.requested
    flag = torch.tensor(float(stop.requested), device=accelerator.device)
    return bool(accelerator.reduce(flag, reduction='max').item())


def _train_batches(session: Session, stop: StopSignal, on_update: Callable[[], bool], tally: EpochTally,
                   bar: tqdm | None) -> None:
    """The micro-batch loop of :func:`train_epoch`, until the epoch's end or an agreed stop."""
    progress, accum = session.progress, session.config.train.grad_accum_steps
    batches = session.train_batches.epoch(progress.epoch, start_batch=progress.batch_in_epoch)
    for batch_index in range(progress.batch_in_epoch, session.updates_per_epoch * accum):
        images, targets = next(batches)
        timed = session.compiled and session.first_step_s is None
        started = time.perf_counter()
        loss = _forward_backward(session, images, targets, last_in_window=(batch_index + 1) % accum == 0)
        if timed:
            _record_compile_time(session, tally, started, images.shape[0] * session.accelerator.num_processes)
        finite = torch.isfinite(loss)
        tally.window_bad |= ~finite
        tally.loss_sum += torch.where(finite, loss, 0.0)
        tally.window_loss += loss
        tally.loss_count += finite.float()
        tally.images += images.shape[0] * session.accelerator.num_processes
        progress.batch_in_epoch = batch_index + 1
        if progress.batch_in_epoch % accum:
            continue
        bad, stopped = _agree(session.accelerator, tally.window_bad, stop)
        reporting = (progress.step + 1) % session.config.train.log_interval == 0
        grad_norm = None
        if bad:
            _skip_update(session)
        else:
            progress.nonfinite_in_a_row = 0
            grad_norm = _apply_update(session, measure_grad_norm=reporting)
        lr = scheduled_lr(session.optimizer)  # the lr this update used
        tally.window_bad.zero_()
        progress.step += 1
        session.scheduler.step_update(num_updates=progress.step)
        if bar is not None:
            bar.update(accum)
        if reporting:
            _report(session, bar, tally, lr, grad_norm)
        tally.window_loss.zero_()
        saved = on_update()
        if stopped or (saved and stop_agreed(session.accelerator, stop)):
            return


def _forward_backward(session: Session, images: torch.Tensor, targets: torch.Tensor,
                      last_in_window: bool) -> torch.Tensor:
    """Loss of one micro-batch, back-propagated (gradients synchronised only on a window's last micro-batch)."""
    accelerator = session.accelerator
    if session.mixup is not None:
        images, targets = session.mixup(images, targets)
    if session.config.model.channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    with nullcontext() if last_in_window else accelerator.no_sync(session.model):
        with accelerator.autocast(), session.casting_weights():
            loss = session.train_loss(session.model(images), targets)
        accelerator.backward(loss / session.config.train.grad_accum_steps)
    return loss.detach().float()


def _record_compile_time(session: Session, tally: EpochTally, started: float, images: int) -> None:
    """Log the seconds since ``started`` of this start's first compiled micro-batch (its compilation included) and
    keep them for summary.json, and with its ``images`` in the epoch's tally, whose speed leaves them out."""
    if session.accelerator.device.type != 'cpu':  # the time the device took too, not only the launches
        torch.accelerator.synchronize()
    seconds = session.first_step_s = time.perf_counter() - started
    tally.compile_images += images
    tally.compile_seconds += seconds
    record = session.compile_record()
    _logger.info('compiled the training step (scope %s, mode %s): the first micro-batch took %.1f s, compilation '
                 'included; the epoch\'s images_per_s leaves it out', record['scope'], record['mode'], seconds)


def _agree(accelerator, window_bad: torch.Tensor, stop: StopSignal) -> tuple[bool, bool]:
    """Whether any process saw a non-finite loss in this window, and whether any process was asked to stop."""
    flags = torch.stack([window_bad.float(), torch.tensor(float(stop.requested), device=window_bad.device)])
    if accelerator.num_processes > 1:
        flags = accelerator.reduce(flags, reduction='max')
    bad, stopped = flags.tolist()
    return bool(bad), bool(stopped)


def _apply_update(session: Session, measure_grad_norm: bool) -> float | None:
    """Clip, step, constrain and average; returns the global gradient norm before clipping when measured (a
    synchronisation, so only on reported updates) or when clipping by norm computes it anyway."""
    accelerator, clip = session.accelerator, session.config.optimizer.clip_grad
    norm = None
    if clip and session.config.optimizer.clip_mode == 'norm':
        norm = accelerator.clip_grad_norm_(session.model.parameters(), clip)
    elif clip:
        if measure_grad_norm:  # before clipping each value, as clipping by norm reports it
            norm = accelerator.clip_grad_norm_(session.model.parameters(), float('inf'))
        accelerator.clip_grad_value_(session.model.parameters(), clip)
    elif measure_grad_norm:  # an infinite threshold scales nothing: the norm of the unscaled gradients
        norm = accelerator.clip_grad_norm_(session.model.parameters(), float('inf'))
    session.optimizer.step()
    session.optimizer.zero_grad(set_to_none=not session.keeps_own_gradients)
    if accelerator.optimizer_step_was_skipped:  # fp16 loss scaler found inf gradients and lowered its scale
        return None
    if session.lipschitz is not None:  # before the EMA update, so the EMA averages constrained weights
        session.lipschitz()
    if session.ema is not None:
        session.ema.update(session.unwrapped_model, step=session.progress.step)
    return float(norm) if measure_grad_norm and norm is not None else None


def _skip_update(session: Session) -> None:
    """Drop the window's gradients; stop the run after too many consecutive non-finite windows, wherever the epochs
    end between them (a short epoch must not hide a divergence)."""
    session.optimizer.zero_grad(set_to_none=not session.keeps_own_gradients)
    progress, limit = session.progress, session.config.train.max_nonfinite_steps
    progress.nonfinite_total += 1
    progress.nonfinite_in_a_row += 1
    consecutive = progress.nonfinite_in_a_row
    step, epoch = progress.step + 1, progress.epoch + 1  # the update being skipped, counted from 1 as in the logs
    _logger.warning('non-finite loss at step %d (epoch %d): update skipped (%d in a row, %d in all)',
                    step, epoch, consecutive, progress.nonfinite_total)
    if consecutive >= limit:
        last = session.last_checkpoint or 'none (no checkpoint was saved before this)'
        raise NonFiniteLossError(
            f'the loss was not finite for {consecutive} consecutive updates, the last at step {step} '
            f'(epoch {epoch}); stopping. The last good checkpoint is {last}. Lower optimizer.lr, enable '
            f'optimizer.clip_grad or check the data, then resume from it with --resume.')


def weights_finite(session: Session) -> bool:
    """Whether every weight of the model is finite on every process (a collective operation: call it on every
    process; a sharded model's processes each check their shards)."""
    shards = [parameter.to_local() if hasattr(parameter, 'to_local') else parameter  # FSDP2's DTensor: this shard
              for parameter in session.model.parameters()]
    checks = [torch.isfinite(shard.detach()).all() for shard in shards if shard.numel()]
    finite = torch.stack(checks).all() if checks else torch.tensor(True)
    flag = finite.float().to(session.accelerator.device)
    if session.accelerator.num_processes > 1:
        flag = session.accelerator.reduce(flag, reduction='min')
    return bool(flag.item())


def _progress_bar(session: Session) -> tqdm | None:
    """A tqdm bar on the main process when its stderr is a terminal (log files get the log lines only)."""
    if not (session.config.train.progress_bar and session.accelerator.is_main_process and sys.stderr.isatty()):
        return None
    total = session.updates_per_epoch * session.config.train.grad_accum_steps
    return tqdm(total=total, initial=session.progress.batch_in_epoch, desc=f'epoch {session.progress.epoch + 1}',
                unit='batch', dynamic_ncols=True, leave=False)


def _report(session: Session, bar: tqdm | None, tally: EpochTally, lr: float, grad_norm: float | None) -> None:
    """A progress line and the trackers' step metrics: this update's loss (mean over its micro-batches and the
    processes), the lr it used and the gradient norm before clipping (absent after a skipped update)."""
    accelerator, step = session.accelerator, session.progress.step
    step_loss = tally.window_loss / session.config.train.grad_accum_steps
    if accelerator.num_processes > 1:
        step_loss = accelerator.reduce(step_loss, reduction='mean')
    step_loss, loss = step_loss.item(), tally.mean_loss().item()
    speed = tally.images_per_s()
    if bar is not None:
        bar.set_postfix(loss=f'{loss:.4f}', lr=f'{lr:.3g}', img_s=f'{speed:.0f}' if math.isfinite(speed) else '-')
    values = {'train/step_loss': step_loss, 'train/lr': lr}
    if math.isfinite(speed):  # NaN while only the micro-batch that compiled has trained
        values['train/images_per_s'] = speed
    if grad_norm is not None:
        values['train/grad_norm'] = grad_norm
    accelerator.log(values, step=step)
    if accelerator.is_main_process:
        _logger.info('epoch %d step %d: loss %.4f (this update %.4f) lr %.4g grad norm %s %s',
                     session.progress.epoch + 1, step, loss, step_loss, lr,
                     'skipped' if grad_norm is None else f'{grad_norm:.4g}',
                     f'{speed:.0f} img/s' if math.isfinite(speed) else 'img/s from the next update (this one compiled)')


@torch.no_grad()
def validate(model: torch.nn.Module, loader, accelerator, stop: StopSignal | None = None,
             pad_batches: bool = False) -> dict[str, float] | None:
    """Top-1 / top-5 accuracy (percent) and mean loss over the whole validation set, all processes together.

    Targets of -1 (padding, unreadable images) are left out; ``samples`` is the number of images counted, ``skipped``
    the number of unreadable images left out. Returns None, without finishing, when a stop is requested (checked
    before every batch, agreed across processes). ``pad_batches`` pads a partial batch to the loader's batch size
    (black images labelled -1), for a model compiled with static shapes.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device  # an EMA kept on the CPU (ema.cpu) is evaluated there
    dataset = getattr(getattr(loader, 'loader', loader), 'dataset', None)  # through timm's PrefetchLoader
    skipped_before = skipped_images(dataset)
    sums = torch.zeros(4, dtype=torch.float64, device=accelerator.device)  # top-1 hits, top-5 hits, loss, count
    for images, targets in loader:
        if stop is not None and stop_agreed(accelerator, stop):
            model.train(was_training)
            return None
        if pad_batches:
            images, targets = _padded(images, targets, getattr(loader, 'loader', loader).batch_size)
        with accelerator.autocast():
            logits = model(images.to(device)).float().to(targets.device)
        keep = targets >= 0
        logits, targets = logits[keep], targets[keep]
        count = targets.numel()
        if count == 0:
            continue
        top1, top5 = accuracy(logits, targets, topk=(1, min(5, logits.shape[1])))
        loss = torch.nn.functional.cross_entropy(logits, targets, reduction='sum')
        sums += torch.stack([top1 * count / 100, top5 * count / 100, loss, torch.tensor(count, device=sums.device)]
                            ).to(sums)
    sums = torch.cat([sums, torch.tensor([skipped_images(dataset) - skipped_before], dtype=sums.dtype,
                                         device=sums.device)])
    sums = accelerator.reduce(sums, reduction='sum') if accelerator.num_processes > 1 else sums
    top1_hits, top5_hits, loss_sum, count, skipped = sums.tolist()
    model.train(was_training)
    denominator = max(count, 1)
    return dict(top1=100 * top1_hits / denominator, top5=100 * top5_hits / denominator, loss=loss_sum / denominator,
                samples=int(count), skipped=int(skipped))


def _padded(images: torch.Tensor, targets: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch filled up to ``batch_size`` with zero images labelled -1 (left out of the scores)."""
    missing = batch_size - images.shape[0]
    if missing <= 0:
        return images, targets
    return (torch.cat([images, images.new_zeros((missing, *images.shape[1:]))]),
            torch.cat([targets, targets.new_full((missing,), -1)]))


# The weighted-residual scales: alpha1 / alpha2 of attention and MLP, conv_shortcuts.N.alpha of the conv branches.
_ALPHA_PARAM = re.compile(r'(?:^|\.)alpha\d*\.gamma$')
_STAGE = re.compile(r'(?:^|\.)(?:layers|stages)\.(\d+)\.')


def alpha_statistics(model: torch.nn.Module) -> dict[str, float]:
    """Mean and standard deviation of every alpha entry per stage, as ``alpha/stage<i>/mean`` and ``.../std``.

    Models without alpha parameters give an empty dict.
    """
    per_stage: dict[str, list[torch.Tensor]] = defaultdict(list)
    for name, param in model.named_parameters():
        if _ALPHA_PARAM.search(name):
            match = _STAGE.search(name)
            per_stage[f'stage{match.group(1)}' if match else 'other'].append(param.detach().float().flatten())
    stats = {}
    for stage, values in sorted(per_stage.items()):
        flat = torch.cat(values)
        if flat.numel() == 0:  # a shard without this stage's alphas (FSDP)
            continue
        stats[f'alpha/{stage}/mean'] = flat.mean().item()
        stats[f'alpha/{stage}/std'] = flat.std().item() if flat.numel() > 1 else 0.0
    return stats
