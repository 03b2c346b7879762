"""train.py's command line: the options, timm train.py's flags as aliases of config keys, and :func:`main`.

``train.py``, ``lipsformer-train`` and ``python -m lipsformer.training.train_command`` all run :func:`main`. Options and
``key.sub=value`` overrides mix in any order (``--config C a.b=1 --output D c.d=2``). Each timm flag in
:data:`TIMM_ALIASES` becomes the override of one config key (``--help`` names it); an alias and an override that set
one key to different values are an error, never a silent choice.
"""
import argparse
import dataclasses
import difflib
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import yaml
from timm.utils import ParseKwargs

from ..data import DatasetError
from ..utils.cli import command_name
from ..utils.io import os_error_in_chain, unusable_folder_reason
from ..utils.processes import LaunchError
from ..weights.weight_files import CheckpointError
from .config import Config, ConfigError
from .config_io import coerce_key, config_to_yaml, load_config, parse_override, reference_yaml
from .loop import NonFiniteLossError
from .run_files import CONFIG_FILE
from .run_lock import RunFolderGoneError, RunFolderInUseError
from .signals import HeldTermination, SecondInterrupt
from .trackers import chosen_trackers
from .train_state import list_checkpoints
from .trainer import PeerProcessDiedError, report_end, train

__all__ = ['TIMM_ALIASES', 'Alias', 'main', 'parse_args', 'resolve_overrides']

_logger = logging.getLogger('lipsformer.train')

EXIT_UNEXPECTED, EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_OS_ERROR, EXIT_ABORTED = 1, 2, 3, 4, 130
EXIT_RUN_FOLDER_GONE, EXIT_PROCESS_DIED = 5, 6

_DESCRIPTION = """Train a LipsFormer (or any timm model) with the paper's no-warmup recipe.

    python train.py --config configs/lipsformer_cswin_tiny.yaml --data-dir /data/imagenet --output runs/x
    lipsformer-train --config lipsformer_cswin_tiny --data-dir /data/imagenet --output runs/x   # a packaged config
    accelerate launch train.py --config ... --output runs/x            # several GPUs / nodes
    python train.py --config configs/quickstart.yaml optimizer.lr=1e-3 --output runs/q train.epochs=2
    python train.py --config configs/quickstart.yaml --lr 1e-3 -b 64 --epochs 2 --output runs/q   # timm's flags

Any config key can be overridden as key.sub=value (the value is parsed as YAML), before, between or after the
options; configs/reference.yaml documents every key. timm train.py's common flags set config keys (listed below
with the key each sets); giving a flag and an override of the same key with different values is an error.

Exit status (the last log line gives the reason):
  0    finished, or stopped by SIGTERM / SIGINT after saving a checkpoint (continue with --resume auto)
  1    an unexpected error, a bug: the traceback is printed above the reason
  2    a config, data or checkpoint problem, a run folder another run holds, or processes launched that would not
       train as one group: the message says what to change
  3    training diverged: train.max_nonfinite_steps updates in a row had a non-finite loss (across epochs), or the
       weights or an evaluation's loss are not finite; summary.json says diverged, nothing is exported, and the
       message names the last good checkpoint
  4    the operating system refused a read or write (disk full, permissions, I/O error), wherever the error came
       from (torch, safetensors): the last line gives the system's words; saved checkpoints are whole
  5    the run folder (or its .lock) was removed or replaced while the run trained: the run stops, and saves what
       it held as a checkpoint in the folder made again (the message names it) unless another run holds it now
  6    another process of a multi-process run died (killed, crashed): the message names it where it can; the
       checkpoints saved are whole
  130  Ctrl-C aborted without saving (a second one during training, or one during set-up or the final export);
       the checkpoints saved before are whole
"""


@dataclasses.dataclass(frozen=True)
class Alias:
    """A timm train.py flag that sets config keys.

    Attributes:
        flags: The option strings, as timm spells them.
        key: The config key the flag's value sets.
        nargs: argparse nargs for a flag taking several values (a list key); None: one value.
        switch: A boolean flag (``--flag`` / ``--no-flag``) setting ``key`` to true / false.
        implies: Further overrides the flag implies, given its value (e.g. ``--lr`` is absolute, as in timm).
        note: What the flag means where it differs from the config key's plain value.
    """
    flags: tuple[str, ...]
    key: str
    nargs: str | None = None
    switch: bool = False
    implies: Callable[[Any], dict[str, Any]] | None = None
    note: str = ''


def _absolute_lr(_: Any) -> dict[str, Any]:
    return {'optimizer.lr_base_batch_size': None}


def _absolute_ema_decay(_: Any) -> dict[str, Any]:
    return {'ema.reference_batch_size': None}


# timm train.py's flags, with the config key each sets (one table: --help, parsing and the checks all read it).
TIMM_ALIASES: tuple[Alias, ...] = (
    Alias(('--model',), 'model.name'),
    Alias(('--pretrained',), 'model.pretrained', switch=True),
    Alias(('--initial-checkpoint',), 'model.init_checkpoint'),
    Alias(('--num-classes',), 'model.num_classes'),
    Alias(('--img-size',), 'model.img_size'),
    Alias(('--in-chans',), 'model.in_chans'),
    Alias(('--gp',), 'model.kwargs.global_pool', note='the head\'s global pool type (avg, max, avgmax, ...)'),
    Alias(('--drop',), 'model.drop_rate'),
    Alias(('--drop-path',), 'model.drop_path_rate'),
    Alias(('--grad-checkpointing',), 'model.grad_checkpointing', switch=True),
    Alias(('--channels-last',), 'model.channels_last', switch=True),
    Alias(('--torchcompile',), 'model.compile', switch=True,
          note='compile with inductor on any device (the default, model.compile=auto, compiles on CUDA only)'),
    Alias(('--torchcompile-mode',), 'model.compile_mode'),
    Alias(('--torchcompile-scope',), 'model.compile_scope'),
    Alias(('--dataset',), 'data.dataset'),
    Alias(('--train-split',), 'data.train_split'),
    Alias(('--val-split',), 'data.val_split'),
    Alias(('--class-map',), 'data.class_map'),
    Alias(('--dataset-download',), 'data.download', switch=True),
    Alias(('-j', '--workers'), 'data.num_workers'),
    Alias(('--pin-mem',), 'data.pin_memory', switch=True),
    Alias(('--mean',), 'data.mean', nargs='+'),
    Alias(('--std',), 'data.std', nargs='+'),
    Alias(('--interpolation',), 'data.interpolation'),
    Alias(('--crop-pct',), 'data.crop_pct'),
    Alias(('-vb', '--validation-batch-size'), 'data.val_batch_size'),
    Alias(('--scale',), 'augment.scale', nargs='+'),
    Alias(('--ratio',), 'augment.ratio', nargs='+'),
    Alias(('--hflip',), 'augment.hflip'),
    Alias(('--vflip',), 'augment.vflip'),
    Alias(('--color-jitter',), 'augment.color_jitter'),
    Alias(('--aa',), 'augment.auto_augment'),
    Alias(('--reprob',), 'augment.reprob'),
    Alias(('--remode',), 'augment.remode'),
    Alias(('--recount',), 'augment.recount'),
    Alias(('--mixup',), 'augment.mixup'),
    Alias(('--cutmix',), 'augment.cutmix'),
    Alias(('--mixup-prob',), 'augment.mixup_prob'),
    Alias(('--mixup-switch-prob',), 'augment.mixup_switch_prob'),
    Alias(('--mixup-mode',), 'augment.mixup_mode'),
    Alias(('--smoothing',), 'augment.label_smoothing'),
    Alias(('--opt',), 'optimizer.name'),
    Alias(('--opt-eps',), 'optimizer.eps'),
    Alias(('--opt-betas',), 'optimizer.betas', nargs='+'),
    Alias(('--momentum',), 'optimizer.momentum'),
    Alias(('--weight-decay',), 'optimizer.weight_decay'),
    Alias(('--clip-grad',), 'optimizer.clip_grad'),
    Alias(('--clip-mode',), 'optimizer.clip_mode'),
    Alias(('--layer-decay',), 'optimizer.layer_decay'),
    Alias(('--lr',), 'optimizer.lr', implies=_absolute_lr,
          note='the absolute peak lr, as in timm: also sets optimizer.lr_base_batch_size=null, so lr, '
               'scheduler.min_lr and scheduler.warmup_lr are used as given, whatever the global batch'),
    Alias(('--lr-base',), 'optimizer.lr', note='the lr at global batch --lr-base-size, scaled to the actual one'),
    Alias(('--lr-base-size',), 'optimizer.lr_base_batch_size'),
    Alias(('--lr-base-scale',), 'optimizer.lr_scaling'),
    Alias(('--sched',), 'scheduler.name'),
    Alias(('--warmup-epochs',), 'scheduler.warmup_epochs'),
    Alias(('--warmup-lr',), 'scheduler.warmup_lr'),
    Alias(('--min-lr',), 'scheduler.min_lr'),
    Alias(('--cooldown-epochs',), 'scheduler.cooldown_epochs'),
    Alias(('--decay-epochs',), 'scheduler.decay_epochs'),
    Alias(('--decay-milestones',), 'scheduler.decay_milestones', nargs='+'),
    Alias(('--decay-rate',), 'scheduler.decay_rate'),
    Alias(('--model-ema',), 'ema.enabled', switch=True),
    Alias(('--model-ema-decay',), 'ema.decay', implies=_absolute_ema_decay,
          note='the decay per update, as in timm: also sets ema.reference_batch_size=null'),
    Alias(('--model-ema-warmup',), 'ema.warmup', switch=True),
    Alias(('--model-ema-force-cpu',), 'ema.cpu', switch=True),
    Alias(('--epochs',), 'train.epochs'),
    Alias(('-b', '--batch-size'), 'train.batch_size'),
    Alias(('--grad-accum-steps',), 'train.grad_accum_steps'),
    Alias(('--seed',), 'train.seed'),
    Alias(('--cudnn-benchmark',), 'train.cudnn_benchmark', switch=True,
          note='cuDNN autotuning, on by default as timm\'s train.py sets it'),
    Alias(('--device',), 'train.device'),
    Alias(('--log-interval',), 'train.log_interval'),
    Alias(('--checkpoint-hist',), 'checkpoint.keep_last'),
)

_AMP_DTYPES = {'float16': 'fp16', 'bfloat16': 'bf16'}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Options and ``key.sub=value`` overrides, in any order; an unknown option is an error naming the closest."""
    parser = _parser()
    args, unknown = parser.parse_known_intermixed_args(argv)
    # --model-kwargs takes every KEY=VALUE after it: a dotted key there is a config override that followed it
    overrides = [item for item in args.model_kwargs if '.' in item.partition('=')[0]]
    args.model_kwargs = [item for item in args.model_kwargs if item not in overrides]
    args.overrides = [*args.overrides, *overrides]
    bad = [item for item in args.model_kwargs if '=' not in item or not item.partition('=')[0].isidentifier()]
    if bad:
        parser.error(f'--model-kwargs {bad[0]!r} is not KEY=VALUE (e.g. embed_dim=64 depths=2,2,6,2)')
    if unknown:
        known = [s for action in parser._actions for s in action.option_strings]
        close = difflib.get_close_matches(unknown[0].split('=')[0], known, n=1)
        hint = f' (did you mean {close[0]}?)' if close else ''
        parser.error(f'unknown option {unknown[0]}{hint}; {parser.prog} --help lists the options, and any config key '
                     f'is set as key.sub=value (configs/reference.yaml documents them)')
    return args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=command_name('lipsformer.training.train_command'), description=_DESCRIPTION,
                                     allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--config', help='YAML config: a path, or the name of a packaged config '
                                         '(lipsformer_cswin_tiny, quickstart, ablations/alpha_0.1, ...); defaults '
                                         'apply to keys it does not set')
    parser.add_argument('--data-dir', help='dataset root (sets data.data_dir)')
    parser.add_argument('--output', help='run folder (default: runs/<config name>); with --experiment, the folder '
                                         'that holds the run folder, as in timm')
    parser.add_argument('--experiment', help='run name, as in timm: the run folder is <--output or runs>/<name>')
    parser.add_argument('--resume', help='auto (newest checkpoint in --output, if any) or a checkpoint / run folder')
    parser.add_argument('--wait-for-lock', type=float, default=0.0, metavar='SECONDS',
                        help='when another run holds the run folder, wait up to SECONDS for it to end (default 0: '
                             'refuse at once, exit 2)')
    parser.add_argument('--trust-callable', action='append', default=[], metavar='MODULE:CALLABLE',
                        help='let the config name this callable (lipschitz.target): a config is data and may name '
                             'only the package\'s own callables unless you trust another by name (repeatable)')
    parser.add_argument('--print-config', action='store_true', help='print the resolved config and exit')
    parser.add_argument('--print-reference', action='store_true', help='print every key, documented, and exit')
    parser.add_argument('overrides', nargs='*', metavar='key.sub=value', help='config overrides')
    group = parser.add_argument_group('timm train.py flags', 'each sets the config key named (configs/reference.yaml '
                                                             'documents it)')
    group.add_argument('--amp', action=argparse.BooleanOptionalAction, default=None,
                       help='train.mixed_precision: --amp sets it to --amp-dtype (fp16 unless --amp-dtype bfloat16), '
                            '--no-amp to no')
    group.add_argument('--amp-dtype', choices=tuple(_AMP_DTYPES),
                       help='train.mixed_precision with --amp: float16 -> fp16, bfloat16 -> bf16 (implies --amp)')
    group.add_argument('--log-wandb', action='store_true',
                       help='log.trackers: adds wandb to the trackers the config chooses')
    group.add_argument('--model-kwargs', nargs='*', action='extend', default=[], metavar='KEY=VALUE',
                       help='model.kwargs.KEY for each KEY=VALUE, the value read as timm reads it (a Python literal, '
                            'else a string: depths=2,2,6,2 window_size=7 act_layer=gelu); a key.sub=value among them '
                            'is a config override')
    group.add_argument('--input-size', nargs=3, type=int, metavar=('C', 'H', 'W'),
                       help='model.in_chans and model.img_size (square: H = W)')
    for alias in TIMM_ALIASES:
        text = f'{alias.key}: {alias.note}' if alias.note else alias.key
        if alias.switch:
            group.add_argument(*alias.flags, dest=_dest(alias), action=argparse.BooleanOptionalAction, default=None,
                               help=f'{text} (true; --no-{alias.flags[-1][2:]}: false)')
        else:
            group.add_argument(*alias.flags, dest=_dest(alias), nargs=alias.nargs, help=text,
                               metavar=alias.key.split('.')[-1].upper())
    return parser


def _dest(alias: Alias) -> str:
    return 'alias_' + alias.flags[-1].lstrip('-').replace('-', '_')


def _text(value: str | list[str]) -> str:
    """A flag's value as the YAML text of an override (a list flag becomes a YAML list)."""
    return f'[{", ".join(value)}]' if isinstance(value, list) else value


def resolve_overrides(args: argparse.Namespace, config_keys: dict[str, Any]) -> list[str]:
    """The ``key=value`` overrides of the flags given, followed by the explicit overrides.

    Args:
        args: Parsed arguments.
        config_keys: The explicit overrides, parsed: ``{key: value}``.

    Raises:
        ConfigError: A flag and an override (or two flags) set one key to different values.
    """
    from_flags: dict[str, tuple[str, Any]] = {}  # key -> (the flag that set it, its value)

    def put(flag: str, key: str, value: Any) -> None:
        value = coerce_key(key, value)
        if key in config_keys and coerce_key(key, config_keys[key]) != value:
            raise ConfigError(f'{flag} sets {key}={value!r} but the override sets {key}='
                              f'{coerce_key(key, config_keys[key])!r}; give one of them')
        if key in from_flags and from_flags[key][1] != value:
            raise ConfigError(f'{flag} sets {key}={value!r} but {from_flags[key][0]} sets it to '
                              f'{from_flags[key][1]!r}; give one of them')
        from_flags[key] = (flag, value)

    if args.amp is not None or args.amp_dtype is not None:
        amp = args.amp if args.amp is not None else True
        put('--amp' if amp else '--no-amp', 'train.mixed_precision', _AMP_DTYPES[args.amp_dtype or 'float16']
            if amp else 'no')
    if args.input_size is not None:
        channels, height, width = args.input_size
        if height != width:
            raise ConfigError(f'--input-size {channels} {height} {width}: model.img_size is square; give the same '
                              f'height and width')
        put('--input-size', 'model.in_chans', channels)
        put('--input-size', 'model.img_size', height)
    for key, value in _model_kwargs(args.model_kwargs).items():
        put('--model-kwargs', f'model.kwargs.{key}', value)
    for alias in TIMM_ALIASES:
        given = getattr(args, _dest(alias))
        if given is None:
            continue
        flag = alias.flags[-1] if given is not False else f'--no-{alias.flags[-1][2:]}'
        value = given if alias.switch else parse_override(f'{alias.key}={_text(given)}')[1]
        put(flag, alias.key, value)
        for key, implied in (alias.implies(value) if alias.implies else {}).items():
            put(flag, key, implied)
    return [f'{key}={_yaml_text(value)}' for key, (_, value) in from_flags.items()]


def _model_kwargs(items: list[str]) -> dict[str, Any]:
    """``--model-kwargs`` values as timm's train.py reads them (timm.utils.ParseKwargs); tuples become lists."""
    kwargs = argparse.Namespace()
    ParseKwargs(option_strings=['--model-kwargs'], dest='kwargs')(None, kwargs, items)
    return {key: _plain(value) for key, value in kwargs.kwargs.items()}


def _plain(value: Any) -> Any:
    return [_plain(v) for v in value] if isinstance(value, (tuple, list)) else value


def _yaml_text(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()


def _overrides(args: argparse.Namespace) -> list[str]:
    """Every override: the flags' and the explicit ones (those win nothing: a disagreement is an error)."""
    explicit = [*args.overrides, *([f'data.data_dir={args.data_dir}'] if args.data_dir else [])]
    parsed = dict(parse_override(o) for o in explicit)
    flags = resolve_overrides(args, parsed)
    if args.log_wandb:
        flags.append(f'log.trackers={_yaml_text(_with_wandb(args.config, [*flags, *explicit], parsed))}')
    return flags + explicit


def _with_wandb(config_path: str | None, overrides: list[str], parsed: dict[str, Any]) -> list[str]:
    """``--log-wandb``: the trackers the config chooses (null: TensorBoard when installed), and wandb."""
    trackers = load_config(config_path, overrides).log.trackers
    if 'log.trackers' in parsed and not {'wandb', 'all'} & set(trackers or ()):
        raise ConfigError(f'--log-wandb adds wandb but the override log.trackers={trackers} leaves it out; give one '
                          f'of them')
    if trackers is None:
        trackers = chosen_trackers(load_config(config_path, overrides))
    return trackers if {'wandb', 'all'} & set(trackers) else [*trackers, 'wandb']


def run_folder(args: argparse.Namespace) -> str:
    """``--output``, or ``runs/<config name>``; with ``--experiment``, ``<--output or runs>/<experiment>`` (timm)."""
    if args.experiment:
        return os.path.join(args.output or 'runs', args.experiment)
    if args.output:
        return args.output
    name = os.path.splitext(os.path.basename(args.config))[0] if args.config else 'default'
    return os.path.join('runs', name)


def main(argv: Sequence[str] | None = None) -> int:
    """Train from the command line; returns the exit status (the module docstring's table)."""
    args = parse_args(argv)
    if args.print_reference:
        print(reference_yaml())
        return 0
    is_main = int(os.environ.get('RANK', '0')) == 0  # before Accelerate starts: launchers set RANK per process
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format='%(asctime)s %(levelname)s %(name)s: %(message)s', datefmt='%H:%M:%S')
    _use_the_run_s_config(args)
    try:
        config = load_config(args.config, _overrides(args))
    except ConfigError as e:
        _logger.error('config error: %s', e)
        return EXIT_BAD_INPUT
    if args.print_config:
        print(config_to_yaml(config), end='')
        return 0
    output = run_folder(args)
    problem = unusable_folder_reason(output)
    if problem:
        return _fail(EXIT_BAD_INPUT, f'--output {output!r} cannot be a run folder: {problem}; give a folder')
    return _train(config, output, args.resume, is_main, args)


def _use_the_run_s_config(args: argparse.Namespace) -> None:
    """``--resume auto`` without ``--config`` into a run folder that has its ``config.yaml``: continue that run as it
    was configured (the overrides still apply), not the default recipe."""
    if args.config is not None or args.resume != 'auto':
        return
    run_config = os.path.join(run_folder(args), CONFIG_FILE)
    if os.path.isfile(run_config):
        args.config = run_config
        _logger.info('no --config given: continuing the run with its own %s', run_config)


def _train(config: Config, output: str, resume: str | None, is_main: bool, args: argparse.Namespace) -> int:
    with HeldTermination():  # a SIGTERM after the loop (a launcher's, once another process failed) waits for the report
        return _train_and_report(config, output, resume, is_main, args)


def _train_and_report(config: Config, output: str, resume: str | None, is_main: bool,
                      args: argparse.Namespace) -> int:
    try:
        summary = train(config, output, resume=resume, wait_for_lock=args.wait_for_lock,
                        trusted_callables=tuple(args.trust_callable))
    except (ConfigError, CheckpointError, DatasetError, RunFolderInUseError, LaunchError) as e:
        return _fail(EXIT_BAD_INPUT, f'{type(e).__name__}: {e}')
    except NonFiniteLossError as e:
        return _fail(EXIT_DIVERGED, f'training diverged: {e}')
    except RunFolderGoneError as e:
        return _fail(EXIT_RUN_FOLDER_GONE, f'RunFolderGoneError: {e}')
    except PeerProcessDiedError as e:
        return _fail(EXIT_PROCESS_DIED, f'PeerProcessDiedError: {e}')
    except SecondInterrupt:
        return _fail(EXIT_ABORTED, 'aborted by a second Ctrl-C without saving; --resume auto continues from the last '
                                   'checkpoint saved')
    except KeyboardInterrupt:  # before the loop's stop handler was installed, or after it was removed
        return _fail(EXIT_ABORTED, 'interrupted by Ctrl-C outside the training loop (set-up or the final export), '
                                   'without saving; --resume auto continues from the last checkpoint saved')
    except Exception as e:
        system_error = os_error_in_chain(e)
        if system_error is not None:
            return _fail(EXIT_OS_ERROR, _os_error_reason(e, system_error, output))
        traceback.print_exc()  # a bug: the traceback first, for a report, then the one-line reason
        return _fail(EXIT_UNEXPECTED, f'unexpected error (please report it with the traceback above): '
                                      f'{type(e).__name__}: {e}')
    if is_main:
        final = summary.get('final_metrics', {})
        shown = {k: round(v, 3) for k, v in final.items() if k in ('val_top1', 'ema_val_top1', 'train_loss')}
        _logger.info('%s after %d epoch%s in %.0f s: %s; run folder %s', summary['status'], summary['epochs_done'],
                     '' if summary['epochs_done'] == 1 else 's', summary['wall_time_s'], shown, output)
    return 0


def _os_error_reason(error: Exception, system_error: OSError, output: str) -> str:
    """The reason of exit status 4: the operating system's words (and the file, when known), the library error that
    carried them when there is one, and what to do: continue the run from its checkpoints, or start it again when it
    has none."""
    carried = ''
    if error is not system_error:
        lines = str(error).strip().splitlines()
        carried = f' (reported as {type(error).__name__}: {lines[0][:200] if lines else ""})'
    try:
        has_checkpoints = bool(list_checkpoints(output))
    except OSError:
        has_checkpoints = False
    then = ('continue with --resume auto' if has_checkpoints else
            'start the run again (it saved no checkpoint to continue from)')
    return (f'the operating system refused a read or write: {system_error}{carried}; free space or fix the '
            f'permissions, then {then}')


def _fail(code: int, reason: str) -> int:
    # a loader worker's error text ends in a newline; the error handled, if any, says where the line goes
    report_end(_logger, logging.ERROR, f'{reason.rstrip()} (exit {code})', sys.exc_info()[1])
    return code


if __name__ == '__main__':
    sys.exit(main())
