"""Command line of validate.py: ImageNet val, ImageNet-ReaL and ImageNet-V2 in one run, for any timm model.

Example::

    python validate.py --model lipsformer_cswin_tiny --checkpoint runs/cswin_tiny --use-ema \\
        --data-dir /data/imagenet/val --real-labels --v2-dir /data/imagenetv2-matched-frequency-format-val \\
        --results-file out.json

Runs on one process, or sharded over devices with ``accelerate launch validate.py ...`` (same numbers).
"""
import argparse
import logging
import os
import sys

import torch
from accelerate import Accelerator
from timm.data import resolve_input_data_config

from ..fastpath import to_fast_form
from ..training.compilation import COMPILE_SCOPES, CUDA_GRAPH_MODES, compile_model, effective_mode
from ..utils.cli import ModelKwargs, command_name
from ..utils.io import unwritable_file_reason
from ..utils.processes import end_processes, select_device, set_cudnn_benchmark, wants_cpu_group
from ..weights.model_names import UnknownModelError, expand_model_names, unaccepted_kwargs
from ..weights.weight_files import CheckpointError
from .checkpoints import ResolvedCheckpoint, create_eval_model, resolve_checkpoint
from .dataset_passes import DataRequest, PlannedPass, evaluate, plan_datasets
from .errors import EvaluationError
from .predict import InferenceSettings
from .real import load_real_labels
from .records import model_record, results_table, write_results

__all__ = ['build_validate_parser', 'run', 'main']

_logger = logging.getLogger('lipsformer.evaluation')
_BUNDLED_REAL_LABELS = 'bundled'
_DATA_CONFIG_KEYS = ('img_size', 'input_size', 'crop_pct', 'crop_mode', 'interpolation', 'mean', 'std')
_AMP_DTYPES = {'float16': 'fp16', 'bfloat16': 'bf16'}
EXIT_BAD_INPUT, EXIT_OS_ERROR = 2, 4  # train.py's statuses for the same problems


class ResultsNotWrittenError(Exception):
    """Every model was evaluated but the results file could not be written: the records are kept for the table."""

    def __init__(self, records: list[dict], accelerator: Accelerator, path: str, error: OSError):
        super().__init__(f'the results could not be written to --results-file {path!r}: {error.strerror or error}; '
                         f'the table above holds them (free space or fix the permissions, or give another '
                         f'--results-file)')
        self.records = records
        self.accelerator = accelerator


def _amp_precision(value: str) -> str:
    """``--amp``'s value: bf16 / fp16 (or timm's dtype names)."""
    value = _AMP_DTYPES.get(value, value)
    if value not in ('bf16', 'fp16'):
        raise argparse.ArgumentTypeError(f'{value!r}: use bf16 or fp16 (or a bare --amp with --amp-dtype)')
    return value


def _default_workers() -> int:
    """timm's 4 loader workers, or fewer where the process may use fewer CPUs (more only contend for them, and torch
    warns about them)."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count() or 1))


def build_validate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=command_name('lipsformer.evaluation.validate_command'),
        description='Evaluate a timm or LipsFormer model on ImageNet val, ImageNet-ReaL and ImageNet-V2 in one run. '
                    'Runs on one process, or sharded with accelerate launch (same numbers). timm validate.py\'s '
                    'flags mean what they mean there.')
    parser.add_argument('data', nargs='?', metavar='DIR', help='the --data-dir folder, given as timm\'s (deprecated) '
                                                               'positional argument')
    model = parser.add_argument_group('model')
    model.add_argument('--model', '-m', help='model name, comma list or wildcard (lipsformer_cswin_*); optional '
                                             'when --checkpoint has a config.json / run config.yaml, or is a timm '
                                             'train.py checkpoint (its saved arguments name the model)')
    model.add_argument('--checkpoint', help='weights file (.safetensors, timm train.py\'s .pth.tar, authors\' .pth), '
                                            'a folder with model.safetensors, or a training run folder (export/best, '
                                            'export/last, else the newest checkpoint); without it, timm pretrained '
                                            'weights')
    model.add_argument('--pretrained', action='store_true',
                       help='timm\'s pretrained weights of --model (what is evaluated without --checkpoint; with it, '
                            'as in timm, the checkpoint\'s weights replace them)')
    model.add_argument('--use-ema', action='store_true', help='evaluate the EMA weights of the checkpoint')
    model.add_argument('--num-classes', type=int, help='classifier size, if not the model default')
    model.add_argument('--in-chans', type=int, help='input channels, if not the model default (else --input-size\'s '
                                                    'first value)')
    model.add_argument('--gp', metavar='POOL', help='global pool type of the head (avg, max, avgmax, ...), if not the '
                                                    'model default')
    model.add_argument('--model-kwargs', nargs='*', default={}, action=ModelKwargs, metavar='KEY=VALUE',
                       help='extra model constructor arguments')
    data = parser.add_argument_group('data')
    data.add_argument('--data-dir', help='ImageNet val in synset folders (any subset of the 1000 folders and of '
                                         'the images), or, as in timm, the data set root with the --split folder')
    data.add_argument('--data-layout', choices=('imagenet', 'imagefolder'), default='imagenet',
                      help='imagefolder: any class-folder data set, each folder labelled by its name among the '
                           'classes saved with the checkpoint (else classes in natural sort order)')
    data.add_argument('--real-labels', nargs='?', const=_BUNDLED_REAL_LABELS, metavar='FILE',
                      help='also score --data-dir with ImageNet-ReaL labels (timm\'s bundled copy, or FILE)')
    data.add_argument('--v2-dir', nargs='+', action='extend', default=[], metavar='DIR',
                      help='ImageNet-V2 variant folders (0..999 or synset layout); repeatable')
    data.add_argument('--dataset', help='a dataset timm\'s create_dataset opens, as timm\'s --dataset: torch/<name> '
                                        '(torchvision: torch/cifar10, torch/fashion_mnist, ...) or hfds/<name> '
                                        '(Hugging Face datasets), rooted at --data-dir')
    data.add_argument('--split', metavar='NAME',
                      help='the split to score: the --dataset split, or the --data-dir sub-folder (timm\'s synonyms '
                           'val, valid, ... found too); default validation, and without --split a --data-dir with '
                           'no such sub-folder is itself the folder scored')
    data.add_argument('--dataset-download', action='store_true', help='let --dataset download what is missing')
    settings = parser.add_argument_group('evaluation settings (default: the model\'s pretrained cfg)')
    settings.add_argument('--img-size', type=int, help='input resolution')
    settings.add_argument('--input-size', type=int, nargs=3, metavar=('C', 'H', 'W'),
                          help='input channels and size, as timm (e.g. 3 256 320)')
    settings.add_argument('--crop-pct', type=float, help='centre crop fraction')
    settings.add_argument('--crop-mode', choices=('center', 'squash', 'border'), help='crop mode')
    settings.add_argument('--interpolation', help='resize interpolation (bicubic, bilinear, ...)')
    settings.add_argument('--mean', type=float, nargs='+', help='normalisation mean')
    settings.add_argument('--std', type=float, nargs='+', help='normalisation std')
    settings.add_argument('--batch-size', '-b', type=int, default=256, help='images per batch and process (256)')
    settings.add_argument('--workers', '-j', type=int, default=_default_workers(),
                          help=f'data loading workers per process (4, or the CPUs this process may use when fewer: '
                               f'{_default_workers()} here)')
    settings.add_argument('--amp', nargs='?', const=True, type=_amp_precision, metavar='{bf16,fp16}',
                          help='mixed precision: bare --amp uses --amp-dtype, as timm (fp16 needs a GPU)')
    settings.add_argument('--amp-dtype', choices=tuple(_AMP_DTYPES),
                          help='--amp precision: float16 (the default, as timm) or bfloat16; implies --amp')
    settings.add_argument('--torchcompile', nargs='?', const='inductor', metavar='BACKEND',
                          help='torch.compile the model, with this backend (inductor), as timm')
    settings.add_argument('--torchcompile-mode', choices=('default', *CUDA_GRAPH_MODES, 'max-autotune-no-cudagraphs'),
                          help='inductor\'s mode with --torchcompile (default); the CUDA-graph modes compile as their '
                               'modes without graphs elsewhere')
    settings.add_argument('--torchcompile-scope', choices=COMPILE_SCOPES, default='regional',
                          help='with --torchcompile: regional (each LipsFormer block, once per block shape; a model '
                               'without them compiles whole) or whole (the whole model)')
    settings.add_argument('--channels-last', action='store_true', help='NHWC memory layout')
    settings.add_argument('--cudnn-benchmark', action=argparse.BooleanOptionalAction, default=True,
                          help='cuDNN autotuning, as timm\'s validate.py sets it: cuDNN times its kernels at the first '
                               'batch of each input shape and keeps the fastest (on; --no-cudnn-benchmark takes its '
                               'heuristic\'s pick, the same kernels in every run)')
    settings.add_argument('--device', help='cpu, or an accelerator (cuda, cuda:1, mps, xpu, ...); default: the one '
                                           'accelerate gives each process, else the CPU')
    settings.add_argument('--cpu', action='store_true', help='run on CPU even if a GPU is available (--device cpu)')
    settings.add_argument('--log-every', type=int, default=50, help='progress log every N batches (50; 0: off)')
    output = parser.add_argument_group('output')
    output.add_argument('--results-file', help='write the results here')
    output.add_argument('--results-format', choices=('json', 'csv'), default='json', help='results file format (json)')
    return parser


def _check_args(args: argparse.Namespace) -> None:
    args.amp = _resolve_amp(args.amp, args.amp_dtype)
    if args.batch_size < 1 or args.workers < 0:
        raise EvaluationError('--batch-size must be at least 1 and --workers at least 0')
    if args.use_ema and not args.checkpoint:
        raise EvaluationError('--use-ema needs --checkpoint')
    if args.model is None and not args.checkpoint:
        raise EvaluationError('give --model, --checkpoint, or both')
    if args.data is not None:
        if args.data_dir is not None and args.data_dir != args.data:
            raise EvaluationError(f'the data folder is given twice: {args.data!r} and --data-dir {args.data_dir!r}; '
                                  f'give --data-dir alone')
        args.data_dir = args.data
    if args.cpu and args.device not in (None, 'cpu'):
        raise EvaluationError(f'--cpu and --device {args.device} disagree; give one of them')
    if args.results_file:
        reason = unwritable_file_reason(args.results_file)
        if reason:
            raise EvaluationError(f'--results-file {args.results_file!r} cannot be written: {reason}')
    if args.pretrained and args.checkpoint:
        _logger.info('--pretrained with --checkpoint: the checkpoint\'s weights are evaluated (they replace every '
                     'pretrained one, as in timm)')


def _resolve_amp(amp: str | bool | None, amp_dtype: str | None) -> str | None:
    """The precision of ``--amp [bf16|fp16]`` and ``--amp-dtype`` (bare ``--amp``: float16, as timm)."""
    dtype = _AMP_DTYPES[amp_dtype] if amp_dtype else None
    if isinstance(amp, str) and dtype and amp != dtype:
        raise EvaluationError(f'--amp {amp} and --amp-dtype {amp_dtype} disagree; give one of them')
    if amp is None and dtype is None:
        return None
    return amp if isinstance(amp, str) else dtype or 'fp16'


def _make_accelerator(args: argparse.Namespace) -> Accelerator:
    try:
        cpu = select_device('cpu' if args.cpu else args.device)
    except ValueError as e:
        raise EvaluationError(str(e)) from e
    set_cudnn_benchmark(args.cudnn_benchmark)
    # Several processes launched on a host without an accelerator (accelerate launch --multi_gpu, torchrun) form one
    # CPU (gloo) group, as in training.
    accelerator = Accelerator(cpu=cpu or wants_cpu_group(),
                              mixed_precision=args.amp or 'no')
    if args.amp == 'fp16' and accelerator.device.type == 'cpu':
        raise EvaluationError('--amp fp16 runs only on a GPU (on CPU it would silently stay fp32); use --amp bf16 '
                              '(--amp --amp-dtype bfloat16)')
    if not accelerator.is_main_process:
        _logger.setLevel(logging.WARNING)
    return accelerator


def _data_config(model: torch.nn.Module, args: argparse.Namespace) -> dict:
    overrides = {key: getattr(args, key) for key in _DATA_CONFIG_KEYS if getattr(args, key) is not None}
    try:
        return resolve_input_data_config(model, args=overrides, use_test_size=True)
    except ValueError as e:
        raise EvaluationError(f'evaluation settings do not fit the model: {e}') from e


def _evaluate_model(model_name: str | None, checkpoint: ResolvedCheckpoint | None, args: argparse.Namespace,
                    passes: list[PlannedPass], accelerator: Accelerator) -> dict:
    """Build one model, run every planned pass and return its results record."""
    in_chans = args.in_chans if args.in_chans is not None else args.input_size[0] if args.input_size else None
    given = dict(num_classes=args.num_classes, in_chans=in_chans, global_pool=args.gp)
    model_kwargs = dict(args.model_kwargs, **{key: value for key, value in given.items() if value is not None})
    try:
        model, model_name = create_eval_model(
            model_name, checkpoint, pretrained=checkpoint is None, model_kwargs=model_kwargs, img_size=args.img_size)
    except TypeError as e:
        if 'keyword argument' not in str(e):
            raise
        raise EvaluationError(f'--model-kwargs: {model_name or "the model"} does not accept '
                              f'{unaccepted_kwargs(e, model_kwargs)} ({e})') from e
    except RuntimeError as e:
        if checkpoint is None and 'No pretrained weights exist' in str(e):
            raise EvaluationError(f'{model_name} has no pretrained weights registered with timm; pass --checkpoint '
                                  f'with the weights to evaluate') from e
        raise
    except (CheckpointError, EvaluationError):  # the weights file's or the saved config's problem, as it says
        raise
    except ValueError as e:  # the constructor's refusal of an argument (LipsFormer: img_size a multiple of 32)
        raise EvaluationError(f'{model_name or "the model"} cannot be built with these arguments: {e}') from e
    data_config = _data_config(model, args)
    _check_input_size(model, data_config)
    model = model.to(accelerator.device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    param_count = sum(p.numel() for p in model.parameters())
    _logger.info('%s: %.2fM params, data config %s', model_name, param_count / 1e6, data_config)
    compiled_scope = None
    if args.torchcompile:
        model, compiled_scope = _compiled(model, args, accelerator.device.type)
    else:
        to_fast_form(model, accelerator.device.type)  # where the fast path is on for the device
    inference = InferenceSettings(args.batch_size, args.workers, args.channels_last, args.log_every)
    results = evaluate(model, passes, data_config, accelerator, inference)
    settings = dict(data_config, batch_size=args.batch_size, amp=args.amp, channels_last=args.channels_last,
                    torchcompile=args.torchcompile, use_ema=args.use_ema, num_processes=accelerator.num_processes,
                    torchcompile_scope=compiled_scope,
                    torchcompile_mode=effective_mode(args.torchcompile_mode or 'default', accelerator.device.type)
                    if args.torchcompile == 'inductor' else None,
                    device=str(accelerator.device), cudnn_benchmark=torch.backends.cudnn.benchmark)
    return model_record(model_name, checkpoint.weights if checkpoint else None, settings, results, param_count)


def _check_input_size(model: torch.nn.Module, data_config: dict) -> None:
    """Refuse an input size the model's forward would refuse (LipsFormer: multiples of its ``input_divisor``),
    before any image is read, naming the sizes nearest to it that fit."""
    divisor, (height, width) = getattr(model, 'input_divisor', None), data_config['input_size'][1:]
    if not divisor or (height % divisor == 0 and width % divisor == 0):
        return
    nearest = sorted({max(divisor, size // divisor * divisor) for size in (height, width)}
                     | {-(-size // divisor) * divisor for size in (height, width)})
    raise EvaluationError(f'input size {height}x{width} (--img-size / --input-size, else the pretrained cfg): the '
                          f'model takes heights and widths that are multiples of {divisor}, because its patch '
                          f'embedding and the downsampling between its stages shrink the image {divisor}-fold and '
                          f'each must divide it evenly; did you mean {" or ".join(map(str, nearest))}?')


def _compiled(model: torch.nn.Module, args: argparse.Namespace, device_type: str) -> tuple[torch.nn.Module, str]:
    """The model compiled with ``--torchcompile``'s backend, mode and scope (:func:`compile_model`; the compiled module
    keeps the model's attributes such as num_classes), and the scope that was compiled."""
    backend = args.torchcompile
    if backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise EvaluationError(f'--torchcompile {backend}: not a torch.compile backend; use one of '
                              f'{", ".join(torch._dynamo.list_backends())}')
    if args.torchcompile_mode is not None and backend != 'inductor':
        raise EvaluationError(f'--torchcompile-mode {args.torchcompile_mode}: modes are inductor\'s; drop it or use '
                              f'--torchcompile inductor')
    return compile_model(model, args.torchcompile_scope, args.torchcompile_mode, device_type, backend=backend)


def run(args: argparse.Namespace) -> tuple[list[dict], Accelerator]:
    """Evaluate every requested model on every requested data set, writing the results file after each model (so a
    failure in a later model keeps the finished ones).

    Returns:
        One results record per model, and the accelerator (which process is the main one).
    """
    _check_args(args)
    try:
        model_names = expand_model_names(args.model, with_weights=not args.checkpoint) if args.model else [None]
    except UnknownModelError as e:
        raise EvaluationError(f'--model: {e}' + ('; evaluate one of them with --checkpoint' if 'none with pretrained'
                                                  in str(e) else '')) from None
    if args.checkpoint and len(model_names) > 1:
        raise EvaluationError(f'--checkpoint holds one model\'s weights but --model names {len(model_names)} models')
    real_labels = None
    if args.real_labels is not None:
        real_labels = load_real_labels(None if args.real_labels == _BUNDLED_REAL_LABELS else args.real_labels)
    checkpoint = resolve_checkpoint(args.checkpoint, args.use_ema) if args.checkpoint else None
    class_names = checkpoint.model_config.class_names if checkpoint and checkpoint.model_config else None
    passes = plan_datasets(DataRequest(args.data_dir, args.data_layout, real_labels, tuple(args.v2_dir), class_names,
                                       args.dataset, args.split, args.dataset_download))
    accelerator = _make_accelerator(args)
    records, write_error = [], None
    for name in model_names:
        records.append(_evaluate_model(name, checkpoint, args, passes, accelerator))
        if args.results_file and accelerator.is_main_process:
            try:
                write_results(args.results_file, records, args.results_format)
                write_error = None
            except OSError as e:  # the next model's write may succeed; the last failure is reported after all
                write_error = e
    if write_error is not None:
        raise ResultsNotWrittenError(records, accelerator, args.results_file, write_error)
    return records, accelerator


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit status: 2 for bad input, 4 when the results file could not be written
    after the evaluation (the table is printed first), with the reason on stderr."""
    logging.basicConfig(level=logging.INFO, format='%(levelname)s %(name)s: %(message)s')
    parser = build_validate_parser()
    args = parser.parse_args(argv)
    try:
        records, accelerator = run(args)
        write_error = None
    except (EvaluationError, CheckpointError) as e:
        print(f'{parser.prog}: error: {e}', file=sys.stderr)
        return EXIT_BAD_INPUT
    except ResultsNotWrittenError as e:
        records, accelerator, write_error = e.records, e.accelerator, e
    if accelerator.is_main_process:
        print(results_table(records))
        if write_error is not None:
            print(f'{parser.prog}: error: {write_error}', file=sys.stderr)
        elif args.results_file:
            _logger.info('results written to %s', args.results_file)
    # Shut a launched run's process group down before the interpreter exits: gloo's threads, torn down at exit
    # instead, can abort a rank (SIGABRT) after its results were written.
    end_processes(accelerator)
    return 0 if write_error is None else EXIT_OS_ERROR
