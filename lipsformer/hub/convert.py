"""Command line: ``python -m lipsformer.hub.convert SRC OUT_DIR [--model NAME] [--model-kwargs K=V ...]``.

Turns weights into a timm model folder (``config.json`` + ``model.safetensors``, as ``timm.models.save_for_hf``
writes it) that ``timm.create_model('local-dir:OUT_DIR', pretrained=True)`` and transformers'
``AutoModelForImageClassification.from_pretrained(OUT_DIR)`` load, and checks that timm does: the folder is reloaded
that way and its logits compared with the source model's before it is moved into place.

SRC is an authors' checkpoint (``{'model', ..., 'config'}``; the architecture, classes, input size and interpolation
come from its yacs config), or anything validate.py's ``--checkpoint`` takes: a training run folder, an export, a
checkpoint folder, a ``.safetensors`` or a timm ``train.py`` checkpoint (``model_best.pth.tar``, whose saved arguments
name the model); ``--model`` names the architecture when nothing in or next to the file does, and takes precedence
over an authors' config. Files are read by :mod:`lipsformer.weights.weight_files`, which never runs pickled code.
"""
import argparse
import logging
import os
import shutil
import sys
from typing import Any

import timm
import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, ImageNetInfo
from timm.models import split_model_name_tag

from ..evaluation.checkpoints import create_eval_model, resolve_checkpoint
from ..evaluation.errors import EvaluationError
from ..utils.cli import HelpFormatter, ModelKwargs, command_name
from ..utils.io import os_error_in_chain, replace_dir, unwritable_file_reason, write_remedy
from ..weights.model_folder import save_model_folder
from ..weights.model_names import meant_argument, unaccepted_kwargs
from ..weights.weight_files import CheckpointError, load_checkpoint_dict, load_file

__all__ = ['ConversionError', 'authors_model_config', 'convert', 'main']

_logger = logging.getLogger(__name__)

EXIT_BAD_INPUT, EXIT_OS_ERROR = 2, 4  # train.py's and validate.py's statuses for the same problems

# The authors' yacs MODEL.TYPE -> our family, and where each constructor argument lives in their config.
_AUTHORS_FAMILIES = {'swin': 'lipsformer_swin'}
_AUTHORS_SWIN_KEYS = {'patch_size': 'PATCH_SIZE', 'in_chans': 'IN_CHANS', 'embed_dim': 'EMBED_DIM',
                      'depths': 'DEPTHS', 'num_heads': 'NUM_HEADS', 'window_size': 'WINDOW_SIZE',
                      'mlp_ratio': 'MLP_RATIO', 'qkv_bias': 'QKV_BIAS'}
# ImageNet label sets by class count, for the authors' ImageNet checkpoints (DATA.DATASET imagenet / imagenet22K).
_IMAGENET_SUBSETS = {1000: 'imagenet-1k', 21841: 'imagenet-22k'}


class ConversionError(ValueError):
    """A source that cannot be converted, or an output folder that must not be written."""


def authors_model_config(config: dict[str, Any], model_name: str | None = None
                         ) -> tuple[str, dict[str, Any], dict[str, Any], list[str] | None]:
    """The model an authors' yacs config describes.

    Args:
        config: The ``config`` entry of an authors' checkpoint (read as nested dicts).
        model_name: The registered model name ``--model`` gives; then ``MODEL.TYPE`` is not needed (the config's
            ``MODEL.SWIN`` arguments, class count and input size still apply to a LipsFormer-Swin).

    Returns:
        The registered model name (``model_name``, else the variant whose width, depths and heads match, else the
        family's tiny one with every argument given), its constructor arguments, the preprocessing (input size,
        interpolation, crop_pct) and the label names (ImageNet synsets for their ImageNet checkpoints, else None).
    """
    model, data = config.get('MODEL', {}), config.get('DATA', {})
    family = _AUTHORS_FAMILIES.get(str(model.get('TYPE', '')).lower())
    if family is None and model_name is None:
        raise ConversionError(f'the checkpoint\'s config has MODEL.TYPE {model.get("TYPE")!r}; only the authors\' '
                              f'{", ".join(_AUTHORS_FAMILIES)} models are known. Give --model to name the architecture')
    swin = family is not None or split_model_name_tag(model_name)[0].startswith(_AUTHORS_FAMILIES['swin'])
    section = model.get('SWIN', {}) if swin else {}
    kwargs = {ours: section[theirs] for ours, theirs in _AUTHORS_SWIN_KEYS.items() if theirs in section}
    kwargs.update({ours: source[theirs] for ours, source, theirs in (
        ('num_classes', model, 'NUM_CLASSES'), ('img_size', data, 'IMG_SIZE')) if theirs in source})
    for key in ('depths', 'num_heads'):
        if key in kwargs:
            kwargs[key] = tuple(kwargs[key])
    name = model_name or _matching_variant(family, kwargs)
    crop_pct = 0.875 if config.get('TEST', {}).get('CROP', True) else 1.0
    img_size = data.get('IMG_SIZE', 224)
    data_config = dict(input_size=(kwargs.get('in_chans', 3), img_size, img_size), crop_pct=crop_pct,
                       interpolation=data.get('INTERPOLATION', 'bicubic'), mean=IMAGENET_DEFAULT_MEAN,
                       std=IMAGENET_DEFAULT_STD)
    subset = _IMAGENET_SUBSETS.get(kwargs.get('num_classes'))
    imagenet = str(data.get('DATASET', '')).lower().startswith('imagenet')
    label_names = ImageNetInfo(subset).label_names() if imagenet and subset else None
    return name, kwargs, data_config, label_names


def _matching_variant(family: str, kwargs: dict[str, Any]) -> str:
    """The registered variant whose own width, depths and heads build the same weights, else the family's tiny one
    (every argument is passed to the constructor anyway; the name is what config.json and the card show)."""
    shape = {key: kwargs[key] for key in ('embed_dim', 'depths', 'num_heads') if key in kwargs}
    rest = {key: value for key, value in kwargs.items() if key not in shape}
    with torch.device('meta'):
        wanted = _shapes(timm.create_model(f'{family}_tiny', **kwargs))
        for name in timm.list_models(f'{family}_*'):
            if _shapes(timm.create_model(name, **rest)) == wanted:
                return name
    return f'{family}_tiny'


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def _authors_config(checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    config = checkpoint.get('config')
    return config if isinstance(config, dict) and isinstance(config.get('MODEL'), dict) else None


def load_source(src: str, model_name: str | None = None, model_kwargs: dict[str, Any] | None = None,
                use_ema: bool = False) -> tuple[torch.nn.Module, dict[str, Any] | None, dict[str, Any] | None]:
    """The model SRC holds, with its weights, preprocessing (None: the model's pretrained cfg) and label config.

    Raises:
        ConversionError, CheckpointError: SRC cannot be read or does not fit the model.
    """
    checkpoint = load_file(src) if os.path.isfile(src) else None
    authors_config = _authors_config(checkpoint) if checkpoint is not None else None
    try:
        if authors_config is None:
            try:
                resolved = resolve_checkpoint(src, use_ema=use_ema)
                model, _ = create_eval_model(model_name, resolved, model_kwargs=model_kwargs)
            except EvaluationError as e:
                raise ConversionError(str(e)) from e
            label_names = model.pretrained_cfg.get('label_names')  # from the config.json beside the weights
            return model, None, {'label_names': label_names} if label_names else None
        name, kwargs, data_config, label_names = authors_model_config(authors_config, model_name)
        kwargs.update(model_kwargs or {})
        model = timm.create_model(name, **kwargs)
    except (ConversionError, CheckpointError):  # the weights file's or the saved config's problem, as it says
        raise
    except (TypeError, ValueError) as e:  # the constructor's refusal of an argument
        if isinstance(e, TypeError) and 'keyword argument' not in str(e):
            raise
        if isinstance(e, ValueError):
            raise ConversionError(f'the model cannot be built with these arguments: {e}') from e
        rejected, meant = ', '.join(unaccepted_kwargs(e, model_kwargs or {})), meant_argument(e)
        raise ConversionError(f'--model-kwargs: the model takes no {rejected}'
                              + (f'; did you mean {meant}?' if meant else f' ({e})')) from e
    load_checkpoint_dict(model, checkpoint, source=src, use_ema=use_ema)
    return model.eval(), data_config, {'label_names': label_names} if label_names else None


def _check_output(out_dir: str, src: str, force: bool) -> None:
    reason = unwritable_file_reason(os.path.join(out_dir, 'config.json'))  # the folder's parents, and permissions
    if reason and not (os.path.exists(out_dir) and not os.path.isdir(out_dir)):
        raise ConversionError(f'{out_dir!r} cannot be written: {reason}; give another folder')
    if not os.path.exists(out_dir) or (os.path.isdir(out_dir) and not os.listdir(out_dir)):
        return
    if not os.path.isdir(out_dir):
        raise ConversionError(f'{out_dir!r} is a file; give a folder to write the timm model folder into')
    if not force:
        raise ConversionError(f'{out_dir!r} is not empty; give an empty or new folder, or --force to replace a '
                              f'model folder')
    if os.path.commonpath([os.path.abspath(src), os.path.abspath(out_dir)]) == os.path.abspath(out_dir):
        raise ConversionError(f'--force would delete the source: {src!r} is inside {out_dir!r}')
    if not os.path.isfile(os.path.join(out_dir, 'config.json')):
        raise ConversionError(f'--force replaces model folders only, and {out_dir!r} has no config.json; remove it '
                              f'yourself if nothing in it is needed')


def logit_difference(model: torch.nn.Module, folder: str, batch_size: int = 2) -> float:
    """Max |logit difference| between ``model`` and ``timm.create_model('local-dir:<folder>', pretrained=True)`` on
    random images of the folder's input size."""
    reloaded = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
    inputs = torch.randn(batch_size, *reloaded.pretrained_cfg['input_size'], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return (model.eval()(inputs) - reloaded(inputs)).abs().max().item()


def convert(src: str, out_dir: str, model_name: str | None = None, model_kwargs: dict[str, Any] | None = None,
            use_ema: bool = False, force: bool = False) -> dict[str, Any]:
    """Write SRC's model as a timm folder at ``out_dir`` (atomically) after checking it reloads to equal logits.

    Args:
        src: An authors' checkpoint, a training run, an export, a checkpoint folder or a weights file.
        out_dir: The folder to write; it must be new or empty, or a model folder with ``force``.
        model_name: Registered model name; needed for a weights file with no config beside it.
        model_kwargs: Constructor arguments added to (or replacing) the ones found.
        use_ema: Convert the EMA weights.
        force: Replace an existing model folder.

    Returns:
        ``out_dir``, ``architecture``, ``num_classes``, ``params`` and ``max_abs_logit_difference``.
    """
    src, out_dir = os.path.abspath(src), os.path.abspath(out_dir)
    if not os.path.exists(src):
        raise ConversionError(f'{src!r} does not exist')
    _check_output(out_dir, src, force)
    model, data_config, model_config = load_source(src, model_name, model_kwargs, use_ema)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = os.path.join(parent, f'.{os.path.basename(out_dir)}.tmp-{os.getpid()}')
    try:
        save_model_folder(model, tmp_dir, model_config=model_config, data_config=data_config)
        difference = logit_difference(model, tmp_dir)
        if difference != 0.0:
            raise ConversionError(f'the written folder does not reproduce the source model (max |logit difference| '
                                  f'{difference:g}); nothing was written to {out_dir!r}')
        replace_dir(tmp_dir, out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return dict(out_dir=out_dir, architecture=model.pretrained_cfg['architecture'], num_classes=model.num_classes,
                params=sum(p.numel() for p in model.parameters()), max_abs_logit_difference=difference)


def build_convert_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=command_name('lipsformer.hub.convert'), description=__doc__.split('\n\n')[1],
                                     formatter_class=HelpFormatter)
    parser.add_argument('src', help='authors\' checkpoint, training run folder, export, checkpoint folder or weights '
                                    'file')
    parser.add_argument('out_dir', help='timm model folder to write (new or empty; see --force)')
    parser.add_argument('--model', help='registered model name (default: from the authors\' config, the config.json '
                                        'or config.yaml beside the weights)')
    parser.add_argument('--model-kwargs', nargs='*', default={}, action=ModelKwargs, metavar='KEY=VALUE',
                        help='constructor arguments, as timm\'s scripts take them (num_classes=10 depths=[2,2,6,2])')
    parser.add_argument('--use-ema', action='store_true', help='convert the EMA weights')
    parser.add_argument('--force', action='store_true', help='replace OUT_DIR if it is a model folder')
    return parser


def _write_failure(error: OSError, out_dir: str) -> str:
    """The one line that says which file the system refused and what to do, by the cause."""
    out_dir = os.path.abspath(out_dir)
    where = os.path.dirname(out_dir)
    if error.filename and os.path.commonpath([os.path.abspath(error.filename), where]) != where:
        return f'{error.filename}: {error.strerror}'  # the source, or a file elsewhere
    return (f'{out_dir} could not be written: {error.strerror}; nothing was written there '
            f'({write_remedy(error, "give another OUT_DIR")})')


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for bad input, 4 when the folder cannot be written: a full disk,
    permissions), with the reason on stderr."""
    logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s: %(message)s')
    parser = build_convert_parser()
    args = parser.parse_args(argv)
    try:
        result = convert(args.src, args.out_dir, args.model, args.model_kwargs, args.use_ema, args.force)
    except (ConversionError, CheckpointError) as e:
        print(f'{parser.prog}: error: {e}', file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as e:  # noqa: BLE001  a failed write is safetensors' or torch's error as often as an OSError
        system_error = os_error_in_chain(e)
        if system_error is None:
            raise
        print(f'{parser.prog}: error: {_write_failure(system_error, args.out_dir)}', file=sys.stderr)
        return EXIT_OS_ERROR
    print(f'wrote {result["out_dir"]}: {result["architecture"]}, {result["num_classes"]} classes, '
          f'{result["params"]:,} parameters; timm.create_model(\'local-dir:{result["out_dir"]}\', pretrained=True) '
          f'reproduces the source logits (max |difference| {result["max_abs_logit_difference"]:g})')
    return 0


if __name__ == '__main__':
    sys.exit(main())
