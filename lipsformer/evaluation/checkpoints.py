"""Which weights file a ``--checkpoint`` means, and the model that fits it.

Accepted checkpoints: a weights file (``.safetensors``, timm ``.pth.tar``, the authors' ``.pth``); a folder holding
``model.safetensors`` (an export or one saved checkpoint); or a training run folder, from which ``export/best``,
else ``export/last``, else the newest checkpoint (the one training would resume from) is taken. With EMA requested,
a folder's ``model_ema.safetensors`` / ``ema.safetensors`` is used, and a torch file's EMA entry.

The model is rebuilt from the arguments timm's ``train.py`` saved in its own checkpoint (``args``: ``--model``,
``--model-kwargs``, ``--num-classes``, ``--in-chans``, ``--gp`` and the preprocessing flags), else from timm's
``config.json`` next to the weights (as ``save_for_hf`` writes it), else from a training checkpoint's ``meta.json``
(the config, class count, architecture and preprocessing its weights were trained with, whatever the run's
``config.yaml`` says now), else from the run's ``config.yaml`` (read by :func:`lipsformer.training.load_config`), else
from ``--model``. A training checkpoint's files are checked against the SHA-256 its ``meta.json`` records, and a run
folder whose checkpoints include one with an unreadable ``meta.json`` is refused rather than scored by an older one.
All weights then go through
:func:`lipsformer.weights.weight_files.load_model_weights`, which never executes pickled code and names every mismatched
key. The class names saved with the weights (``label_names`` of an export, ``class_names`` of a checkpoint) come along,
so that a class-folder data set is labelled by name, as in training.
"""
import argparse
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from timm.models import resolve_model_input_args, split_model_name_tag
from timm.models._hub import load_model_config_from_path

from ..training import ConfigError, latest_checkpoint, load_config
from ..training.config import Config
from ..training.config_io import config_from_dict
from ..training.train_state import META_FILE, check_file_hashes, damaged_checkpoints, read_meta
from ..weights.model_names import create_model, hub_errors
from ..weights.weight_files import CheckpointError, check_state_dict, extract_state_dict, load_file, load_model_weights
from .errors import EvaluationError

__all__ = ['ResolvedCheckpoint', 'SavedModelConfig', 'resolve_checkpoint', 'create_eval_model']

_logger = logging.getLogger(__name__)

_WEIGHT_FILES = ('model.safetensors', 'pytorch_model.bin')
_EMA_FILES = ('model_ema.safetensors', 'ema.safetensors')
_RUN_EXPORTS = ('export/best', 'export/last')


@dataclass(frozen=True)
class SavedModelConfig:
    """The model saved next to some weights: a registered model name, its constructor arguments and preprocessing.

    Attributes:
        name: Registered model name.
        kwargs: Constructor arguments.
        pretrained_cfg: A complete pretrained cfg (from an export's ``config.json``), replacing the model's.
        cfg_overlay: Entries replacing those of the model's default pretrained cfg (from a run's ``config.yaml``).
        class_names: The name of each output class, in index order, when the weights came with them.
    """
    name: str
    kwargs: dict = field(default_factory=dict)
    pretrained_cfg: dict | None = None
    cfg_overlay: dict | None = None
    class_names: list[str] | None = None


@dataclass(frozen=True)
class ResolvedCheckpoint:
    """The file to load and what was found next to it.

    Attributes:
        weights: File to load.
        ema_entry: Take the EMA entry inside ``weights`` (a torch file holding both), rather than its raw weights.
        model_config: The model described by the checkpoint's ``config.json`` or run ``config.yaml``, if any.
    """
    weights: str
    ema_entry: bool
    model_config: SavedModelConfig | None


def _weights_in(folder: str) -> str | None:
    return next((os.path.join(folder, n) for n in _WEIGHT_FILES if os.path.isfile(os.path.join(folder, n))), None)


def _weights_folder(path: str) -> str:
    """The folder holding the weights a folder argument stands for (itself, or the chosen one of a run)."""
    if _weights_in(path):
        return path
    for export in _RUN_EXPORTS:
        if _weights_in(os.path.join(path, export)):
            return os.path.join(path, export)
    damaged = damaged_checkpoints(path)
    if damaged:
        names = '; '.join(f'{os.path.basename(folder)}: {reason}' for folder, reason in damaged)
        raise EvaluationError(
            f'{path!r} has no export, and which of its checkpoints is the newest is unknown ({names}); give the '
            f'checkpoint folder to score (--checkpoint {os.path.join(path, "checkpoints", "<name>")}), or let '
            f'train.py --output {path} --resume auto move such checkpoints to checkpoints/unreadable/')
    newest = latest_checkpoint(path)
    if newest and _weights_in(newest):
        return newest
    raise EvaluationError(
        f'{path!r} holds no weights: expected {" or ".join(_WEIGHT_FILES)} in it, or a training run folder with '
        f'{", ".join(_RUN_EXPORTS)} or checkpoints/<name>/model.safetensors')


def _model_config_from_run(path: str, meta: dict) -> SavedModelConfig:
    """The model and evaluation preprocessing of a training run's resolved ``config.yaml`` (see
    :func:`_model_config_from_config`)."""
    try:
        config = load_config(path)
    except ConfigError as e:
        raise EvaluationError(f'cannot use the run config {path!r}: {e}') from e
    return _model_config_from_config(config, meta)


def _model_config_from_config(config: Config, meta: dict) -> SavedModelConfig:
    """The model and evaluation preprocessing of a training config.

    Takes ``model.name``, ``model.kwargs``, ``model.img_size`` / ``in_chans`` / ``num_classes`` and the ``data``
    section's ``mean``, ``std``, ``interpolation`` and ``crop_pct`` (null values keep the model's defaults; a random
    training interpolation is evaluated bicubic, as training evaluates it); then what a training checkpoint's
    ``meta`` records: the constructor arguments and class names (the class count a null ``num_classes`` stood for)
    and the resolved preprocessing its weights were trained with.
    """
    checkpoint_model = meta.get('model') or {}
    model, data = config.model, config.data
    kwargs = dict(model.kwargs)
    kwargs.update({key: getattr(model, key) for key in ('img_size', 'in_chans', 'num_classes')
                   if getattr(model, key) is not None})
    overlay = {key: getattr(data, key) for key in ('mean', 'std', 'interpolation', 'crop_pct')
               if getattr(data, key) is not None}
    if model.img_size:
        overlay['input_size'] = (model.in_chans, model.img_size, model.img_size)
    for key, value in (meta.get('data_config') or {}).items():
        overlay[key] = tuple(value) if isinstance(value, list) else value
    if overlay.get('interpolation') == 'random':
        overlay['interpolation'] = 'bicubic'
    kwargs.update(checkpoint_model.get('kwargs') or {})
    return SavedModelConfig(model.name, kwargs, cfg_overlay=overlay or None,
                            class_names=checkpoint_model.get('class_names'))


def _label_names(pretrained_cfg: dict) -> list[str] | None:
    names = pretrained_cfg.get('label_names')
    if isinstance(names, dict):  # timm also allows {index: name}
        names = [names[key] for key in sorted(names, key=int)]
    return [str(name) for name in names] if names else None


def _model_config_near(folder: str) -> SavedModelConfig | None:
    """The model described next to weights in ``folder``: its ``config.json``, or the run's ``config.yaml``
    (in the folder or up to two levels above, as in ``RUN/checkpoints/NAME`` and ``RUN/export/best``) with what
    the folder's ``meta.json`` (a training checkpoint's) records; a training checkpoint's own config comes first."""
    if os.path.isfile(os.path.join(folder, 'config.json')):
        pretrained_cfg, name, model_args = load_model_config_from_path(folder)
        pretrained_cfg = {k: v for k, v in pretrained_cfg.items() if k not in ('file', 'source')}
        return SavedModelConfig(name, dict(model_args), pretrained_cfg, class_names=_label_names(pretrained_cfg))
    meta = _checkpoint_meta(folder)
    if meta.get('config'):
        try:
            return _model_config_from_config(config_from_dict(meta['config']), meta)
        except ConfigError as e:
            raise EvaluationError(f'cannot use the config in {os.path.join(folder, META_FILE)!r}: {e}') from e
    for levels in range(3):
        candidate = os.path.join(folder, *(['..'] * levels), 'config.yaml')
        if os.path.isfile(candidate):
            return _model_config_from_run(os.path.normpath(candidate), meta)
    return None


def _checkpoint_meta(folder: str) -> dict:
    """A training checkpoint's ``meta.json``, or {} for a folder without one (not a training checkpoint).

    Raises:
        EvaluationError: The folder has a ``meta.json`` that cannot be read: what its weights are is unknown.
    """
    if not os.path.isfile(os.path.join(folder, META_FILE)):
        return {}
    try:
        return read_meta(folder)
    except CheckpointError as e:
        raise EvaluationError(f'{e}: the model and preprocessing of the weights in {folder!r} are unknown; score '
                              f'another checkpoint or an export of the run') from e


def _check_saved_hash(weights: str) -> None:
    """Check a training checkpoint's weights file against the SHA-256 its ``meta.json`` records."""
    folder = os.path.dirname(weights)
    meta = _checkpoint_meta(folder)
    try:
        check_file_hashes(folder, meta, files=(os.path.basename(weights),))
    except CheckpointError as e:
        raise EvaluationError(f'{e}; score another checkpoint or an export of the run (train.py --resume auto moves '
                              f'it to checkpoints/unreadable/)') from e


def _model_config_in_file(path: str) -> SavedModelConfig | None:
    """The model a timm ``train.py`` checkpoint describes through its saved arguments, or None for other files."""
    if path.endswith('.safetensors'):
        return None
    try:
        args = load_file(path, mmap=True).get('args')
    except CheckpointError:  # loading the weights says what is wrong with the file
        return None
    if not isinstance(args, argparse.Namespace) or not isinstance(getattr(args, 'model', None), str):
        return None
    return model_config_from_timm_args(vars(args))


def model_config_from_timm_args(args: dict[str, Any]) -> SavedModelConfig:
    """The model and preprocessing of timm ``train.py``'s arguments, as its ``create_model`` call and
    ``resolve_data_config`` read them: ``--model``, ``--model-kwargs``, ``--num-classes``, ``--in-chans`` (else
    ``--input-size``'s first value), ``--gp``; ``--img-size`` / ``--input-size``, ``--mean``, ``--std``,
    ``--interpolation`` and ``--crop-pct`` for the data (the model itself is built at its default size, as there)."""
    input_size = args.get('input_size')
    in_chans = args.get('in_chans') or (input_size[0] if input_size else None)
    kwargs = dict(args.get('model_kwargs') or {})
    for key, value in (('num_classes', args.get('num_classes')), ('in_chans', in_chans),
                       ('global_pool', args.get('gp'))):
        if value is not None:
            kwargs[key] = value
    overlay: dict[str, Any] = {}
    size = tuple(input_size[1:]) if input_size else (args['img_size'],) * 2 if args.get('img_size') else None
    if size:
        overlay['input_size'] = (in_chans or 3, *size)
    for key in ('mean', 'std'):
        if args.get(key):
            values = tuple(args[key])
            overlay[key] = values * (in_chans or 3) if len(values) == 1 else values
    overlay.update({key: args[key] for key in ('interpolation', 'crop_pct') if args.get(key)})
    return SavedModelConfig(args['model'], kwargs, cfg_overlay=overlay or None)


def _ema_in(folder: str) -> str | None:
    return next((os.path.join(folder, n) for n in _EMA_FILES if os.path.isfile(os.path.join(folder, n))), None)


def resolve_checkpoint(path: str | os.PathLike, use_ema: bool = False) -> ResolvedCheckpoint:
    """Find the weights file (and model description) that ``--checkpoint PATH [--use-ema]`` means.

    Raises:
        EvaluationError: Nothing to load at ``path``, or EMA weights requested from a folder that has none.
    """
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(path):
        folder = os.path.dirname(path)
        if use_ema and os.path.basename(path) in _WEIGHT_FILES and _ema_in(folder):
            path = _ema_in(folder)  # the EMA twin of an export's or a checkpoint's weights
        ema_entry = use_ema and os.path.basename(path) not in _EMA_FILES
        _check_saved_hash(path)
        model_config = _model_config_in_file(path) or _model_config_near(folder)
        return ResolvedCheckpoint(path, ema_entry=ema_entry, model_config=model_config)
    if not os.path.isdir(path):
        raise EvaluationError(f'checkpoint {path!r} does not exist')
    folder = _weights_folder(path)
    weights = _weights_in(folder)
    if use_ema:
        weights = _ema_in(folder)
        if weights is None:
            raise EvaluationError(
                f'--use-ema: {folder!r} has no EMA weights (looked for {", ".join(_EMA_FILES)}); the run was '
                f'probably trained without EMA, so drop --use-ema')
    _check_saved_hash(weights)
    return ResolvedCheckpoint(weights, ema_entry=False, model_config=_model_config_near(folder))


def _choose_model_config(model_name: str | None, checkpoint: ResolvedCheckpoint | None) -> SavedModelConfig:
    saved = checkpoint.model_config if checkpoint else None
    if model_name is None:
        if saved is None:
            raise EvaluationError(f'--model is required: {checkpoint.weights!r} has no config.json or run config.yaml '
                                  f'next to it, nor timm train.py\'s arguments in it, to rebuild the model from')
        return saved
    if saved is not None and split_model_name_tag(model_name)[0] != split_model_name_tag(saved.name)[0]:
        raise EvaluationError(
            f'--model {model_name} does not match the checkpoint, whose config says it is {saved.name}; '
            f'drop --model to use the saved one')
    return saved if saved is not None else SavedModelConfig(model_name)


def create_eval_model(
        model_name: str | None,
        checkpoint: ResolvedCheckpoint | None,
        pretrained: bool = False,
        model_kwargs: dict | None = None,
        img_size: int | None = None,
) -> tuple[torch.nn.Module, str]:
    """Build the model (in eval mode, on CPU) and load its weights.

    Args:
        model_name: Registered model name; ``None`` to take it from the checkpoint's saved config.
        checkpoint: Weights to load; ``None`` for none.
        pretrained: Load timm's pretrained weights for the model (used when no checkpoint is given).
        model_kwargs: Constructor arguments, overriding saved ones (``num_classes`` too).
        img_size: Evaluation size, passed to the constructor of models built for a fixed input size.

    Returns:
        The model and its name.
    """
    saved = _choose_model_config(model_name, checkpoint)
    kwargs = {**saved.kwargs, **(model_kwargs or {})}
    with hub_errors(saved.name):  # an hf-hub: name downloads its config.json here
        create_args = resolve_model_input_args(
            saved.name, args={'img_size': img_size}, pretrained_cfg=saved.pretrained_cfg,
            pretrained_cfg_overlay=saved.cfg_overlay, **kwargs)
    model = create_model(pretrained=pretrained and checkpoint is None, **create_args)
    if checkpoint is not None:
        _logger.info('loading %s%s', checkpoint.weights, ' (EMA entry)' if checkpoint.ema_entry else '')
        _load_weights(model, checkpoint)
    return model.eval(), model_name or saved.name


def _load_weights(model: torch.nn.Module, checkpoint: ResolvedCheckpoint) -> None:
    """Load strictly; a model's ``checkpoint_filter_fn`` that trips over another architecture's keys (timm's
    ConvNeXt raises KeyError) is reported like any other mismatch, by the keys that do not fit."""
    try:
        load_model_weights(model, checkpoint.weights, use_ema=checkpoint.ema_entry)
    except CheckpointError:
        raise
    except (KeyError, IndexError, ValueError, RuntimeError) as e:
        state_dict = extract_state_dict(load_file(checkpoint.weights), use_ema=checkpoint.ema_entry)
        check_state_dict(model, state_dict, source=checkpoint.weights)
        raise CheckpointError(f'{checkpoint.weights} does not fit {type(model).__name__}: {e!r}') from e
