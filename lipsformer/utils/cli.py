"""What the package's command lines share: the command's name as the user ran it, help with real defaults,
``--model-kwargs`` read one way everywhere, one-line errors, and a Ctrl-C held back while partial results are kept."""
import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

from timm.utils import ParseKwargs

__all__ = ['EXIT_INTERRUPTED', 'HelpFormatter', 'ModelKwargs', 'command_name', 'ctrl_c_deferred', 'usage_error']

EXIT_INTERRUPTED = 130  # as a shell reports a process ended by Ctrl-C, and as train.py exits then
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command_name(module: str) -> str:
    """The name a command's usage and error lines give it: the console script or script file the user ran
    (``lipsformer-validate``, ``validate.py``), or ``python -m <module>`` when it runs as a module of the package.

    Args:
        module: The module ``python -m`` runs (``lipsformer.lipschitz``).
    """
    program = sys.argv[0] if sys.argv and sys.argv[0] else ''
    inside_package = os.path.abspath(program).startswith(_PACKAGE_DIR + os.sep)
    if inside_package and program.endswith('.py') and os.path.basename(program) not in ('__main__.py', '__init__.py'):
        # a module of the package run by python -m: the one the user named (python -m lipsformer.benchmark)
        relative = os.path.relpath(os.path.abspath(program), os.path.dirname(_PACKAGE_DIR))
        return f'python -m {relative.removesuffix(".py").replace(os.sep, ".")}'
    if not program or program == '-c' or inside_package or os.path.basename(program) == '__main__.py':
        return f'python -m {module}'
    return os.path.basename(program)


def usage_error(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """End a command on bad input found after its arguments were parsed (a value out of range, a model spec or size a
    model refuses): one line, ``PROG: error: MESSAGE``, and exit 2, as validate.py and lipsformer-lipschitz end;
    argparse's ``parser.error`` would print the whole usage above it.

    Args:
        parser: The command's parser (its ``prog`` begins the line).
        message: What was wrong and how to fix it, with a did-you-mean where a name was mistyped.
    """
    parser.exit(2, f'{parser.prog}: error: {message}\n')


@contextlib.contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) back until the block ends, then deliver it: a command that writes its results so far and
    notes that it did (to say on Ctrl-C what was kept) does both or neither. Only the main thread can set handlers;
    elsewhere the block runs as is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            signal.raise_signal(signal.SIGINT)  # to the handler the command had: KeyboardInterrupt as a rule


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help with ``(default: X)`` after an option only when it has a default worth reading: not for
    options without one (None), switches (False) or empty lists."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default in ([], {}, ''):
            return action.help
        return super()._get_help_string(action)


class ModelKwargs(ParseKwargs):
    """``--model-kwargs KEY=VALUE ...`` as timm's scripts read it (each value a Python literal, else a string:
    ``depths=2,2,6,2`` is a tuple, ``attn_type=l2`` a string); an item that is not KEY=VALUE, or YAML's ``true`` /
    ``false`` / ``null`` for Python's literals, is a usage error naming it, not a traceback or a silent string."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        bad = [item for item in values if item and ('=' not in item or not item.partition('=')[0].isidentifier())]
        if bad:
            parser.error(f'{option_string} {bad[0]!r} is not KEY=VALUE (e.g. depths=2,2,6,2 attn_type=l2)')
        # YAML's words would be read as strings, and the string 'false' is true: say how to write the literal.
        words = {'true': 'True', 'false': 'False', 'null': 'None', 'none': 'None'}
        yaml_like = [item for item in values if item.partition('=')[2].lower() in words
                     and item.partition('=')[2] not in words.values()]
        if yaml_like:
            key, _, value = yaml_like[0].partition('=')
            parser.error(f'{option_string} {yaml_like[0]!r}: values are Python literals; write '
                         f'{key}={words[value.lower()]}')
        super().__call__(parser, namespace, values, option_string)
