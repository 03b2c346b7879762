"""Command line of the stability experiment: run (or resume) the sweep, collect its runs into the committed results
file, or write the report from that file."""
import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from ...utils.cli import HelpFormatter, command_name, usage_error
from .arms import ARMS, ModelShape
from .grid import run_grid
from .report import write_stability_report
from .subsets import Subsets, load_image_folder, load_subsets, synthetic_subsets
from .sweep_results import collect, read_results
from .training_run import RunSettings

__all__ = ['main']

DEFAULT_LRS = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064)  # spaced 2x, written as typed on a command line
DEFAULT_SEEDS = (0, 1, 2)
DEFAULT_STOP_AFTER_FAILURES = 2
FASHION_MNIST = 'fashion_mnist'


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(',') if v.strip()]


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f'expected 0 or a positive integer, got {value}')
    return value


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(',') if v.strip()]


def _arms(text: str) -> list[str]:
    names = [v.strip() for v in text.split(',') if v.strip()]
    unknown = sorted(set(names) - set(ARMS))
    if unknown:
        raise argparse.ArgumentTypeError(f'unknown arms {unknown}; expected some of {list(ARMS)}')
    return names


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    defaults, shape = RunSettings(), ModelShape()
    parser = argparse.ArgumentParser(
        prog=command_name('lipsformer.instruments.stability'), description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument('--out', type=Path,
                        help='grid folder of the run folders (resumed if it exists; needed to train and to --collect)')
    parser.add_argument('--collect', action='store_true',
                        help='merge the finished runs under --out into the --results file; no training')
    parser.add_argument('--report', type=Path, metavar='DOCS_DIR',
                        help='write the data set\'s section of DOCS_DIR/stability.md and its figure from the --results '
                             'file alone; no training')
    parser.add_argument('--results', type=Path,
                        help='the committed results file (default: results/stability/<dataset>.jsonl); a run it '
                             'holds, measured with the same settings under this torch, is not trained again')
    parser.add_argument('--retrain-recorded', action='store_true',
                        help='train the runs that the --results file already holds again (in new run folders)')
    # defaults as they would be typed, so that --help shows them so (argparse runs string defaults through type)
    parser.add_argument('--arms', type=_arms, default=', '.join(ARMS), help='comma-separated arms')
    parser.add_argument('--lrs', type=_floats, default=', '.join(map(str, DEFAULT_LRS)),
                        help='comma-separated peak learning rates')
    parser.add_argument('--seeds', type=_ints, default=', '.join(map(str, DEFAULT_SEEDS)), help='comma-separated seeds')
    parser.add_argument('--steps', type=int, default=defaults.steps, help='optimizer steps per run')
    parser.add_argument('--batch-size', type=int, default=defaults.batch_size)
    parser.add_argument('--train-size', type=int, default=defaults.train_size,
                        help='class-balanced train subset (one epoch = one pass over it)')
    parser.add_argument('--test-size', type=int, default=defaults.test_size, help='class-balanced test subset')
    parser.add_argument('--embed-dim', type=int, default=shape.embed_dim)
    parser.add_argument('--depths', type=_ints, default=', '.join(map(str, shape.depths)), help='blocks per stage')
    parser.add_argument('--bound-every', type=_non_negative, default=defaults.bound_every,
                        help='steps between Lipschitz-bound measurements after the first step (0: only at the first '
                             'step and at the end)')
    parser.add_argument('--eval-every', type=int, default=defaults.eval_every,
                        help='steps between test-accuracy measurements (the best accuracy is taken over them)')
    parser.add_argument('--checkpoint-every', type=int, default=defaults.checkpoint_every)
    parser.add_argument('--stop-after-failures', type=_non_negative, default=DEFAULT_STOP_AFTER_FAILURES, metavar='N',
                        help='leave a seed out of an arm\'s higher learning rates once it has diverged or ended '
                             'stuck at chance at N consecutive rates (the runs are marked not run in the results and '
                             'the report); 0 runs the full grid')
    parser.add_argument('--data-dir', type=Path, metavar='ROOT',
                        help='an image folder (ROOT/train/<class>/*, ROOT/val/<class>/*) instead of Fashion-MNIST; '
                             'images are resized to the model input, channels (1 or 3) and classes come from the data')
    parser.add_argument('--dataset-name', help='the data set\'s name in the results and the doc (default: '
                                               f'{FASHION_MNIST}, or the name of --data-dir)')
    parser.add_argument('--fashion-mnist-dir', default='data/fashion-mnist',
                        help='Fashion-MNIST root (unpacked there from /usr/share/datasets/fashion-mnist if missing)')
    parser.add_argument('--synthetic', action='store_true',
                        help='random class-shifted images instead of Fashion-MNIST (smoke tests only)')
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--threads', type=int, default=1, help='torch CPU threads')
    args = parser.parse_args(argv)
    if args.data_dir is not None and args.synthetic:
        usage_error(parser, '--data-dir and --synthetic exclude each other')
    if args.out is None and args.report is None:
        usage_error(parser, '--out is needed to train and to --collect')
    if args.dataset_name is None:
        args.dataset_name = FASHION_MNIST if args.data_dir is None else args.data_dir.resolve().name
        args.dataset_name += '_synthetic' if args.synthetic else ''
    if args.results is None:
        args.results = Path('results') / 'stability' / f'{args.dataset_name}.jsonl'
    return args


def settings_from_args(args: argparse.Namespace, subsets: Subsets) -> RunSettings:
    shape = ModelShape(embed_dim=args.embed_dim, depths=tuple(args.depths), in_chans=subsets.in_chans,
                       num_classes=subsets.num_classes)
    return RunSettings(
        steps=args.steps, batch_size=args.batch_size, train_size=args.train_size, test_size=args.test_size,
        bound_every=args.bound_every, eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
        synthetic=args.synthetic, dataset=args.dataset_name, shape=shape)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format='%(asctime)s %(message)s')
    if args.report is not None:
        write_stability_report(args.results, args.report)
        return
    if args.collect:
        added, replaced = collect(args.out, args.results)
        logging.info('%s: %d runs added, %d replaced', args.results, added, replaced)
        return
    logging.info('command: cd %s && %s (OMP_NUM_THREADS=%s, cores %s, nice %d)', os.getcwd(),
                 ' '.join([sys.executable, '-m', __package__, *(sys.argv[1:] if argv is None else argv)]),
                 os.environ.get('OMP_NUM_THREADS', 'unset'), sorted(os.sched_getaffinity(0)), os.nice(0))
    torch.set_num_threads(args.threads)
    shape = ModelShape()
    if args.synthetic:
        subsets = synthetic_subsets(args.train_size, args.test_size)
    elif args.data_dir is not None:
        subsets = load_image_folder(str(args.data_dir), shape.img_size, args.train_size, args.test_size)
    else:
        subsets = load_subsets(args.fashion_mnist_dir, args.train_size, args.test_size)
    settings = settings_from_args(args, subsets)
    recorded = None if args.retrain_recorded else read_results(args.results)
    run_grid(args.out, args.arms, args.lrs, args.seeds, settings, subsets, torch.device(args.device),
             args.stop_after_failures, recorded)
