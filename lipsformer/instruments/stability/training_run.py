"""One run of the stability grid: an arm at a learning rate and seed, trained with resumption and measured per step.

Its folder holds ``config.json`` (the run's settings and torch version; resuming with different ones is refused),
``steps.jsonl``
(one JSON record per optimizer step, appended every log interval), ``checkpoint.pt`` (model, optimizer, scheduler,
RNG and step, replaced atomically; deleted when the run finishes) and ``result.json`` (written atomically last; its
presence means the run is done). A run the grid leaves out (:mod:`.pruning`) has ``not_run.json`` instead, which
training the run later removes.

Per step: training loss, total gradient norm (L2 over all parameters, before the update; no clipping), the largest
per-token L2 norm over all block outputs, and the learning rate. At the first step and every ``bound_every`` steps
after it (only at the first with the default 0): the log10 of the Lipschitz product bound (Theorem 2) over the parts
of the network that have a bound; every ``eval_every`` steps (from the first): the test accuracy and loss. Both are of
the weights the step starts from, so step 1's are those of the initialisation; both are measured again at the end of
a run that did not diverge. A non-finite loss ends the run as diverged at that step.
"""
import itertools
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler

from ...lipschitz import describe, network_bound
from ...lipschitz.norm_sources import MeasuredNorms
from ...utils.env import cpu_details
from ...utils.io import JsonLines, read_json, save_torch, write_json
from .arms import Arm, ModelShape, build_arm_model
from .subsets import Batches, Subsets

__all__ = ['RunFiles', 'RunSettings', 'accuracy_curve', 'machine', 'train_run']

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunSettings:
    """What every run of a grid shares (saved in each run's config.json)."""
    steps: int = 500
    batch_size: int = 64
    train_size: int = 1280
    test_size: int = 2000
    weight_decay: float = 0.05
    min_lr_ratio: float = 0.01  # the cosine decays to lr * this
    warmup_lr_ratio: float = 0.001  # warmup starts at lr * this
    bound_every: int = 0  # 0: the bound at the first step and at the end only
    eval_every: int = 50
    checkpoint_every: int = 50
    log_every: int = 10
    synthetic: bool = False
    dataset: str = 'fashion_mnist'
    shape: ModelShape = field(default_factory=ModelShape)

    def as_dict(self) -> dict[str, Any]:
        settings = asdict(self)
        settings['shape'] = {k: list(v) if isinstance(v, tuple) else v for k, v in settings['shape'].items()}
        return settings


class RunFiles:
    """Paths of one run's files and the reading and writing of its step records."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.config = self.directory / 'config.json'
        self.steps = self.directory / 'steps.jsonl'
        self.checkpoint = self.directory / 'checkpoint.pt'
        self.result = self.directory / 'result.json'
        self.not_run = self.directory / 'not_run.json'

    def done(self) -> bool:
        return self.result.exists()

    def append_steps(self, records: list[dict[str, Any]]) -> None:
        JsonLines(self.steps).append(records)

    def read_steps(self) -> list[dict[str, Any]]:
        return JsonLines(self.steps).read()

    def truncate_steps(self, last_step: int) -> None:
        """Keep the records of steps up to ``last_step`` (those a checkpoint covers); drop a torn last line too."""
        steps = JsonLines(self.steps)
        steps.rewrite(itertools.takewhile(lambda record: record['step'] <= last_step, steps.read()))


class ActivationMonitor:
    """The largest per-token L2 norm over the outputs of the hooked blocks since the last ``take``."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.largest: torch.Tensor | None = None
        self.handles = [block.register_forward_hook(self._hook) for block in blocks]

    def _hook(self, module: nn.Module, inputs: Any, output: torch.Tensor) -> None:
        norm = torch.linalg.vector_norm(output.detach(), dim=-1).max()
        self.largest = norm if self.largest is None else torch.maximum(self.largest, norm)

    def take(self) -> float:
        value = self.largest.item()
        self.largest = None
        return value

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def lipschitz_log10(model: nn.Module, img_size: int) -> dict[str, Any]:
    """log10 of the product bound over the parts that have one, and which parts have none."""
    bound = network_bound(describe(model, (img_size, img_size)), MeasuredNorms('operator'))
    return {'log10_bounded_parts': bound['log10_bounded_parts_product'], 'unbounded_parts': len(bound['unbounded'])}


@torch.no_grad()
def score_test_set(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                   batch_size: int = 500) -> dict[str, float]:
    """Accuracy (a fraction) and mean cross-entropy on the test subset."""
    model.eval()
    correct, loss = 0, 0.0
    for start in range(0, len(labels), batch_size):
        logits = model(images[start:start + batch_size])
        target = labels[start:start + batch_size]
        loss += F.cross_entropy(logits, target, reduction='sum').item()
        correct += (logits.argmax(-1) == target).sum().item()
    model.train()
    return {'test_accuracy': correct / len(labels), 'test_loss': loss / len(labels)}


def _checkpoint(step: int, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: CosineLRScheduler,
                seconds: dict[str, float], machines: list[dict[str, Any]]) -> dict[str, Any]:
    state = {'step': step, 'model': model.state_dict(), 'optimizer': optimizer.state_dict(),
             'scheduler': scheduler.state_dict(), 'seconds': dict(seconds), 'machines': machines,
             'torch_rng': torch.get_rng_state()}
    if torch.cuda.is_available():
        state['cuda_rng'] = torch.cuda.get_rng_state_all()
    return state


def _check_config(files: RunFiles, config: dict[str, Any]) -> None:
    if files.config.exists():
        found = read_json(files.config)
        if found != config:
            raise ValueError(f'{files.directory} was started with other settings ({found}); now {config}. Use '
                             f'another --out, or delete that run folder to restart it.')
    else:
        write_json(files.config, config)


def machine(device: torch.device) -> dict[str, Any]:
    """Where a run trains: the CPU (name, vendor, family, model, stepping, vector ISA), the GPU if it trains on one,
    torch's CPU threads and torch's version."""
    found = {'cpu': cpu_details(), 'threads': torch.get_num_threads(), 'torch': str(torch.__version__)}
    if device.type == 'cuda':
        found['gpu'] = torch.cuda.get_device_name(device)
    return found


def accuracy_curve(steps: list[dict[str, Any]], final_step: int | None = None,
               final_accuracy: float | None = None) -> list[list[float]]:
    """[updates done, test accuracy] at every evaluation of a run's step records, and at its end if it finished."""
    curve = [[record['step'] - 1, record['test_accuracy']] for record in steps if 'test_accuracy' in record]
    if final_accuracy is not None:
        curve.append([final_step, final_accuracy])
    return curve


def _warmup_steps(arm: Arm, batches: Batches, steps: int) -> int:
    """The arm's warmup epochs in steps, cut to leave at least one cosine step in runs too short for them."""
    warmup_steps = arm.warmup_epochs * batches.steps_per_epoch
    if warmup_steps >= steps:
        _logger.warning('%s: %d warmup epochs (%d steps) do not fit in %d steps; warming up for %d', arm.name,
                        arm.warmup_epochs, warmup_steps, steps, steps - 1)
        return steps - 1
    return warmup_steps


def train_run(arm: Arm, lr: float, seed: int, settings: RunSettings, subsets: Subsets, files: RunFiles,
              device: torch.device) -> dict[str, Any]:
    """Train (or resume) one run to its end or divergence; write and return its result.

    Args:
        arm: The arm (model options and warmup).
        lr: Peak learning rate.
        seed: Seed of the initialisation and of the batch order.
        settings: Settings shared by the grid.
        subsets: Train and test tensors, already on ``device``.
        files: The run's folder (claimed by this process).
        device: Where to train.
    """
    config = {'arm': arm.name, 'lr': lr, 'seed': seed, 'settings': settings.as_dict(),
              'model_options': arm.model_options, 'warmup_epochs': arm.warmup_epochs,
              'torch': str(torch.__version__)}
    _check_config(files, config)
    torch.manual_seed(seed)
    model = build_arm_model(arm, settings.shape).to(device)
    batches = Batches(subsets, settings.batch_size, seed)
    warmup_steps = _warmup_steps(arm, batches, settings.steps)
    optimizer = create_optimizer_v2(model, 'adamw', lr=lr, weight_decay=settings.weight_decay)
    scheduler = CosineLRScheduler(
        optimizer, t_initial=settings.steps - warmup_steps, lr_min=lr * settings.min_lr_ratio,
        warmup_t=warmup_steps, warmup_lr_init=lr * settings.warmup_lr_ratio, warmup_prefix=True, t_in_epochs=False)
    start_step, seconds, machines = 0, {'train': 0.0, 'bound': 0.0, 'eval': 0.0}, []
    if files.checkpoint.exists():
        state = torch.load(files.checkpoint, map_location=device, weights_only=True)
        model.load_state_dict(state['model'])
        optimizer.load_state_dict(state['optimizer'])
        scheduler.load_state_dict(state['scheduler'])
        torch.set_rng_state(state['torch_rng'])
        if 'cuda_rng' in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state['cuda_rng'])
        start_step, seconds, machines = state['step'], state['seconds'], state.get('machines', [])
        _logger.info('%s lr %g seed %d: resuming from the checkpoint of step %d', arm.name, lr, seed, start_step)
    # The CPU time this process spends on the run (what other processes on the core cannot inflate, unlike the wall
    # times), carried over a resumption.
    cpu_offset = seconds.pop('cpu', 0.0) - time.process_time()
    files.truncate_steps(start_step)
    here = machine(device)
    if here not in machines:
        machines.append(here)
    monitor = ActivationMonitor([block for stage in model.stages for block in stage.blocks])
    try:
        diverged_step = _train(model, optimizer, scheduler, batches, settings, subsets, files, monitor, start_step,
                               seconds, machines, cpu_offset)
    finally:
        monitor.remove()
    result = {**config, 'diverged': diverged_step is not None, 'diverged_step': diverged_step,
              'warmup_steps': warmup_steps, 'steps_per_epoch': batches.steps_per_epoch}
    if diverged_step is None:
        start = time.perf_counter()
        result.update(score_test_set(model, subsets.test_images, subsets.test_labels))
        seconds['eval'] += time.perf_counter() - start
        start = time.perf_counter()
        result['final_lipschitz'] = lipschitz_log10(model, settings.shape.img_size)
        seconds['bound'] += time.perf_counter() - start
    result['test_curve'] = accuracy_curve(files.read_steps(), settings.steps, result.get('test_accuracy'))
    result.update(seconds={**seconds, 'total': sum(seconds.values()), 'cpu': cpu_offset + time.process_time()},
                  finished_at=time.time(), machine=here, machines=machines)
    write_json(files.result, result)
    files.checkpoint.unlink(missing_ok=True)
    return result


def _finite_or_none(value: float) -> float | None:
    """JSON has no inf or NaN: a non-finite measurement is recorded as null."""
    return value if math.isfinite(value) else None


def _measures_bound(step: int, every: int) -> bool:
    """Whether step ``step`` measures the bound: the first step, and every ``every`` steps after it unless 0."""
    return step == 1 or (every > 0 and (step - 1) % every == 0)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: CosineLRScheduler, batches: Batches,
           settings: RunSettings, subsets: Subsets, files: RunFiles, monitor: ActivationMonitor, start_step: int,
           seconds: dict[str, float], machines: list[dict[str, Any]], cpu_offset: float) -> int | None:
    """Steps ``start_step + 1`` .. ``settings.steps``; the step whose loss was non-finite, or None."""
    model.train()
    parameters = [p for p in model.parameters() if p.requires_grad]
    pending: list[dict[str, Any]] = []
    for step in range(start_step + 1, settings.steps + 1):
        record: dict[str, Any] = {'step': step}
        if _measures_bound(step, settings.bound_every):  # the bound of the weights this step starts from
            start = time.perf_counter()
            record.update(lipschitz_log10(model, settings.shape.img_size))
            seconds['bound'] += time.perf_counter() - start
        if (step - 1) % settings.eval_every == 0:
            start = time.perf_counter()
            record.update(score_test_set(model, subsets.test_images, subsets.test_labels))
            seconds['eval'] += time.perf_counter() - start
        start = time.perf_counter()
        scheduler.step_update(step - 1)
        images, labels = batches(step - 1)
        loss = F.cross_entropy(model(images), labels)
        record.update(lr=optimizer.param_groups[0]['lr'], max_activation_norm=_finite_or_none(monitor.take()))
        if not math.isfinite(loss.item()):
            record.update(loss=None, diverged=True)
            files.append_steps(pending + [record])
            return step
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in parameters if p.grad is not None])
        optimizer.step()
        seconds['train'] += time.perf_counter() - start
        record.update(loss=loss.item(), grad_norm=_finite_or_none(grad_norm.item()))
        pending.append(record)
        if step % settings.log_every == 0 or step % settings.checkpoint_every == 0 or step == settings.steps:
            files.append_steps(pending)
            pending = []
        if step % settings.checkpoint_every == 0 and step < settings.steps:
            cpu = {'cpu': cpu_offset + time.process_time()}
            save_torch(_checkpoint(step, model, optimizer, scheduler, seconds | cpu, machines), files.checkpoint)
    return None
