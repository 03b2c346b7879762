#!/usr/bin/env python3
"""Train a LipsFormer (or any timm model) with the paper's no-warmup recipe.

    python train.py --config configs/lipsformer_cswin_tiny.yaml --data-dir /data/imagenet --output runs/x
    accelerate launch train.py --config ... --output runs/x            # several GPUs / nodes
    python train.py --config configs/quickstart.yaml --output runs/q optimizer.lr=1e-3 train.epochs=2

Any config key can be overridden as key.sub=value (the value is parsed as YAML); configs/reference.yaml documents
every key.

Exit status (the last log line gives the reason):
  0    finished, or stopped by SIGTERM / SIGINT after saving a checkpoint (continue with --resume auto)
  1    an unexpected error, a bug: the traceback is printed above the reason
  2    a config, data or checkpoint problem: the message says what to change
  3    training diverged: the loss stayed non-finite (the message names the last good checkpoint)
  4    the operating system refused a read or write (disk full, permissions, I/O error); saved checkpoints are whole
  130  a second Ctrl-C aborted without saving; the checkpoints saved before are whole
"""
import argparse
import logging
import os
import sys
import traceback

from lipsformer.checkpoint import CheckpointError
from lipsformer.training import (
    ConfigError,
    DatasetError,
    NonFiniteLossError,
    config_to_yaml,
    load_config,
    reference_yaml,
    train,
)

_logger = logging.getLogger('lipsformer.train')

EXIT_UNEXPECTED, EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_OS_ERROR, EXIT_ABORTED = 1, 2, 3, 4, 130


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--config', help='YAML config (configs/*.yaml); defaults apply to keys it does not set')
    parser.add_argument('--data-dir', help='dataset root (sets data.data_dir)')
    parser.add_argument('--output', help='run folder (default: runs/<config name>)')
    parser.add_argument('--resume', help='auto (newest checkpoint in --output, if any) or a checkpoint / run folder')
    parser.add_argument('--print-config', action='store_true', help='print the resolved config and exit')
    parser.add_argument('--print-reference', action='store_true', help='print every key, documented, and exit')
    parser.add_argument('overrides', nargs='*', metavar='key.sub=value', help='config overrides')
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_reference:
        print(reference_yaml())
        return 0
    is_main = int(os.environ.get('RANK', '0')) == 0  # before Accelerate starts: launchers set RANK per process
    logging.basicConfig(level=logging.INFO if is_main else logging.WARNING,
                        format='%(asctime)s %(levelname)s %(name)s: %(message)s', datefmt='%H:%M:%S')
    overrides = list(args.overrides) + ([f'data.data_dir={args.data_dir}'] if args.data_dir else [])
    try:
        config = load_config(args.config, overrides)
    except ConfigError as e:
        _logger.error('config error: %s', e)
        return 2
    if args.print_config:
        print(config_to_yaml(config), end='')
        return 0
    config_name = os.path.splitext(os.path.basename(args.config))[0] if args.config else 'default'
    output = args.output or os.path.join('runs', config_name)
    try:
        summary = train(config, output, resume=args.resume)
    except (ConfigError, CheckpointError, DatasetError) as e:
        return _fail(EXIT_BAD_INPUT, f'{type(e).__name__}: {e}')
    except NonFiniteLossError as e:
        return _fail(EXIT_DIVERGED, f'training diverged: {e}')
    except OSError as e:
        return _fail(EXIT_OS_ERROR, f'the operating system refused a read or write: {e}; free space or fix the '
                                    f'permissions, then continue with --resume auto')
    except KeyboardInterrupt:
        return _fail(EXIT_ABORTED, 'aborted by a second Ctrl-C without saving; --resume auto continues from the last '
                                   'checkpoint saved')
    except Exception as e:  # a bug: the traceback first, for a report, then the one-line reason
        traceback.print_exc()
        return _fail(EXIT_UNEXPECTED, f'unexpected error (please report it with the traceback above): '
                                      f'{type(e).__name__}: {e}')
    if is_main:
        final = summary.get('final_metrics', {})
        shown = {k: round(v, 3) for k, v in final.items() if k in ('val_top1', 'ema_val_top1', 'train_loss')}
        _logger.info('%s after %d epochs in %.0f s: %s; run folder %s', summary['status'], summary['epochs_done'],
                     summary['wall_time_s'], shown, output)
    return 0


def _fail(code: int, reason: str) -> int:
    _logger.error('%s (exit %d)', reason, code)
    return code


if __name__ == '__main__':
    sys.exit(main())
