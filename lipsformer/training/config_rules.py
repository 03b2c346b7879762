"""What each config value may be, beyond its type, and which combinations cannot work."""
import typing
from typing import Any

from .config_schema import MIXED_PRECISION, SCHEDULERS, Config


class ConfigError(ValueError):
    """A config key, type or value that cannot be used; the message says which and what is allowed."""


# (dotted key, test, what is allowed): value rules checked after the types.
_VALUE_RULES: list[tuple[str, typing.Callable[[Any], bool], str]] = [
    ('model.in_chans', lambda v: v >= 1, 'an integer >= 1'),
    ('model.img_size', lambda v: v is None or v >= 1, 'null or a positive integer'),
    ('model.num_classes', lambda v: v is None or v >= 1, 'null or an integer >= 1'),
    ('model.drop_rate', lambda v: 0 <= v < 1, 'a number in [0, 1)'),
    ('model.drop_path_rate', lambda v: 0 <= v < 1, 'a number in [0, 1)'),
    ('model.compile_mode', lambda v: v in ('default', 'reduce-overhead', 'max-autotune',
                                           'max-autotune-no-cudagraphs'), 'default, reduce-overhead, max-autotune'),
    ('data.num_workers', lambda v: v >= 0, 'an integer >= 0'),
    ('data.train_num_samples', lambda v: v is None or v >= 1, 'null or an integer >= 1'),
    ('data.val_num_samples', lambda v: v is None or v >= 1, 'null or an integer >= 1'),
    ('data.val_batch_size', lambda v: v is None or v >= 1, 'null or an integer >= 1'),
    ('data.crop_pct', lambda v: v is None or 0 < v <= 1, 'null or a number in (0, 1]'),
    ('data.std', lambda v: v is None or all(s > 0 for s in v), 'null or a list of positive numbers'),
    ('data.interpolation', lambda v: v in ('bicubic', 'bilinear', 'nearest', 'random', 'lanczos'),
     'bicubic, bilinear, nearest, lanczos or random'),
    ('augment.scale', lambda v: len(v) == 2 and 0 < v[0] <= v[1] <= 1, 'two numbers 0 < low <= high <= 1'),
    ('augment.ratio', lambda v: len(v) == 2 and 0 < v[0] <= v[1], 'two numbers 0 < low <= high'),
    ('augment.hflip', lambda v: 0 <= v <= 1, 'a probability in [0, 1]'),
    ('augment.vflip', lambda v: 0 <= v <= 1, 'a probability in [0, 1]'),
    ('augment.color_jitter', lambda v: v >= 0, 'a number >= 0'),
    ('augment.auto_augment', lambda v: v is None or v.split('-')[0] in ('rand', 'augmix', 'original', 'originalr',
                                                                        'v0', 'v0r', '3a', 'autoaug'),
     'null or a timm policy string such as rand-m9-mstd0.5-inc1'),
    ('augment.reprob', lambda v: 0 <= v <= 1, 'a probability in [0, 1]'),
    ('augment.recount', lambda v: v >= 1, 'an integer >= 1'),
    ('augment.mixup', lambda v: v >= 0, 'a number >= 0 (0 disables mixup)'),
    ('augment.cutmix', lambda v: v >= 0, 'a number >= 0 (0 disables CutMix)'),
    ('augment.cutmix_minmax', lambda v: v is None or (len(v) == 2 and 0 < v[0] <= v[1] <= 1),
     'null or two numbers 0 < low <= high <= 1'),
    ('augment.mixup_prob', lambda v: 0 <= v <= 1, 'a probability in [0, 1]'),
    ('augment.mixup_switch_prob', lambda v: 0 <= v <= 1, 'a probability in [0, 1]'),
    ('augment.label_smoothing', lambda v: 0 <= v < 1, 'a number in [0, 1)'),
    ('optimizer.lr', lambda v: v > 0, 'a number > 0'),
    ('optimizer.lr_base_batch_size', lambda v: v is None or v >= 1, 'null or an integer >= 1'),
    ('optimizer.weight_decay', lambda v: v >= 0, 'a number >= 0'),
    ('optimizer.no_decay_weight_decay', lambda v: v >= 0, 'a number >= 0'),
    ('optimizer.eps', lambda v: v > 0, 'a number > 0'),
    ('optimizer.betas', lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), 'two numbers in [0, 1)'),
    ('optimizer.momentum', lambda v: 0 <= v < 1, 'a number in [0, 1)'),
    ('optimizer.clip_grad', lambda v: v is None or v >= 0, 'null, 0 (off) or a positive number'),
    ('scheduler.name', lambda v: v in SCHEDULERS, ', '.join(SCHEDULERS)),
    ('scheduler.warmup_epochs', lambda v: v >= 0, 'a number >= 0'),
    ('scheduler.warmup_lr', lambda v: v >= 0, 'a number >= 0'),
    ('scheduler.min_lr', lambda v: v >= 0, 'a number >= 0'),
    ('scheduler.cooldown_epochs', lambda v: v >= 0, 'an integer >= 0'),
    ('scheduler.decay_epochs', lambda v: v > 0, 'a number > 0'),
    ('scheduler.decay_rate', lambda v: v > 0, 'a number > 0'),
    ('ema.decay', lambda v: 0 <= v < 1, 'a number in [0, 1)'),
    ('ema.reference_batch_size', lambda v: v is None or v >= 1, 'null or an integer >= 1'),
    ('train.epochs', lambda v: v >= 1, 'an integer >= 1'),
    ('train.batch_size', lambda v: v >= 1, 'an integer >= 1'),
    ('train.grad_accum_steps', lambda v: v >= 1, 'an integer >= 1'),
    ('train.mixed_precision', lambda v: v is None or v in MIXED_PRECISION, 'null, ' + ', '.join(MIXED_PRECISION)),
    ('train.seed', lambda v: 0 <= v < 2 ** 31, 'an integer in [0, 2**31)'),
    ('train.eval_interval', lambda v: v >= 1, 'an integer >= 1'),
    ('train.log_interval', lambda v: v >= 1, 'an integer >= 1'),
    ('train.max_nonfinite_steps', lambda v: v >= 1, 'an integer >= 1'),
    ('train.cpu_threads', lambda v: v is None or v >= 1, 'null or an integer >= 1'),
    ('checkpoint.every_n_steps', lambda v: v >= 0, 'an integer >= 0 (0: only at epoch ends)'),
    ('checkpoint.keep_last', lambda v: v >= 1, 'an integer >= 1'),
]


def _get_dotted(config: Config, key: str) -> Any:
    value: Any = config
    for part in key.split('.'):
        value = getattr(value, part)
    return value


def check_values(config: Config) -> None:
    """Raise :class:`ConfigError` for the first value outside what its key allows, or an impossible combination."""
    for key, is_allowed, allowed in _VALUE_RULES:
        value = _get_dotted(config, key)
        if not is_allowed(value):
            raise ConfigError(f'{key}: got {value!r}; allowed: {allowed}')
    _check_combinations(config)


def _check_combinations(config: Config) -> None:
    augment, data = config.augment, config.data
    mixing = augment.mixup > 0 or augment.cutmix > 0 or augment.cutmix_minmax is not None
    if mixing and augment.mixup_prob > 0 and augment.mixup_mode != 'elem' and config.train.batch_size % 2:
        raise ConfigError(f'train.batch_size: got {config.train.batch_size}; mixup/CutMix in {augment.mixup_mode!r} '
                          f'mode needs an even batch (or set augment.mixup=0 and augment.cutmix=0)')
    for key in ('mean', 'std'):
        value = getattr(data, key)
        if value is not None and len(value) != config.model.in_chans:
            raise ConfigError(f'data.{key}: got {value!r}, {len(value)} values for model.in_chans='
                              f'{config.model.in_chans}; give one value per input channel')
    img_size = config.model.img_size
    if config.model.name.startswith('lipsformer') and img_size is not None and img_size % 32:
        raise ConfigError(f'model.img_size: got {img_size}; LipsFormer models need a multiple of 32 '
                          f'(e.g. {max(32, round(img_size / 32) * 32)})')
    iterable = data.dataset.split('/')[0].lower() in ('wds', 'hfids', 'tfds')
    if iterable and data.train_num_samples is None:
        raise ConfigError(f'data.train_num_samples: got null; the iterable dataset {data.dataset!r} does not know '
                          f'its length, set it to the number of training images')
    if config.checkpoint.best_metric == 'ema_val_top1' and not config.ema.enabled:
        raise ConfigError('checkpoint.best_metric: got \'ema_val_top1\' with ema.enabled=false; there is no EMA to '
                          'rank checkpoints by, use val_top1 or auto')
    if config.ema.enabled and config.ema.decay == 0:
        raise ConfigError('ema.decay: got 0 with ema.enabled=true; an EMA with decay 0 is the raw model, '
                          'set ema.enabled=false instead')
