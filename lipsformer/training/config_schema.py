"""The training configuration: every key, its type, its default and what it means.

Each section is a dataclass; a field's ``help`` metadata is the single place a key is documented
(``configs/reference.yaml`` is generated from it by :func:`lipsformer.training.config.reference_yaml`).
Learning rates and the EMA decay are stated for a reference global batch (2048 in the paper) and rescaled to the
actual global batch (``batch_size x processes x grad_accum_steps``) when the run starts.
"""
from dataclasses import dataclass, field
from typing import Any, Literal

SCHEDULERS = ('cosine', 'tanh', 'step', 'multistep', 'poly')
MIXED_PRECISION = ('no', 'fp16', 'bf16')


def _key(default: Any, help_text: str) -> Any:
    """A config field with its documentation; mutable defaults are copied per instance."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={'help': help_text})
    return field(default=default, metadata={'help': help_text})


@dataclass
class ModelConfig:
    """Which network to train and how it is built."""
    name: str = _key('lipsformer_cswin_tiny', 'timm model name; `import lipsformer` registers lipsformer_* models.')
    kwargs: dict[str, Any] = _key({}, 'Extra architecture arguments for timm.create_model (embed_dim, depths, '
                                      'num_heads, window_size / split_size, mlp_ratio, alpha_init, tau, ...).')
    img_size: int | None = _key(None, 'Square input resolution for training and evaluation; null: the model\'s '
                                      'default. LipsFormer models need a multiple of 32.')
    in_chans: int = _key(3, 'Input channels (1 for grayscale data such as Fashion-MNIST).')
    num_classes: int | None = _key(None, 'Classifier outputs; null: the number of classes in the training set.')
    drop_rate: float = _key(0.0, 'Dropout before the classifier.')
    drop_path_rate: float = _key(0.1, 'Stochastic depth rate of the last block (rises linearly from 0).')
    pretrained: bool = _key(False, 'Start from the model\'s default pretrained weights (timm pretrained=True).')
    init_checkpoint: str | None = _key(None, 'Start from the weights in this file (fine-tuning); any layout '
                                             'lipsformer.checkpoint.load_model_weights reads. Not a resume.')
    grad_checkpointing: bool = _key(False, 'Recompute activations in the backward pass to save memory.')
    channels_last: bool = _key(False, 'Use the channels-last memory format (faster convolutions on GPUs).')
    compile: bool = _key(False, 'torch.compile the model (through Accelerate\'s dynamo plugin).')
    compile_mode: str = _key('default', 'torch.compile mode: default, reduce-overhead or max-autotune.')


@dataclass
class DataConfig:
    """Where images come from and how they are loaded."""
    dataset: str = _key('', 'timm dataset: "" for an ImageFolder or tar tree, "hfds/<name>" (Hugging Face), '
                            '"hfids/<name>" (streamed), "wds/<name>" (WebDataset shards), "torch/<name>" '
                            '(torchvision, e.g. torch/fashion_mnist).')
    data_dir: str | None = _key(None, 'Dataset root (train.py --data-dir sets it).')
    train_split: str = _key('train', 'Split (or sub-folder) used for training.')
    val_split: str = _key('validation', 'Split used for evaluation; timm also finds "val" and "test" folders.')
    class_map: str | None = _key(None, 'File mapping class folder names to indices (timm class_map).')
    download: bool = _key(False, 'Let torchvision / Hugging Face download the dataset when missing.')
    train_num_samples: int | None = _key(None, 'Images per epoch of an iterable dataset (wds/, hfids/); required '
                                               'there, ignored otherwise.')
    val_num_samples: int | None = _key(None, 'Images in an iterable validation split.')
    mean: list[float] | None = _key(None, 'Normalisation mean per channel; null: the model\'s pretrained config.')
    std: list[float] | None = _key(None, 'Normalisation std per channel; null: the model\'s pretrained config.')
    interpolation: str = _key('bicubic', 'Resize interpolation (bicubic, bilinear, nearest; random for training).')
    crop_pct: float | None = _key(None, 'Evaluation centre-crop fraction (0.875 resizes 256 -> crops 224); '
                                        'null: the model\'s default.')
    num_workers: int = _key(8, 'DataLoader worker processes per training process.')
    pin_memory: bool = _key(True, 'Pin host memory for faster copies to a GPU (ignored on CPU).')
    val_batch_size: int | None = _key(None, 'Evaluation batch per process; null: twice train.batch_size.')


@dataclass
class AugmentConfig:
    """Training-time augmentation and label regularisation (timm's transforms, Mixup and losses)."""
    scale: list[float] = _key([0.08, 1.0], 'RandomResizedCrop area range.')
    ratio: list[float] = _key([0.75, 1.3333333333333333], 'RandomResizedCrop aspect-ratio range.')
    hflip: float = _key(0.5, 'Horizontal flip probability.')
    vflip: float = _key(0.0, 'Vertical flip probability.')
    color_jitter: float = _key(0.4, 'Colour jitter strength (used when auto_augment is null).')
    auto_augment: str | None = _key('rand-m9-mstd0.5-inc1', 'timm auto-augment policy string; null: none.')
    reprob: float = _key(0.25, 'Random erasing probability.')
    remode: Literal['pixel', 'rand', 'const'] = _key('pixel', 'Random erasing fill mode.')
    recount: int = _key(1, 'Random erasing regions per image.')
    mixup: float = _key(0.8, 'Mixup alpha; 0 disables mixup.')
    cutmix: float = _key(1.0, 'CutMix alpha; 0 disables CutMix.')
    cutmix_minmax: list[float] | None = _key(None, 'CutMix box ratio range; overrides cutmix alpha when set.')
    mixup_prob: float = _key(1.0, 'Probability of applying mixup or CutMix to a batch.')
    mixup_switch_prob: float = _key(0.5, 'Probability of CutMix instead of mixup when both are on.')
    mixup_mode: Literal['batch', 'pair', 'elem'] = _key('batch', 'Mix per batch, per pair or per element.')
    label_smoothing: float = _key(0.1, 'Label smoothing.')


@dataclass
class OptimizerConfig:
    """Optimizer (timm.optim.create_optimizer_v2) and its learning rate."""
    name: str = _key('adamw', 'timm optimizer name (adamw, sgd, lamb, ...).')
    lr: float = _key(2e-3, 'Peak learning rate at global batch lr_base_batch_size.')
    lr_base_batch_size: int | None = _key(2048, 'Global batch that lr, scheduler.min_lr and scheduler.warmup_lr '
                                                'are given for; they are scaled to the actual global batch. '
                                                'null: use them as given.')
    lr_scaling: Literal['linear', 'sqrt'] = _key('linear', 'How lr follows the global batch.')
    weight_decay: float = _key(0.05, 'Decoupled weight decay of the weight matrices.')
    no_decay_weight_decay: float = _key(0.0, 'Weight decay of 1-D parameters (norms, biases, alpha) and of the '
                                             'names in the model\'s no_weight_decay() (position tables); the '
                                             'authors\' code uses 5e-4.')
    eps: float = _key(1e-8, 'Adam epsilon.')
    betas: list[float] = _key([0.9, 0.999], 'Adam betas.')
    momentum: float = _key(0.9, 'SGD momentum.')
    clip_grad: float | None = _key(None, 'Gradient clipping threshold; null or 0: no clipping (the paper).')
    clip_mode: Literal['norm', 'value'] = _key('norm', 'Clip the global norm or each value.')


@dataclass
class SchedulerConfig:
    """Learning-rate schedule (timm.scheduler.create_scheduler_v2), stepped after every optimizer update."""
    name: str = _key('cosine', 'Schedule: ' + ', '.join(SCHEDULERS) + '.')
    warmup_epochs: float = _key(0.0, 'Linear warmup length in epochs; LipsFormer needs none.')
    warmup_lr: float = _key(1e-6, 'Learning rate at the start of warmup (scaled like optimizer.lr).')
    min_lr: float = _key(2e-5, 'Learning rate at the end of the schedule (scaled like optimizer.lr).')
    cooldown_epochs: int = _key(0, 'Epochs at min_lr after the schedule ends (added to train.epochs).')
    decay_epochs: float = _key(30.0, 'Step schedule: epochs between decays.')
    decay_milestones: list[int] = _key([90, 180, 270], 'Multistep schedule: epochs at which to decay.')
    decay_rate: float = _key(0.1, 'Step / multistep decay factor; poly power.')


@dataclass
class EMAConfig:
    """Exponential moving average of the weights (timm.utils.ModelEmaV3)."""
    enabled: bool = _key(True, 'Keep and evaluate an EMA of the weights.')
    decay: float = _key(0.99984, 'EMA decay per update at global batch reference_batch_size.')
    reference_batch_size: int | None = _key(2048, 'Global batch the decay is given for; the decay used is '
                                                  'decay ** (global_batch / reference_batch_size), which keeps '
                                                  'the averaging horizon in images. null: use decay as given.')
    warmup: bool = _key(False, 'timm\'s EMA decay warmup (ramps the decay up over the first steps).')
    cpu: bool = _key(False, 'Keep the EMA on the CPU (saves accelerator memory, slower updates).')


@dataclass
class TrainConfig:
    """The loop itself."""
    epochs: int = _key(300, 'Training epochs (the schedule\'s length).')
    batch_size: int = _key(128, 'Images per process per micro-batch.')
    grad_accum_steps: int = _key(1, 'Micro-batches accumulated per optimizer update.')
    mixed_precision: Literal['no', 'fp16', 'bf16'] | None = _key(None, 'Autocast precision; null: what '
                                                                       '`accelerate config` / launch chose.')
    seed: int = _key(42, 'Seed for weights, data order and augmentation (each process offsets it by its rank).')
    deterministic: bool = _key(False, 'Use deterministic kernels (slower; for bit-exact GPU runs).')
    eval_interval: int = _key(1, 'Evaluate every N epochs (and always after the last one).')
    log_interval: int = _key(50, 'Optimizer updates between progress log lines.')
    max_nonfinite_steps: int = _key(10, 'Stop after this many consecutive updates with a non-finite loss.')
    progress_bar: bool = _key(True, 'Show a tqdm progress bar on the main process (when stderr is a terminal).')
    cpu_threads: int | None = _key(None, 'Threads torch uses for CPU work in each process; null: torch\'s default '
                                         '(one per core). On a small or shared CPU, 1 thread plus a loader worker '
                                         'avoids threads waiting on each other.')
    cpu_retain_freed_memory: bool = _key(True, 'On a CPU run with glibc (Linux), keep freed memory in the process for '
                                               'reuse instead of unmapping it (lipsformer.cpu_memory): large '
                                               'activations stop page-faulting every step (a LipsFormer-Swin-T step '
                                               'at batch 16 is 13% faster); the process keeps its peak memory until '
                                               'it exits.')


@dataclass
class CheckpointConfig:
    """Resumable checkpoints under <output>/checkpoints and the final export."""
    every_n_steps: int = _key(0, 'Also save every N optimizer updates (0: only at epoch ends).')
    keep_last: int = _key(2, 'Periodic / epoch checkpoints to keep (the best is kept as well).')
    best_metric: Literal['auto', 'val_top1', 'ema_val_top1'] = _key('auto', 'Metric that picks the best '
                                                                            'checkpoint; auto: EMA top-1 when '
                                                                            'EMA is on, else raw top-1.')
    export: bool = _key(True, 'Write export/last and export/best in timm\'s format at the end.')


@dataclass
class LogConfig:
    """What the run reports besides metrics.jsonl."""
    tensorboard: bool | None = _key(None, 'Log to TensorBoard through Accelerate; null: when it is installed.')
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
