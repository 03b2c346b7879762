"""The training config: every key with its type, default, documentation and the values it allows, in one place.

Each section is a dataclass; a field's metadata holds its ``help`` (``configs/reference.yaml`` is generated from it by
:func:`~lipsformer.training.config_io.reference_yaml`) and its :class:`Rule`, checked by :func:`check_config` after
the types (which :mod:`~lipsformer.training.config_io` checks against the annotations while reading). Learning rates
and the EMA decay are stated for a reference global batch (2048 in the paper) and rescaled to the actual global batch
(``batch_size x processes x grad_accum_steps``) when the run starts.
"""
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ['TRACKERS', 'Config', 'ConfigError', 'NotFiniteError', 'Rule', 'check_config', 'check_finite',
           'not_finite_message']

SCHEDULERS = ('cosine', 'tanh', 'step', 'multistep', 'poly')
TRACKERS = ('tensorboard', 'wandb', 'mlflow')
_AUTO_AUGMENT_POLICIES = ('rand', 'augmix', 'original', 'originalr', 'v0', 'v0r', '3a', 'autoaug')


class ConfigError(ValueError):
    """A config key, type or value that cannot be used; the message says which and what is allowed."""


class NotFiniteError(ConfigError):
    """A number where the key takes one, but infinite or NaN: nothing a run could train, schedule or bound with."""


def not_finite_message(key: str, value: Any, allowed: str | None = None) -> str:
    """What :class:`NotFiniteError` says: the dotted key, the value as given and what to write instead."""
    where = f' ({allowed})' if allowed else ''
    return f'{key}: got {value!r}; expected a finite number{where}: .inf, .nan and numbers beyond 1.8e308 are not'


def check_finite(key: str, value: Any, allowed: str | None = None) -> None:
    """Raise :class:`NotFiniteError` for an infinite or NaN float anywhere in ``value``: a number, or the lists and
    mappings (keys included) of a key such as ``augment.scale`` or ``model.kwargs``, named by its dotted key."""
    if isinstance(value, float) and not math.isfinite(value):
        raise NotFiniteError(not_finite_message(key, value, allowed))
    if isinstance(value, dict):
        for name, item in value.items():
            check_finite(f'{key} (a key)', name)
            check_finite(f'{key}.{name}', item)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_finite(f'{key}[{index}]', item, allowed)


@dataclass(frozen=True)
class Rule:
    """What a key's value may be beyond its type: a test, and the words that say what passes it."""
    test: Callable[[Any], bool]
    allowed: str


def _at_least(low: int, kind: str = 'an integer') -> Rule:
    return Rule(lambda v: v >= low, f'{kind} >= {low}')


def _above(low: float) -> Rule:
    return Rule(lambda v: v > low, f'a number > {low}')


def _one_of(*choices: str) -> Rule:
    return Rule(lambda v: v in choices, ', '.join(choices))


def _optional(rule: Rule) -> Rule:
    return Rule(lambda v: v is None or rule.test(v), f'null or {rule.allowed}')


def _ordered_pair(upper: float | None = None) -> Rule:
    """Two numbers 0 < low <= high (<= upper)."""
    return Rule(lambda v: len(v) == 2 and 0 < v[0] <= v[1] and (upper is None or v[1] <= upper),
                'two numbers 0 < low <= high' + ('' if upper is None else f' <= {upper:g}'))


_POSITIVE_INT = _at_least(1)
_NON_NEGATIVE = _at_least(0, 'a number')
_FRACTION = Rule(lambda v: 0 <= v < 1, 'a number in [0, 1)')
_PROBABILITY = Rule(lambda v: 0 <= v <= 1, 'a probability in [0, 1]')


def _key(default: Any, help_text: str, rule: Rule | None = None) -> Any:
    """A config field with its documentation and value rule; mutable defaults are copied per instance."""
    metadata = {'help': help_text, 'rule': rule}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelConfig:
    """Which network to train and how it is built."""
    name: str = _key('lipsformer_cswin_tiny', 'timm model name; `import lipsformer` registers lipsformer_* models.')
    kwargs: dict[str, Any] = _key({}, 'Extra architecture arguments for timm.create_model (embed_dim, depths, '
                                      'num_heads, window_size / split_size, mlp_ratio, alpha_init, tau, ...).')
    img_size: int | None = _key(None, 'Square input resolution for training and evaluation; null: the model\'s '
                                      'default. LipsFormer models need a multiple of 32.', _optional(_POSITIVE_INT))
    in_chans: int = _key(3, 'Input channels (1 for grayscale data such as Fashion-MNIST).', _POSITIVE_INT)
    num_classes: int | None = _key(None, 'Classifier outputs; null: the number of classes in the training set.',
                                   _optional(_POSITIVE_INT))
    drop_rate: float = _key(0.0, 'Dropout before the classifier.', _FRACTION)
    drop_path_rate: float = _key(0.1, 'Stochastic depth rate of the last block (rises linearly from 0).', _FRACTION)
    pretrained: bool = _key(False, 'Start from the model\'s default pretrained weights (timm pretrained=True).')
    init_checkpoint: str | None = _key(None, 'Start from the weights in this file (fine-tuning); any layout '
                                             'lipsformer.weights.weight_files.load_model_weights reads. Not a resume.')
    grad_checkpointing: bool = _key(False, 'Recompute activations in the backward pass to save memory.')
    channels_last: bool = _key(False, 'Use the channels-last memory format (faster convolutions on GPUs).')
    compile: bool | Literal['auto'] = _key(
        'auto', 'torch.compile the model with inductor (through Accelerate\'s dynamo plugin): auto compiles on a CUDA '
                'device, not on the CPU; true or false decide for any device. The first step compiles (its seconds '
                'are logged and in summary.json).', Rule(lambda v: v in ('auto', True, False), 'auto, true or false'))
    compile_mode: str = _key('default', 'torch.compile mode: default; max-autotune-no-cudagraphs (tries more kernels '
                                        'while compiling, for a long run); reduce-overhead (CUDA graphs: removes the '
                                        'host\'s launch cost from a step bound by it; static shapes, so evaluation '
                                        'batches are padded); max-autotune (both).',
                             _one_of('default', 'reduce-overhead', 'max-autotune', 'max-autotune-no-cudagraphs'))
    compile_scope: str = _key('regional', 'What torch.compile compiles: regional (each LipsFormer block, compiled once '
                                          'for all the blocks of its shape: a fraction of the compile time) or whole '
                                          '(the whole model, through Accelerate\'s dynamo plugin).',
                              _one_of('regional', 'whole'))


@dataclass
class DataConfig:
    """Where images come from and how they are loaded."""
    dataset: str = _key('', 'timm dataset: "" for an ImageFolder or tar tree, "hfds/<name>" (Hugging Face), '
                            '"hfids/<name>" (streamed), "wds/<name>" (WebDataset shards), "torch/<name>" '
                            '(torchvision, e.g. torch/fashion_mnist).')
    data_dir: str | None = _key(None, 'Dataset root (train.py --data-dir sets it).')
    train_split: str = _key('train', 'Split (or sub-folder) used for training; its class folders number the classes '
                                     'of every split. A split that is not there is an error (timm\'s synonyms, '
                                     'such as training for train, are found too).')
    val_split: str = _key('validation', 'Split used for evaluation, labelled with the training split\'s classes; '
                                        'timm\'s synonyms val, valid, eval and evaluation are found too.')
    class_map: str | None = _key(None, 'File mapping class folder names to indices (timm class_map), for every '
                                       'split; a class folder it lacks is an error.')
    download: bool = _key(False, 'Let torchvision / Hugging Face download the dataset when missing.')
    train_num_samples: int | None = _key(None, 'Images per epoch of an iterable dataset (wds/, hfids/); required '
                                               'there, ignored otherwise.', _optional(_POSITIVE_INT))
    val_num_samples: int | None = _key(None, 'Images in an iterable validation split.', _optional(_POSITIVE_INT))
    mean: list[float] | None = _key(None, 'Normalisation mean per channel; null: the model\'s pretrained config.')
    std: list[float] | None = _key(None, 'Normalisation std per channel; null: the model\'s pretrained config.',
                                   _optional(Rule(lambda v: all(s > 0 for s in v), 'a list of positive numbers')))
    interpolation: str = _key('bicubic', 'Resize interpolation (random: a random one per training image; '
                                         'evaluation then uses bicubic).',
                              _one_of('bicubic', 'bilinear', 'nearest', 'lanczos', 'random'))
    crop_pct: float | None = _key(None, 'Evaluation centre-crop fraction (0.875 resizes 256 -> crops 224); '
                                        'null: the model\'s default.',
                                  _optional(Rule(lambda v: 0 < v <= 1, 'a number in (0, 1]')))
    num_workers: int = _key(8, 'DataLoader worker processes per training process.', _at_least(0))
    pin_memory: bool = _key(True, 'Pin host memory for faster copies to a GPU (ignored on CPU).')
    val_batch_size: int | None = _key(None, 'Evaluation batch per process; null: twice train.batch_size.',
                                      _optional(_POSITIVE_INT))


@dataclass
class AugmentConfig:
    """Training-time augmentation and label regularisation (timm's transforms, Mixup and losses)."""
    scale: list[float] = _key([0.08, 1.0], 'RandomResizedCrop area range.', _ordered_pair(1))
    ratio: list[float] = _key([0.75, 1.3333333333333333], 'RandomResizedCrop aspect-ratio range.', _ordered_pair())
    hflip: float = _key(0.5, 'Horizontal flip probability.', _PROBABILITY)
    vflip: float = _key(0.0, 'Vertical flip probability.', _PROBABILITY)
    color_jitter: float = _key(0.4, 'Colour jitter strength (used when auto_augment is null).', _NON_NEGATIVE)
    auto_augment: str | None = _key('rand-m9-mstd0.5-inc1', 'timm auto-augment policy string; null: none.',
                                    Rule(lambda v: v is None or v.split('-')[0] in _AUTO_AUGMENT_POLICIES,
                                         'null or a timm policy string such as rand-m9-mstd0.5-inc1'))
    reprob: float = _key(0.25, 'Random erasing probability.', _PROBABILITY)
    remode: Literal['pixel', 'rand', 'const'] = _key('pixel', 'Random erasing fill mode.')
    recount: int = _key(1, 'Random erasing regions per image.', _POSITIVE_INT)
    mixup: float = _key(0.8, 'Mixup alpha; 0 disables mixup.', _NON_NEGATIVE)
    cutmix: float = _key(1.0, 'CutMix alpha; 0 disables CutMix.', _NON_NEGATIVE)
    cutmix_minmax: list[float] | None = _key(None, 'CutMix box ratio range; overrides cutmix alpha when set.',
                                             _optional(_ordered_pair(1)))
    mixup_prob: float = _key(1.0, 'Probability of applying mixup or CutMix to a batch.', _PROBABILITY)
    mixup_switch_prob: float = _key(0.5, 'Probability of CutMix instead of mixup when both are on.', _PROBABILITY)
    mixup_mode: Literal['batch', 'pair', 'elem'] = _key('batch', 'Mix per batch, per pair or per element.')
    label_smoothing: float = _key(0.1, 'Label smoothing.', _FRACTION)


@dataclass
class OptimizerConfig:
    """Optimizer (timm.optim.create_optimizer_v2) and its learning rate."""
    name: str = _key('adamw', 'timm optimizer name (adamw, sgd, lamb, ...).')
    lr: float = _key(2e-3, 'Peak learning rate at global batch lr_base_batch_size.', _above(0))
    lr_base_batch_size: int | None = _key(2048, 'Global batch that lr, scheduler.min_lr and scheduler.warmup_lr '
                                                'are given for; they are scaled to the actual global batch. '
                                                'null: use them as given.', _optional(_POSITIVE_INT))
    lr_scaling: Literal['linear', 'sqrt'] = _key('linear', 'How lr follows the global batch.')
    weight_decay: float = _key(0.05, 'Decoupled weight decay of the weight matrices.', _NON_NEGATIVE)
    no_decay_weight_decay: float = _key(0.0, 'Weight decay of 1-D parameters (norms, biases, alpha) and of the '
                                             'names in the model\'s no_weight_decay() (position tables); the '
                                             'authors\' code uses 5e-4.', _NON_NEGATIVE)
    eps: float = _key(1e-8, 'Adam epsilon.', _above(0))
    betas: list[float] = _key([0.9, 0.999], 'Adam betas.',
                              Rule(lambda v: len(v) == 2 and all(0 <= b < 1 for b in v), 'two numbers in [0, 1)'))
    momentum: float = _key(0.9, 'SGD momentum.', _FRACTION)
    clip_grad: float | None = _key(None, 'Gradient clipping threshold; null or 0: no clipping (the paper).',
                                   Rule(lambda v: v is None or v >= 0, 'null, 0 (off) or a positive number'))
    clip_mode: Literal['norm', 'value'] = _key('norm', 'Clip the global norm or each value.')
    layer_decay: float | None = _key(None, 'Layer-wise learning-rate decay (fine-tuning): each stage\'s lr is scaled '
                                           'by layer_decay ** (its distance from the head), through timm\'s '
                                           'create_optimizer_v2(layer_decay=...) and the model\'s group_matcher(); '
                                           'null: one lr for all.', _optional(Rule(lambda v: 0 < v <= 1,
                                                                                   'a number in (0, 1]')))


@dataclass
class SchedulerConfig:
    """Learning-rate schedule (timm.scheduler.create_scheduler_v2), stepped after every optimizer update."""
    name: str = _key('cosine', 'timm schedule name.', _one_of(*SCHEDULERS))
    warmup_epochs: float = _key(0.0, 'Linear warmup length in epochs; LipsFormer needs none.', _NON_NEGATIVE)
    warmup_lr: float = _key(1e-6, 'Learning rate at the start of warmup (scaled like optimizer.lr).', _NON_NEGATIVE)
    min_lr: float = _key(2e-5, 'Learning rate at the end of the schedule (scaled like optimizer.lr).', _NON_NEGATIVE)
    cooldown_epochs: int = _key(0, 'Epochs at min_lr after the schedule ends (added to train.epochs).', _at_least(0))
    decay_epochs: float = _key(30.0, 'Step schedule: epochs between decays.', _above(0))
    decay_milestones: list[int] = _key([90, 180, 270], 'Multistep schedule: epochs at which to decay.')
    decay_rate: float = _key(0.1, 'Step / multistep decay factor; poly power.', _above(0))


@dataclass
class EMAConfig:
    """Exponential moving average of the weights (timm.utils.ModelEmaV3)."""
    enabled: bool = _key(True, 'Keep and evaluate an EMA of the weights.')
    decay: float = _key(0.99984, 'EMA decay per update at global batch reference_batch_size.', _FRACTION)
    reference_batch_size: int | None = _key(2048, 'Global batch the decay is given for; the decay used is '
                                                  'decay ** (global_batch / reference_batch_size), which keeps '
                                                  'the averaging horizon in images. null: use decay as given.',
                                            _optional(_POSITIVE_INT))
    warmup: bool = _key(False, 'timm\'s EMA decay warmup (ramps the decay up over the first steps).')
    cpu: bool = _key(False, 'Keep the EMA on the CPU (saves accelerator memory, slower updates).')


@dataclass
class TrainConfig:
    """The loop itself."""
    epochs: int = _key(300, 'Training epochs (the schedule\'s length).', _POSITIVE_INT)
    batch_size: int = _key(128, 'Images per process per micro-batch.', _POSITIVE_INT)
    grad_accum_steps: int = _key(1, 'Micro-batches accumulated per optimizer update.', _POSITIVE_INT)
    mixed_precision: Literal['no', 'fp16', 'bf16'] | None = _key(None, 'Autocast precision; null: what '
                                                                       '`accelerate config` / launch chose.')
    device: str | None = _key(None, 'Where to train: null lets Accelerate choose (the accelerator a launch gives each '
                                    'process, else the one the machine has, else the CPU); cpu: the CPU even with a '
                                    'GPU present; cuda, cuda:1, mps, xpu, ...: that device, which must be present '
                                    '(an index only in a single-process run).')
    seed: int = _key(42, 'Seed for weights, data order and augmentation (each process offsets it by its rank).',
                     Rule(lambda v: 0 <= v < 2 ** 31, 'an integer in [0, 2**31)'))
    deterministic: bool = _key(False, 'Use deterministic kernels (slower; for bit-exact GPU runs).')
    cudnn_benchmark: bool = _key(True, 'cuDNN autotuning (torch.backends.cudnn.benchmark, on in timm\'s train.py): '
                                       'at the first step of each new input shape cuDNN times its candidate kernels '
                                       'and keeps the fastest, where its heuristic\'s pick is very slow for the '
                                       'depthwise 7x7 convolutions\' weight gradient. That first step is slower (a '
                                       'smaller last batch is a new shape too), and the picks may differ between '
                                       'runs, so results may differ in the last bits; train.deterministic=true turns '
                                       'it off. CUDA only; summary.json records whether it was on.')
    grouped_weight_casts: bool = _key(True, 'Under autocast, cast the weights of linear layers and convolutions to '
                                            'the autocast dtype together, a multi-tensor copy per stage (and their '
                                            'gradients back likewise), instead of one cast per weight at its use: '
                                            'the same values in fewer GPU launches. Applies to eager, unsharded '
                                            'training without gradient checkpointing.')
    eval_interval: int = _key(1, 'Evaluate every N epochs (and always after the last one).', _POSITIVE_INT)
    log_interval: int = _key(50, 'Optimizer updates between progress log lines and tracker steps (train loss, lr, '
                                 'grad norm).', _POSITIVE_INT)
    max_nonfinite_steps: int = _key(10, 'Stop after this many consecutive updates with a non-finite loss.',
                                    _POSITIVE_INT)
    progress_bar: bool = _key(True, 'Show a tqdm progress bar on the main process (when stderr is a terminal).')
    cpu_threads: int | None = _key(None, 'Threads torch uses for CPU work in each process; null: torch\'s default '
                                         '(one per core). On a small or shared CPU, 1 thread plus a loader worker '
                                         'avoids threads waiting on each other.', _optional(_POSITIVE_INT))
    cpu_retain_freed_memory: bool = _key(True, 'On a CPU run with glibc (Linux), keep freed memory in the process for '
                                               'reuse instead of unmapping it (lipsformer.utils.cpu_memory): large '
                                               'activations stop page-faulting every step (docs/performance.md '
                                               'measures the gain); the process keeps its peak memory until it '
                                               'exits.')


@dataclass
class CheckpointConfig:
    """Resumable checkpoints under <output>/checkpoints and the final export."""
    every_n_steps: int = _key(0, 'Also save every N optimizer updates (0: only at epoch ends).', _at_least(0))
    keep_last: int = _key(2, 'Periodic / epoch checkpoints to keep (the best is kept as well).', _POSITIVE_INT)
    best_metric: Literal['auto', 'val_top1', 'ema_val_top1'] = _key('auto', 'Metric that picks the best '
                                                                            'checkpoint; auto: EMA top-1 when '
                                                                            'EMA is on, else raw top-1.')
    export: bool = _key(True, 'Write export/last and export/best in timm\'s format at the end.')


@dataclass
class LogConfig:
    """What the run reports besides metrics.jsonl."""
    trackers: list[str] | None = _key(None, 'Experiment trackers (through Accelerate): any of tensorboard, wandb, '
                                            'mlflow, or [all] for every one installed; [] for none; null: '
                                            'tensorboard when it is installed. Each is an extra: pip install '
                                            '"lipsformer[wandb]". They get the config, the per-step train loss, lr '
                                            'and grad norm every train.log_interval updates, and the epoch metrics.',
                                      _optional(Rule(lambda v: set(v) <= {*TRACKERS, 'all'},
                                                     'a list of tensorboard, wandb, mlflow, all')))
    project: str = _key('lipsformer', 'Project (wandb) / experiment (MLflow) name, and TensorBoard\'s sub-folder; '
                                      'the run is named after its run folder.')
    plots: bool = _key(True, 'Write loss / accuracy / alpha PNG plots at the end (needs matplotlib).')


@dataclass
class LipschitzConfig:
    """Lipschitz-constrained training (beyond the paper): project weights after every update."""
    enabled: bool = _key(False, 'Project the weights after every optimizer update.')
    target: str = _key('lipsformer.lipschitz:LipschitzConstraint', 'The constraint, as module:callable; it is '
                                                                    'called as target(model, **kwargs) and what it '
                                                                    'returns is called after every update.')
    kwargs: dict[str, Any] = _key({}, 'Arguments of the constraint (its bound and per-part caps).')


@dataclass
class Config:
    """A whole training run."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    lipschitz: LipschitzConfig = field(default_factory=LipschitzConfig)


def check_config(config: Config) -> None:
    """Raise :class:`ConfigError` for the first value that is not finite or that its key's rule rejects, or for an
    impossible combination.

    Values must already have their annotated types (as :func:`~lipsformer.training.config_io.config_from_dict`
    builds them); a :class:`Config` made in Python is checked here too (``optimizer.lr=float('inf')`` passes lr > 0).
    """
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for key in dataclasses.fields(values):
            rule, value = key.metadata['rule'], getattr(values, key.name)
            check_finite(f'{section.name}.{key.name}', value, None if rule is None else f'allowed: {rule.allowed}')
            if rule is not None and not rule.test(value):
                raise ConfigError(f'{section.name}.{key.name}: got {value!r}; allowed: {rule.allowed}')
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
