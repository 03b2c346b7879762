"""How much the training loop costs on top of the model: images/s of the full loop against a bare step.

    python -m lipsformer.training.overhead --config configs/quickstart.yaml [--updates 60] [key.sub=value ...]

The full loop is :func:`~lipsformer.training.loop.train_epoch` as ``train.py`` runs it: data loading, on-device
normalisation, mixup, autocast, the per-update agreement on non-finite losses and stop signals, EMA, scheduler and
progress logging. The bare step repeats forward, loss, backward and optimizer step on one batch already on the
device. Both run the same model, optimizer and batch size; the first ``--warmup`` updates of each are not timed.
Prints a JSON line.
"""
import argparse
import json
import tempfile
import time

import torch

from ..utils.cli import command_name
from .config_io import load_config
from .loop import train_epoch
from .session import Session, create_accelerator, create_session
from .signals import StopSignal


def time_full_loop(session: Session, updates: int, warmup: int) -> float:
    """Images per second of ``train_epoch`` between update ``warmup`` and update ``updates``."""
    stop, stamps = StopSignal(), []

    def on_update() -> bool:
        _synchronize(session.accelerator.device)
        stamps.append(time.perf_counter())
        if len(stamps) == updates:
            stop.received = 'benchmark'
        return False  # saved no checkpoint

    train_epoch(session, stop, on_update)
    if len(stamps) < updates:
        raise ValueError(f'an epoch has only {len(stamps)} updates; ask for fewer with --updates')
    return (updates - warmup) * session.global_batch / (stamps[-1] - stamps[warmup - 1])


def time_bare_step(session: Session, updates: int, warmup: int) -> float:
    """Images per second of forward + loss + backward + optimizer step on one batch kept on the device."""
    accelerator, model, optimizer = session.accelerator, session.model, session.optimizer
    images, targets = next(session.train_batches.epoch(0))
    if session.mixup is not None:
        images, targets = session.mixup(images, targets)
    model.train()
    for index in range(updates):
        if index == warmup:
            _synchronize(accelerator.device)
            start = time.perf_counter()
        with accelerator.autocast():
            loss = session.train_loss(model(images), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=not session.keeps_own_gradients)  # as the loop does
    _synchronize(accelerator.device)
    return (updates - warmup) * images.shape[0] * accelerator.num_processes / (time.perf_counter() - start)


def _synchronize(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(prog=command_name('lipsformer.training.overhead'), description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--config', required=True)
    parser.add_argument('--updates', type=int, default=60, help='updates per measurement')
    parser.add_argument('--warmup', type=int, default=10, help='untimed updates at the start of each')
    parser.add_argument('overrides', nargs='*', metavar='key.sub=value')
    args = parser.parse_args(argv)
    if not 0 < args.warmup < args.updates:
        parser.error('need 0 < --warmup < --updates')
    config = load_config(args.config, [*args.overrides, 'train.progress_bar=false', 'train.grad_accum_steps=1'])
    with tempfile.TemporaryDirectory() as run_dir:
        accelerator = create_accelerator(config, run_dir)
        session = create_session(config, run_dir, accelerator)
        bare = time_bare_step(session, args.updates, args.warmup)
        full = time_full_loop(session, args.updates, args.warmup)
    result = dict(model=config.model.name, batch_size=config.train.batch_size, processes=accelerator.num_processes,
                  device=str(accelerator.device), bare_step_images_per_s=bare, full_loop_images_per_s=full,
                  overhead_percent=100 * (bare - full) / bare)
    if accelerator.is_main_process:
        print(json.dumps(result))
    return result


if __name__ == '__main__':
    main()
