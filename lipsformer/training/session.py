"""Everything a training run holds, built in the order the timm + Accelerate pitfalls require.

The model is created with the same seed on every process, moved to the device, copied into the EMA (which stays
out of ``accelerator.prepare``), given to the optimizer, and only then prepared. Data loaders are not prepared:
their sharding is done by this package's samplers so that resuming is exact. The scheduler is stepped by hand after
every update and saved with the checkpoints.

The optional Lipschitz constraint (``lipschitz.*`` in the config) is built here too: ``lipschitz.target`` names a
factory as ``module:callable``, called once as ``factory(model, **kwargs)`` with the unwrapped model; what it returns
is called with no arguments after every update, and saved with the checkpoints when it has ``state_dict`` /
``load_state_dict`` (cached power-iteration vectors, say).

A config is data: it may name only the package's own callables (:data:`REGISTERED_CALLABLES`). Any other is imported
only when the user trusts it by name (train.py ``--trust-callable module:callable``, :func:`~.trainer.train`'s
``trusted_callables``), so that running a config someone else wrote (``--config runs/x/config.yaml``) never runs code
it chose.
"""
import contextlib
import importlib
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import timm
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, ProjectConfiguration, set_seed
from accelerate.utils.other import is_compiled_module  # exported from accelerate.utils only after 1.6
from timm.utils import ModelEmaV3

from ..data import class_map_of, class_names_of, num_classes_of
from ..fastpath import to_fast_form
from ..utils.cpu_memory import retain_freed_memory
from ..utils.processes import check_process_group, select_device, set_cudnn_benchmark, wants_cpu_group
from ..weights.model_names import (
    ModelSourceError,
    check_model_source,
    classifier_reset_note,
    create_model,
    model_source,
    unaccepted_kwargs,
)
from ..weights.weight_files import check_state_dict, extract_state_dict, load_file
from .compilation import (
    compile_regions,
    compiles,
    dynamo_plugin,
    effective_mode,
    keep_own_gradients,
    say_compilation,
    static_shapes,
    whole_model_plugin,
)
from .config import Config, ConfigError, LipschitzConfig
from .data import InputSpec, TrainBatches, create_eval_loader, create_split, resolve_input_spec
from .optim import create_mixup, create_optimizer, create_scheduler, create_train_loss, ema_decay, global_batch_size
from .trackers import TENSORBOARD_DIR, chosen_trackers
from .train_state import Progress, TrainingObjects, is_sharded
from .weight_casts import GroupedWeightCasts
from .weight_casts import refusal_reason as weight_casts_refusal

_logger = logging.getLogger(__name__)

# The callables a config may name without the user's word, by config key.
REGISTERED_CALLABLES: dict[str, tuple[str, ...]] = {
    'lipschitz.target': ('lipsformer.lipschitz:LipschitzConstraint',
                         'lipsformer.lipschitz.constraint:LipschitzConstraint'),
}


@dataclass
class Session:
    """The objects of one training run (see :func:`create_session`)."""
    config: Config
    run_dir: str
    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    ema: ModelEmaV3 | None
    train_loss: torch.nn.Module
    mixup: Any
    train_batches: TrainBatches
    val_loader: Any
    spec: InputSpec
    model_kwargs: dict[str, Any]
    class_names: list[str] | None
    global_batch: int
    updates_per_epoch: int
    lipschitz: Any | None = None
    progress: Progress = field(default_factory=Progress)
    last_checkpoint: str | None = None
    saved_at: tuple[int, int, int] | None = None  # the progress position of this run's last checkpoint
    tally: Any = None  # the running totals of the epoch in training (loop.EpochTally)
    started_at: float = field(default_factory=time.perf_counter)  # this start's, on time.perf_counter's clock
    earlier_wall_time_s: float = 0.0  # what the earlier starts took, up to the checkpoint resumed from
    first_step_s: float | None = None  # this start's first compiled micro-batch, compilation included
    compile_scope: str | None = None  # what was compiled: regional, whole, or None (eager)
    check_run_folder: Callable[[], None] | None = None  # raises RunFolderGoneError (collective: every process)
    weight_casts: GroupedWeightCasts | None = None  # autocast's weight casts made together (train.grouped_weight_casts)

    def casting_weights(self) -> contextlib.AbstractContextManager:
        """A training forward's context under autocast: the weights cast together (:mod:`.weight_casts`) where the
        run does so."""
        if self.weight_casts is None:
            return contextlib.nullcontext()
        return self.weight_casts.applied(self.accelerator.device.type)

    def wall_time_s(self) -> float:
        """Wall time of the run so far: the earlier starts' and this one's."""
        return self.earlier_wall_time_s + time.perf_counter() - self.started_at

    @property
    def compiled(self) -> bool:
        """Whether the model trains compiled (``model.compile``, resolved for the device)."""
        return self.compile_scope is not None

    @property
    def static_shapes(self) -> bool:
        """Whether the model is compiled for static shapes (a CUDA-graph mode, or regional compilation: a graph per
        stage shape), so that evaluation batches are padded to one size (:mod:`.compilation`)."""
        return self.compiled and (static_shapes(self.config) or self.compile_scope == 'regional')

    @property
    def keeps_own_gradients(self) -> bool:
        """Whether the compiled model records CUDA graphs, whose outputs its gradients must not take over: they are kept
        in buffers of their own, zeroed between updates (:func:`~.compilation.keep_own_gradients`)."""
        return self.compiled and static_shapes(self.config)

    def compile_record(self) -> dict[str, Any] | None:
        """What summary.json says of the compilation (None for an eager run): scope, the mode inductor compiled in
        (``requested_mode`` is the config's, which differs where a CUDA-graph mode runs without CUDA), static
        shapes, and the seconds of this start's first micro-batch (null if it trained none)."""
        if not self.compiled:
            return None
        mode = self.config.model.compile_mode
        return dict(scope=self.compile_scope, mode=effective_mode(mode, self.accelerator.device.type),
                    requested_mode=mode, static_shapes=self.static_shapes, first_step_s=self.first_step_s)

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model, keep_torch_compile=False)

    def training_objects(self) -> TrainingObjects:
        extra = {'lipschitz': self.lipschitz} if hasattr(self.lipschitz, 'state_dict') else {}
        return TrainingObjects(self.accelerator, self.model, self.optimizer, self.scheduler, self.ema, extra)

    def geometry(self) -> dict[str, int]:
        """The batch layout a checkpoint must share with the run that resumes it."""
        return dict(world_size=self.accelerator.num_processes, batch_size=self.config.train.batch_size,
                    grad_accum_steps=self.config.train.grad_accum_steps, global_batch_size=self.global_batch,
                    updates_per_epoch=self.updates_per_epoch)


def create_accelerator(config: Config, run_dir: str) -> Accelerator:
    """Accelerate's view of devices, precision, DDP / FSDP and trackers; accumulation is done by the loop.

    Several processes launched on a host without an accelerator form one CPU group (gloo); a launch whose processes
    Accelerate does not see as one group is refused (:mod:`lipsformer.utils.processes`).

    cuDNN autotunes as ``train.cudnn_benchmark`` says, unless ``train.deterministic`` asks for repeatable results
    (:func:`~lipsformer.utils.processes.set_cudnn_benchmark`).

    Raises:
        LaunchError: The processes launched would each train alone.
        ConfigError: fp16 on a CPU (which would train in fp32), or a device that is not there.
    """
    if config.train.cpu_threads is not None:
        torch.set_num_threads(config.train.cpu_threads)
    autotune = config.train.cudnn_benchmark
    if autotune is True and config.train.deterministic:
        # timed picks may differ between runs, and so would the last bits of the results
        _logger.info('train.deterministic: cuDNN autotuning (train.cudnn_benchmark) is off')
        autotune = False
    try:
        set_cudnn_benchmark(autotune, 'train.cudnn_benchmark')
    except ValueError as e:  # a Config built in Python: a file's value is checked as it is read
        raise ConfigError(str(e)) from None
    project = ProjectConfiguration(project_dir=run_dir, logging_dir=os.path.join(run_dir, TENSORBOARD_DIR))
    try:
        cpu = select_device(config.train.device, 'train.device')
    except ValueError as e:
        raise ConfigError(str(e)) from None
    cpu = cpu or wants_cpu_group()
    accelerator = Accelerator(
        cpu=cpu, mixed_precision=config.train.mixed_precision,
        log_with=chosen_trackers(config) or None,
        project_config=project, step_scheduler_with_optimizer=False,
        dynamo_plugin=dynamo_plugin(config, cpu),
        kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)])
    check_process_group(accelerator)
    if accelerator.mixed_precision == 'fp16' and accelerator.device.type == 'cpu':
        raise ConfigError('train.mixed_precision fp16 (--amp) runs only on a GPU: on a CPU Accelerate trains in fp32 '
                          'while the run would record fp16. Use bf16 (--amp --amp-dtype bfloat16, or '
                          'train.mixed_precision=bf16), or fp32 (--no-amp)')
    if config.train.cpu_retain_freed_memory and accelerator.device.type == 'cpu':
        retain_freed_memory()
    return accelerator






def create_session(config: Config, run_dir: str, accelerator: Accelerator,
                   trusted_callables: tuple[str, ...] = ()) -> Session:
    """Build data, model, EMA, optimizer, schedule and loss for a run (no training state loaded yet).

    Args:
        config: The run's config.
        run_dir: The run folder.
        accelerator: From :func:`create_accelerator`.
        trusted_callables: Callables the config may name besides :data:`REGISTERED_CALLABLES`.
    """
    # A depthwise conv's weight gradient can differ from its DDP bucket only in the stride of a size-1 dimension:
    # the same memory layout, so the warning DDP gives for it (on every backward) says nothing.
    warnings.filterwarnings('ignore', message='Grad strides do not match bucket view strides')
    _check_model_name(config.model.name)
    rank, world = accelerator.process_index, accelerator.num_processes
    spec = resolve_input_spec(config)
    with accelerator.main_process_first():  # a download (data.download) or unpacking happens once, in the main process
        train_set = create_split(config, spec, is_training=True)
        val_set = create_split(config, spec, is_training=False, class_map=class_map_of(train_set))
    num_classes = config.model.num_classes or num_classes_of(train_set)
    if num_classes is None:
        raise ConfigError(f'model.num_classes: got null and dataset {config.data.dataset!r} does not say how many '
                          f'classes it has; set model.num_classes')
    set_seed(config.train.seed, deterministic=config.train.deterministic)  # identical initial weights everywhere
    model, model_kwargs = create_run_model(config, num_classes, spec)
    set_seed(config.train.seed + rank, deterministic=config.train.deterministic)  # per-process augmentation
    model.to(accelerator.device)
    if not compiles(config, cpu=accelerator.device.type == 'cpu') and not is_sharded(accelerator):
        to_fast_form(model, accelerator.device.type)  # where the fast path is on for the device; the EMA copies it
    global_batch = global_batch_size(config, world)
    ema = None
    if config.ema.enabled:
        _check_ema_supported(accelerator)
        ema = ModelEmaV3(model, decay=ema_decay(config, global_batch), use_warmup=config.ema.warmup,
                         device=torch.device('cpu') if config.ema.cpu else None)
    optimizer = create_optimizer(model, config, global_batch)
    train_batches = TrainBatches(train_set, config, spec, accelerator.device, world, rank)
    updates_per_epoch = len(train_batches) // config.train.grad_accum_steps
    if updates_per_epoch == 0:
        raise ConfigError(f'train.batch_size: {config.train.batch_size} x {config.train.grad_accum_steps} '
                          f'accumulation steps x {world} processes is more than the {len(train_set)} training '
                          f'images; lower train.batch_size or train.grad_accum_steps')
    scheduler = create_scheduler(optimizer, config, updates_per_epoch, global_batch)
    lipschitz = None
    if config.lipschitz.enabled:
        check_config_callables(config, trusted_callables)
        lipschitz = create_lipschitz_constraint(config.lipschitz, model)
    compile_scope = None
    if compiles(config, cpu=accelerator.device.type == 'cpu'):
        compile_scope = config.model.compile_scope
        if compile_scope == 'regional' and not compile_regions(
                model, effective_mode(config.model.compile_mode, accelerator.device.type), dynamic=False):
            _logger.info('model.compile_scope regional compiles LipsFormer blocks, and %s has none: it is compiled '
                         'whole', config.model.name)
            compile_scope = 'whole'
            accelerator.state.dynamo_plugin = whole_model_plugin(config, accelerator.device.type)
    model, optimizer = prepare_model(accelerator, model, optimizer)
    mixup = create_mixup(config, num_classes)
    session = Session(
        config=config, run_dir=run_dir, accelerator=accelerator, model=model, optimizer=optimizer,
        scheduler=scheduler, ema=ema, train_loss=create_train_loss(config, mixup).to(accelerator.device),
        mixup=mixup, train_batches=train_batches,
        val_loader=create_eval_loader(val_set, config, spec, accelerator.device, world, rank), spec=spec,
        model_kwargs=model_kwargs, class_names=class_names_of(train_set), global_batch=global_batch,
        updates_per_epoch=updates_per_epoch, lipschitz=lipschitz, compile_scope=compile_scope)
    if compile_scope == 'whole' and not is_compiled_module(model):
        raise ConfigError('model.compile_scope: whole, but Accelerate did not compile the model; check the launcher\'s '
                          'dynamo settings')
    say_compilation(config, accelerator.device, compile_scope)
    if config.train.grouped_weight_casts and compile_scope is None and not is_sharded(accelerator):
        reason = weight_casts_refusal(session.unwrapped_model)
        if reason is None:
            session.weight_casts = GroupedWeightCasts(session.unwrapped_model)
        else:
            _logger.info('train.grouped_weight_casts: autocast casts each weight at its use, since %s', reason)
    if session.keeps_own_gradients:
        keep_own_gradients(session.unwrapped_model)
    return session


def prepare_model(accelerator: Accelerator, model: torch.nn.Module, optimizer: Any) -> tuple[torch.nn.Module, Any]:
    """``accelerator.prepare`` the model and its optimizer (DDP, FSDP or neither, as launched)."""
    if is_sharded(accelerator) and not hasattr(model, '_no_split_modules'):
        model._no_split_modules = None  # accelerate 1.6's FSDP2 wrap policy reads this transformers attribute
    return accelerator.prepare(model, optimizer)


def create_run_model(config: Config, num_classes: int, spec: InputSpec) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The timm model and the keyword arguments it was built with (recorded in the export)."""
    settings = config.model
    kwargs = dict(settings.kwargs, num_classes=num_classes, in_chans=settings.in_chans)
    if settings.img_size is not None:
        kwargs['img_size'] = settings.img_size
    runtime = dict(drop_rate=settings.drop_rate, drop_path_rate=settings.drop_path_rate)
    try:
        model = create_model(settings.name, pretrained=settings.pretrained, **kwargs, **runtime)
    except TypeError as e:
        raise ConfigError(f'model.kwargs: {settings.name} does not accept '
                          f'{unaccepted_kwargs(e, settings.kwargs)} ({e})') from e
    except ModelSourceError as e:
        raise ConfigError(f'model.name: {e}') from e
    except ValueError as e:
        raise ConfigError(f'model: {settings.name} cannot be built with {kwargs} ({e})') from e
    if settings.pretrained and classifier_reset_note(model):
        _logger.info('model.pretrained: %s', classifier_reset_note(model))
    if settings.init_checkpoint:
        load_initial_weights(model, settings.init_checkpoint)
    if settings.grad_checkpointing:
        model.set_grad_checkpointing(True)
    if settings.channels_last:
        model.to(memory_format=torch.channels_last)
    _logger.info('model %s: %.2fM parameters', settings.name, sum(p.numel() for p in model.parameters()) / 1e6)
    return model, kwargs


def load_initial_weights(model: torch.nn.Module, path: str) -> None:
    """Start from a file's weights (fine-tuning); a classifier of another size is left at its initialisation.

    Any layout :mod:`lipsformer.weights.weight_files` reads works, including the authors' files (through the model
    module's ``checkpoint_filter_fn``). Every other mismatch is an error.
    """
    state_dict = extract_state_dict(load_file(path))
    filter_fn = getattr(sys.modules[type(model).__module__], 'checkpoint_filter_fn', None)
    if filter_fn is not None:
        state_dict = filter_fn(state_dict, model)
    classifier = getattr(model, 'pretrained_cfg', {}).get('classifier')
    own = model.state_dict()
    for key in [k for k in state_dict if classifier and k.startswith(f'{classifier}.')]:
        if key in own and state_dict[key].shape != own[key].shape:
            _logger.info('%s: %s has shape %s, the model %s; the classifier starts from scratch', path, key,
                         tuple(state_dict[key].shape), tuple(own[key].shape))
            state_dict[key] = own[key]
    check_state_dict(model, state_dict, source=path)
    model.load_state_dict(state_dict)
    _logger.info('initial weights from %s', path)


def check_config_callables(config: Config, trusted: tuple[str, ...] = ()) -> None:
    """Refuse a config that names code to run (``lipschitz.target``) other than the package's registered callables
    and those in ``trusted`` (the user's word), before anything is imported.

    Raises:
        ConfigError: An untrusted callable, with how to trust it.
    """
    named = {'lipschitz.target': config.lipschitz.target} if config.lipschitz.enabled else {}
    for key, target in named.items():
        if target in REGISTERED_CALLABLES[key] or target in trusted:
            continue
        raise ConfigError(
            f'{key}: {target!r} is not one of the package\'s callables ({", ".join(REGISTERED_CALLABLES[key][:1])}). '
            f'A config is data: it names no other code to import and run, since anyone may have written it. If you '
            f'trust {target!r}, say so: train.py --trust-callable {target} (in Python, train(..., '
            f'trusted_callables=[{target!r}]))')


def create_lipschitz_constraint(settings: LipschitzConfig, model: torch.nn.Module) -> Callable[[], None]:
    """Build the constraint named by ``settings.target`` for ``model`` (check the name first:
    :func:`check_config_callables`)."""
    module_name, _, attribute = settings.target.partition(':')
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f'lipschitz.target: cannot import {settings.target!r} ({e}); give module:callable, or set '
                          f'lipschitz.enabled=false') from e
    try:
        constraint = factory(model, **settings.kwargs)
    except TypeError as e:
        raise ConfigError(f'lipschitz.kwargs: {settings.target} does not accept {settings.kwargs} ({e})') from e
    except ValueError as e:
        raise ConfigError(f'lipschitz.kwargs: {settings.target} rejects {settings.kwargs}: {e}') from e
    if not callable(constraint):
        raise ConfigError(f'lipschitz.target: {settings.target}(model, ...) returned a {type(constraint).__name__}, '
                          f'which cannot be called after each update')
    return constraint


def _check_model_name(name: str) -> None:
    if model_source(name):  # hf-hub:REPO / local-dir:FOLDER
        try:
            check_model_source(name)
        except ValueError as e:
            raise ConfigError(f'model.name: {e}') from e
    elif not timm.is_model(name):
        close = timm.list_models(f'*{name.split("_")[0]}*')[:12] or timm.list_models('lipsformer*')
        raise ConfigError(f'model.name: {name!r} is not a timm model; for example: {", ".join(close)}')


def _check_ema_supported(accelerator: Accelerator) -> None:
    if is_sharded(accelerator):
        raise ConfigError('ema.enabled: the EMA keeps a full copy of the weights that FSDP cannot update from its '
                          'shards; set ema.enabled=false with FSDP, or train with DDP')
