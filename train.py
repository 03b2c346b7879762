#!/usr/bin/env python3
"""Train a LipsFormer (or any timm model) with the paper's no-warmup recipe.

    python train.py --config configs/lipsformer_cswin_tiny.yaml --data-dir /data/imagenet --output runs/x
    accelerate launch train.py --config ... --output runs/x            # several GPUs / nodes
    python train.py --config configs/quickstart.yaml --output runs/q optimizer.lr=1e-3 train.epochs=2

Any config key can be overridden as key.sub=value (the value is parsed as YAML); configs/reference.yaml documents
every key. Exit status: 0 when training finished or was stopped by SIGTERM / SIGINT after saving a checkpoint,
1 when the loss stayed non-finite, 2 for a config, data or checkpoint problem.
"""
import argparse
import logging
import os
import sys

from lipsformer.checkpoint import CheckpointError
from lipsformer.training import (
    ConfigError,
    DatasetNotFoundError,
    NonFiniteLossError,
    config_to_yaml,
    load_config,
    reference_yaml,
    train,
)

_logger = logging.getLogger('lipsformer.train')


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
    except (ConfigError, CheckpointError, DatasetNotFoundError, FileNotFoundError) as e:
        _logger.error('%s: %s', type(e).__name__, e)
        return 2
    except NonFiniteLossError as e:
        _logger.error('%s', e)
        return 1
    if is_main:
        final = summary.get('final_metrics', {})
        shown = {k: round(v, 3) for k, v in final.items() if k in ('val_top1', 'ema_val_top1', 'train_loss')}
        _logger.info('%s after %d epochs in %.0f s: %s; run folder %s', summary['status'], summary['epochs_done'],
                     summary['wall_time_s'], shown, output)
    return 0


if __name__ == '__main__':
    sys.exit(main())
