"""Command line of the stability experiment: run (or resume) the grid, or write the report from its results."""
import argparse
import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from ...utils.cli import HelpFormatter, command_name
from .arms import ARMS, ModelShape
from .grid import run_grid
from .report import write_report
from .subsets import load_subsets, synthetic_subsets
from .training_run import RunSettings

__all__ = ['main']

DEFAULT_LRS = (2e-3, 1e-2)
DEFAULT_SEEDS = (0, 1, 2)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(',') if v]


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(',') if v]


def _arms(text: str) -> list[str]:
    names = [v for v in text.split(',') if v]
    unknown = sorted(set(names) - set(ARMS))
    if unknown:
        raise argparse.ArgumentTypeError(f'unknown arms {unknown}; expected some of {list(ARMS)}')
    return names


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    defaults, shape = RunSettings(), ModelShape()
    parser = argparse.ArgumentParser(
        prog=command_name('lipsformer.experiments.stability'), description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('--out', type=Path, required=True, help='grid folder (resumed if it exists)')
    parser.add_argument('--report', type=Path, metavar='DOCS_DIR',
                        help='write stability.md and its PNGs into DOCS_DIR from the results in --out; no training')
    parser.add_argument('--arms', type=_arms, default=list(ARMS), help='comma-separated arms')
    parser.add_argument('--lrs', type=_floats, default=list(DEFAULT_LRS), help='comma-separated peak learning rates')
    parser.add_argument('--seeds', type=_ints, default=list(DEFAULT_SEEDS), help='comma-separated seeds')
    parser.add_argument('--steps', type=int, default=defaults.steps, help='optimizer steps per run')
    parser.add_argument('--batch-size', type=int, default=defaults.batch_size)
    parser.add_argument('--train-size', type=int, default=defaults.train_size,
                        help='class-balanced train subset (one epoch = one pass over it)')
    parser.add_argument('--test-size', type=int, default=defaults.test_size, help='class-balanced test subset')
    parser.add_argument('--embed-dim', type=int, default=shape.embed_dim)
    parser.add_argument('--depths', type=_ints, default=list(shape.depths), help='blocks per stage')
    parser.add_argument('--bound-every', type=int, default=defaults.bound_every,
                        help='steps between Lipschitz-bound measurements')
    parser.add_argument('--checkpoint-every', type=int, default=defaults.checkpoint_every)
    parser.add_argument('--data-dir', default='data/fashion-mnist',
                        help='Fashion-MNIST root (unpacked there from /usr/share/datasets/fashion-mnist if missing)')
    parser.add_argument('--synthetic', action='store_true',
                        help='random class-shifted images instead of Fashion-MNIST (smoke tests only)')
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--threads', type=int, default=1, help='torch CPU threads')
    return parser.parse_args(argv)


def settings_from_args(args: argparse.Namespace) -> RunSettings:
    return RunSettings(
        steps=args.steps, batch_size=args.batch_size, train_size=args.train_size, test_size=args.test_size,
        bound_every=args.bound_every, checkpoint_every=args.checkpoint_every, synthetic=args.synthetic,
        shape=ModelShape(embed_dim=args.embed_dim, depths=tuple(args.depths)))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s')
    if args.report is not None:
        write_report(args.out, args.report)
        return
    torch.set_num_threads(args.threads)
    settings = settings_from_args(args)
    if args.synthetic:
        subsets = synthetic_subsets(args.train_size, args.test_size)
    else:
        subsets = load_subsets(args.data_dir, args.train_size, args.test_size)
    run_grid(args.out, args.arms, args.lrs, args.seeds, settings, subsets, torch.device(args.device))
