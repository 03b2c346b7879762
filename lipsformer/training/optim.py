"""Optimizer, schedule, losses, mixup and EMA built from timm, with the paper's batch-size scaling.

Adam and AdamW run torch's fused kernel (``fused=True``: one launch updates every parameter) where the parameters live
on a CUDA device, and its multi-tensor (``foreach``) form elsewhere: on the CPU the recipes keep what they were measured
with. Both are the same update (tests/test_optim.py); a checkpoint saved by one resumes into the other.
"""
import logging
import math

import torch
from timm.data import Mixup
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2, param_groups_weight_decay
from timm.scheduler import create_scheduler_v2
from timm.scheduler.scheduler import Scheduler

from .config import Config

_logger = logging.getLogger(__name__)

# timm's names of the optimizers it builds as torch.optim.Adam / AdamW, which take fused=True
FUSED_OPTIMIZERS = ('adam', 'adamw')
# where the fused kernel is chosen by default; other devices keep the multi-tensor form
FUSED_DEVICE_TYPES = ('cuda',)


def global_batch_size(config: Config, num_processes: int) -> int:
    """Images per optimizer update over all processes."""
    return config.train.batch_size * config.train.grad_accum_steps * num_processes


def lr_scale(config: Config, global_batch: int) -> float:
    """Factor applied to lr, warmup_lr and min_lr, which the config gives for ``optimizer.lr_base_batch_size``."""
    base = config.optimizer.lr_base_batch_size
    if base is None:
        return 1.0
    ratio = global_batch / base
    return ratio if config.optimizer.lr_scaling == 'linear' else math.sqrt(ratio)


def fused_by_default(name: str, device_types: set[str]) -> bool:
    """Whether optimizer ``name`` runs torch's fused kernel for parameters on ``device_types``: Adam or AdamW with
    every parameter on a CUDA device (:data:`FUSED_DEVICE_TYPES`) that torch has fused kernels for."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices  # torch's own list of such devices
    supported = set(_get_fused_kernels_supported_devices()) & set(FUSED_DEVICE_TYPES)
    return name.lower() in FUSED_OPTIMIZERS and bool(device_types) and device_types <= supported


def create_optimizer(model: torch.nn.Module, config: Config, global_batch: int,
                     fused: bool | None = None) -> torch.optim.Optimizer:
    """timm's optimizer over two parameter groups: weight matrices decay, everything else (1-D parameters such as
    norms, biases and alpha, plus the model's ``no_weight_decay()`` names such as position tables) decays with
    ``optimizer.no_decay_weight_decay`` (0 in the paper, 5e-4 in the authors' code). With ``optimizer.layer_decay``
    timm's ``create_optimizer_v2(model, layer_decay=...)`` makes those two groups per layer of the model's
    ``group_matcher()``, each with its ``lr_scale`` (which the schedule applies).

    Args:
        model: The model, on the device it trains on.
        config: The run's config (``optimizer.*``).
        global_batch: Images per update over all processes (for ``optimizer.lr_base_batch_size``).
        fused: Run torch's fused Adam / AdamW kernel; None: :func:`fused_by_default` for the parameters' devices.
    """
    opt = config.optimizer
    settings = dict(opt=opt.name, lr=opt.lr * lr_scale(config, global_batch), momentum=opt.momentum, eps=opt.eps,
                    betas=tuple(opt.betas))
    if fused is None:
        fused = fused_by_default(opt.name, {parameter.device.type for parameter in model.parameters()})
    if fused:
        settings['fused'] = True
    _logger.info('optimizer %s: %s', opt.name, 'fused kernel' if fused else 'multi-tensor form where torch has one')
    # timm marks the decaying groups with the weight decay it is given and the others with 0: given 1, they are told
    # apart, then set to the two configured decays
    if opt.layer_decay is not None:
        optimizer = create_optimizer_v2(model, weight_decay=1.0, layer_decay=opt.layer_decay, **settings)
        _set_weight_decays(optimizer.param_groups, config)
        optimizer.defaults['weight_decay'] = opt.weight_decay
        return optimizer
    no_decay_names = model.no_weight_decay() if hasattr(model, 'no_weight_decay') else ()
    groups = param_groups_weight_decay(model, 1.0, no_weight_decay_list=no_decay_names)
    _set_weight_decays(groups, config)
    return create_optimizer_v2(groups, weight_decay=opt.weight_decay, **settings)


def _set_weight_decays(groups: list[dict], config: Config) -> None:
    """Each group marked 1 (by timm, given weight_decay=1) decays with optimizer.weight_decay, the others with
    optimizer.no_decay_weight_decay."""
    for group in groups:
        group['weight_decay'] = config.optimizer.weight_decay if group['weight_decay'] else \
            config.optimizer.no_decay_weight_decay


def scheduled_lr(optimizer: torch.optim.Optimizer) -> float:
    """The schedule's current learning rate: that of a group without a layer-decay scale below 1 (the head's)."""
    group = max(optimizer.param_groups, key=lambda group: group.get('lr_scale', 1.0))
    return group['lr'] / group.get('lr_scale', 1.0)


def create_scheduler(optimizer: torch.optim.Optimizer, config: Config, updates_per_epoch: int,
                     global_batch: int) -> Scheduler:
    """timm's schedule counted in optimizer updates (``step_update`` after each), warmup 0 unless configured."""
    sched = config.scheduler
    scale = lr_scale(config, global_batch)
    scheduler, _ = create_scheduler_v2(
        optimizer, sched=sched.name, num_epochs=config.train.epochs, decay_epochs=sched.decay_epochs,
        decay_milestones=sched.decay_milestones, cooldown_epochs=sched.cooldown_epochs, decay_rate=sched.decay_rate,
        min_lr=sched.min_lr * scale, warmup_lr=sched.warmup_lr * scale, warmup_epochs=sched.warmup_epochs,
        step_on_epochs=False, updates_per_epoch=updates_per_epoch)
    return scheduler


def total_epochs(config: Config) -> int:
    """Epochs the run lasts: the schedule plus its cooldown."""
    return config.train.epochs + config.scheduler.cooldown_epochs


def create_mixup(config: Config, num_classes: int) -> Mixup | None:
    """timm's Mixup/CutMix (with label smoothing folded into its soft targets), or None when switched off."""
    augment = config.augment
    active = augment.mixup > 0 or augment.cutmix > 0 or augment.cutmix_minmax is not None
    if not active or augment.mixup_prob == 0:
        return None
    return Mixup(mixup_alpha=augment.mixup, cutmix_alpha=augment.cutmix,
                 cutmix_minmax=tuple(augment.cutmix_minmax) if augment.cutmix_minmax else None,
                 prob=augment.mixup_prob, switch_prob=augment.mixup_switch_prob, mode=augment.mixup_mode,
                 label_smoothing=augment.label_smoothing, num_classes=num_classes)


def create_train_loss(config: Config, mixup: Mixup | None) -> torch.nn.Module:
    """Soft-target cross entropy after mixup, else (label-smoothed) cross entropy."""
    if mixup is not None:
        return SoftTargetCrossEntropy()
    if config.augment.label_smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=config.augment.label_smoothing)
    return torch.nn.CrossEntropyLoss()


def ema_decay(config: Config, global_batch: int) -> float:
    """The per-update EMA decay for this global batch, keeping the averaging horizon (in images) of the
    configured decay at ``ema.reference_batch_size``."""
    reference = config.ema.reference_batch_size
    if reference is None:
        return config.ema.decay
    return config.ema.decay ** (global_batch / reference)


def best_metric_name(config: Config) -> str:
    """The metrics key that ranks checkpoints (``checkpoint.best_metric``, with ``auto`` resolved)."""
    if config.checkpoint.best_metric == 'auto':
        return 'ema_val_top1' if config.ema.enabled else 'val_top1'
    return config.checkpoint.best_metric
