"""Command line: ``python -m lipsformer.lipschitz --model NAME [--checkpoint PATH [--use-ema]] [--img-size N]
[--json OUT]``.

Prints each weighted-residual branch's alpha, its Lipschitz bound (true conv operator norms, and the paper's reshaped
ones), the theorem behind it and an empirical local estimate, then the network's Theorem 2 bound, its exp(kappa)
form, its drop-path expectation and empirical estimates; ``--json`` writes the same as JSON, infinite bounds as the
string "unbounded". The report's first line says which weights were measured.

``--checkpoint`` and ``--use-ema`` are read as validate.py reads them (a run folder, an export, a weights file, their
EMA weights), and so is ``--model-kwargs``; a ``local-dir:`` model is its export folder, EMA weights included.
"""
import argparse
import math
import os
import sys
from typing import Any

import torch

from ..evaluation.checkpoints import create_eval_model, resolve_checkpoint
from ..utils.cli import EXIT_INTERRUPTED, HelpFormatter, ModelKwargs, command_name, ctrl_c_deferred
from ..utils.io import unwritable_file_reason, write_json, write_remedy
from ..weights.model_names import create_model, expand_model_names, model_source
from ..weights.weight_files import CheckpointError
from .analysis import analyze

__all__ = ['build_lipschitz_parser', 'format_report', 'main', 'to_json']


def build_lipschitz_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=command_name('lipsformer.lipschitz'), description=__doc__.split('\n\n')[1],
                                     formatter_class=HelpFormatter)
    parser.add_argument('--model', help='timm model name, e.g. lipsformer_swin_tiny, or one with its weights: '
                                        'local-dir:FOLDER, hf-hub:REPO_ID; optional when --checkpoint names its model '
                                        '(a run folder, an export)')
    parser.add_argument('--checkpoint', help='weights to analyse: anything validate.py\'s --checkpoint takes (a run '
                                             'folder, an export, a weights file); default: the model at '
                                             'initialisation, or a local-dir: / hf-hub: model\'s weights')
    parser.add_argument('--use-ema', action='store_true', help='analyse the EMA weights of --checkpoint or of a '
                                                               'local-dir: export')
    parser.add_argument('--img-size', type=int, help='input size (a multiple of 32); default: the model\'s')
    parser.add_argument('--model-kwargs', nargs='*', default={}, action=ModelKwargs, metavar='KEY=VALUE',
                        help='architecture arguments for timm.create_model, each value a Python literal, else a '
                             'string, as validate.py reads them (depths=1,1,2,1 attn_type=l2 num_classes=10 ...)')
    parser.add_argument('--json', metavar='OUT', help='also write the report to this JSON file')
    parser.add_argument('--iterations', type=int, default=10, help='power iterations on the network Jacobian')
    parser.add_argument('--ascent-steps', type=int, default=10, help='Adam steps of the gradient ascent (0: skip)')
    parser.add_argument('--branch-iterations', type=int, default=5, help='power iterations per branch')
    parser.add_argument('--no-empirical', action='store_true', help='bounds only (no Jacobian measurements)')
    parser.add_argument('--seed', type=int, default=0, help='seed of the random input and starting vectors')
    parser.add_argument('--threads', type=int, help='CPU threads (torch.set_num_threads); on a small or busy CPU, 1 '
                                                    'avoids threads waiting on each other')
    return parser


def _number(value: float | str | None, digits: int = 4) -> str:
    if value is None or isinstance(value, str):
        return value or '-'
    return 'unbounded' if math.isinf(value) else f'{value:.{digits}g}'


def format_report(report: dict[str, Any]) -> str:
    """The report as a table of branches and a summary of the network."""
    weights = report.get('weights') or report.get('checkpoint') or 'at initialisation'
    lines = [f'Lipschitz analysis of {report["model"]} at {report["img_size"][0]}x{report["img_size"][1]} '
             f'({weights})', '',
             f'{"branch":42} {"alpha":>7} {"bound":>10} {"reshaped":>10} {"empirical":>10} {"factor":>10}  why']
    for row in report['branches']:
        lines.append(f'{row["name"]:42} {_number(row["alpha"], 3):>7} {_number(row["lipschitz_bound"]):>10} '
                     f'{_number(row["lipschitz_bound_reshaped"]):>10} {_number(row.get("empirical")):>10} '
                     f'{_number(row["factor"]):>10}  {row["reason"]}')
    plain = [row for row in report['plain_layers'] if row['lipschitz_bound'] != 1.0]
    lines += ['', 'layers outside the residuals (bound): ' + ', '.join(
        f'{row["name"]} {_number(row["lipschitz_bound"])}' for row in plain[:6]) + (', ...' if len(plain) > 6 else '')]
    lines += [
        '',
        f'Theorem 2 product bound:            {_number(report["product_bound"])}'
        f'   (log10 {_number(report["log10_product_bound"])})',
        f'  with the paper\'s reshaped norms:  {_number(report["reshaped"]["product_bound"])}',
        f'exp(kappa * sum alpha) form:        {_number(report["exp_kappa_bound"])}'
        f'   (kappa {_number(report["kappa"])}, sum alpha {_number(report["sum_alpha"])})',
        f'drop-path expectation (Appendix J): {_number(report["drop_path_expected_bound"]["paper"])}'
        f'   (timm\'s rescaled DropPath: {_number(report["drop_path_expected_bound"]["timm_rescaled"])})',
    ]
    if report['unbounded']:
        lines.append(f'unbounded parts: {len(report["unbounded"])}, e.g. {report["unbounded"][0]}; the product of '
                     f'the others: {_number(report["bounded_parts_product"])} (reshaped norms: '
                     f'{_number(report["reshaped"]["bounded_parts_product"])})')
    if report['not_proven']:
        lines.append(f'bounds used outside their theorem: {len(report["not_proven"])}, e.g. '
                     f'{report["not_proven"][0]}')
    empirical = report.get('empirical_lipschitz')
    if empirical:
        lines.append(f'empirical Lipschitz estimate:       {_number(empirical["power_iteration"])} (power iteration '
                     f'on J^T J), {_number(empirical["gradient_ascent"])} (gradient ascent); {empirical["input"]}')
    lines.append(f'time: {sum(report["seconds"].values()):.1f} s')
    return '\n'.join(lines)


def to_json(value: Any) -> Any:
    """Plain JSON data: infinite floats become "unbounded", NaN null."""
    if isinstance(value, float):
        if math.isinf(value):
            return 'unbounded'
        return None if math.isnan(value) else value
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    return value


def load_analysed_model(args: argparse.Namespace) -> tuple[torch.nn.Module, str]:
    """The model ``args`` name, with its weights, and what those weights are (for the report's header).

    Raises:
        ValueError: The arguments name no model, several, or EMA weights that are not there (EvaluationError).
        CheckpointError: The weights do not fit the model.
    """
    kwargs = dict(args.model_kwargs)
    if args.img_size is not None:
        kwargs['img_size'] = args.img_size
    model_name, checkpoint = args.model, args.checkpoint
    if model_name and model_source(model_name) == 'local-dir' and not checkpoint:
        # An export folder: read as --checkpoint FOLDER reads it, so that --use-ema takes its EMA twin.
        model_name, checkpoint = None, model_name.split(':', 1)[1]
    if model_name is None and checkpoint is None:
        raise ValueError('give --model, --checkpoint, or both')
    if args.use_ema and checkpoint is None:
        raise ValueError(f'--use-ema needs --checkpoint (or a local-dir: model) with EMA weights; {model_name} '
                         f'alone has none')
    if model_name and len(expand_model_names(model_name)) != 1:  # an unknown name raises, naming close ones
        raise ValueError(f'--model {model_name!r} names several models; the report is of one')
    if checkpoint is None:
        pretrained = bool(model_source(model_name))
        model = create_model(model_name, pretrained=pretrained, **kwargs)
        return model, f'the weights of {model_name}' if pretrained else 'at initialisation'
    resolved = resolve_checkpoint(checkpoint, args.use_ema)
    model, _ = create_eval_model(model_name, resolved, model_kwargs=kwargs)
    weights = resolved.weights + (' (its EMA entry)' if resolved.ema_entry else '')
    return model, f'EMA weights: {weights}' if args.use_ema else weights


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status: 2 for bad input, 4 when the ``--json`` file could not be written (the
    report is printed first), 130 after a Ctrl-C (the bounds printed, and written to ``--json`` with ``complete``
    false, once they are computed)."""
    parser = build_lipschitz_parser()
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bounds: dict[str, Any] = {}  # the report of the bounds, kept (and written) before the measurements
    written = []

    def keep_bounds(report_so_far: dict[str, Any]) -> None:
        bounds.update(report_so_far, checkpoint=args.checkpoint, weights=weights, use_ema=args.use_ema,
                      complete=False)
        if args.json:
            try:
                with ctrl_c_deferred():  # the file and the line that names it agree
                    _write_report(args.json, bounds)
                    written.append(args.json)
            except OSError:  # the final write reports it
                pass
    try:
        if args.json and unwritable_file_reason(args.json):
            raise ValueError(f'--json {args.json!r} cannot be written: {unwritable_file_reason(args.json)}')
        model, weights = load_analysed_model(args)
        report = analyze(model, args.img_size, empirical=not args.no_empirical, iterations=args.iterations,
                         ascent_steps=args.ascent_steps, branch_iterations=args.branch_iterations, seed=args.seed,
                         progress=keep_bounds)
    except (ValueError, TypeError, CheckpointError) as e:
        print(f'{parser.prog}: error: {e}', file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if not bounds:
            print(f'{parser.prog}: interrupted by Ctrl-C before the bounds were computed; nothing was written',
                  file=sys.stderr)
            return EXIT_INTERRUPTED
        print(format_report(bounds))
        where = f' and in --json {args.json!r} (complete false)' if written else ''
        print(f'{parser.prog}: interrupted by Ctrl-C during the empirical estimates: the bounds are printed '
              f'above{where}', file=sys.stderr)
        return EXIT_INTERRUPTED
    report['checkpoint'] = args.checkpoint
    report['weights'] = weights
    report['use_ema'] = args.use_ema
    report['complete'] = True
    print(format_report(report))
    if args.json:
        try:
            _write_report(args.json, report)
        except OSError as e:
            print(f'{parser.prog}: error: the report could not be written to --json {args.json!r}: '
                  f'{e.strerror or e}; it is printed above ({write_remedy(e, "give another --json")})', file=sys.stderr)
            return 4
    return 0


def _write_report(path: str, report: dict[str, Any]) -> None:
    """Write the JSON report atomically, creating its folder as validate.py and the benchmark do."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json(path, to_json(report))
