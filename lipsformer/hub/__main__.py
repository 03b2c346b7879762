"""Command line: ``python -m lipsformer.hub card RUN_DIR`` and ``python -m lipsformer.hub push RUN_DIR|EXPORT REPO_ID``.

``card`` writes the model card (README.md) and the run's plots into the run's export; ``push`` uploads the export with
such a card (naming the repository) to the Hugging Face Hub, and writes the card into the export once the upload has
succeeded (without a token or a connection it stops first, the export unchanged).
"""
import argparse
import logging
import sys

from ..utils.cli import command_name
from ..utils.io import write_remedy
from ..weights.weight_files import CheckpointError
from .model_card import CardError, write_card
from .upload import push

EXIT_BAD_INPUT, EXIT_OS_ERROR = 2, 4  # train.py's and validate.py's statuses for the same problems


def build_hub_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=command_name('lipsformer.hub'), description=__doc__.split('\n\n')[1])
    commands = parser.add_subparsers(dest='command', required=True)
    card = commands.add_parser('card', help='write README.md (the model card) and plots into the run\'s export')
    upload = commands.add_parser('push', help='write the card and upload the export to the Hugging Face Hub')
    for sub in (card, upload):
        sub.add_argument('target', metavar='RUN_DIR|EXPORT', help='training run folder, or an export / model folder')
    upload.add_argument('repo_id', help='Hub repository, USER/REPO (created if missing)')
    card.add_argument('--repo-id', help='Hub repository the card\'s loading example names')
    upload.add_argument('--private', action='store_true', help='create the repository private')
    upload.add_argument('--token', help='Hub token (default: the one huggingface-cli login / HF_TOKEN gives)')
    upload.add_argument('--revision', help='branch to push to')
    upload.add_argument('--keep-card', action='store_true', help='upload an existing README.md as it is')
    for sub in (card, upload):
        sub.add_argument('--which', choices=('best', 'last'), default='best', help='which of the run\'s exports')
        sub.add_argument('--results', nargs='+', action='extend', default=[], metavar='FILE',
                         help='validate.py --results-file JSON of the export\'s weights (ImageNet val, ReaL, V2, ...): '
                              'each data set scored there joins the card\'s results and its model-index')
        sub.add_argument('--no-lipschitz', action='store_true',
                         help="leave the Lipschitz bounds out of the card (seconds for a full-size model)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (2 for bad input, 4 when the card cannot be written into the export, with
    the reason on stderr)."""
    logging.basicConfig(level=logging.WARNING, format='%(levelname)s %(name)s: %(message)s')
    parser = build_hub_parser()
    args = parser.parse_args(argv)
    lipschitz = not args.no_lipschitz
    try:
        if args.command == 'card':
            print(f'wrote {write_card(args.target, args.repo_id, args.which, lipschitz, tuple(args.results))}')
        else:
            commit = push(args.target, args.repo_id, private=args.private, which=args.which, token=args.token,
                          revision=args.revision, keep_card=args.keep_card, lipschitz=lipschitz,
                          results=tuple(args.results))
            print(f'uploaded to {getattr(commit, "commit_url", args.repo_id)}')
    except (CardError, CheckpointError, FileNotFoundError) as e:
        print(f'{parser.prog}: error: {e}', file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # writing the card into the export (the upload's own failures are HubAccessErrors)
        print(f'{parser.prog}: error: {e.filename or "the card"!s} could not be written: {e.strerror or e}; '
              f'{write_remedy(e, "copy the export to another folder and write its card there")}', file=sys.stderr)
        return EXIT_OS_ERROR
    return 0


if __name__ == '__main__':
    sys.exit(main())
