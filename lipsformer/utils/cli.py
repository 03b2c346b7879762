"""What the package's command lines share: the command's name as the user ran it, help with real defaults, and
``--model-kwargs`` read one way everywhere."""
import argparse
import os
import sys
from typing import Any

from timm.utils import ParseKwargs

__all__ = ['HelpFormatter', 'ModelKwargs', 'command_name']

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def command_name(module: str) -> str:
    """The name a command's usage and error lines give it: the console script or script file the user ran
    (``lipsformer-validate``, ``validate.py``), or ``python -m <module>`` when it runs as a module of the package.

    Args:
        module: The module ``python -m`` runs (``lipsformer.lipschitz``).
    """
    program = sys.argv[0] if sys.argv and sys.argv[0] else ''
    inside_package = os.path.abspath(program).startswith(_PACKAGE_DIR + os.sep)
    if not program or program == '-c' or inside_package or os.path.basename(program) == '__main__.py':
        return f'python -m {module}'
    return os.path.basename(program)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help with ``(default: X)`` after an option only when it has a default worth reading: not for
    options without one (None), switches (False) or empty lists."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default in ([], {}, ''):
            return action.help
        return super()._get_help_string(action)


class ModelKwargs(ParseKwargs):
    """``--model-kwargs KEY=VALUE ...`` as timm's scripts read it (each value a Python literal, else a string:
    ``depths=2,2,6,2`` is a tuple, ``attn_type=l2`` a string); an item that is not KEY=VALUE is a usage error naming
    it, not a traceback."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        bad = [item for item in values if item and ('=' not in item or not item.partition('=')[0].isidentifier())]
        if bad:
            parser.error(f'{option_string} {bad[0]!r} is not KEY=VALUE (e.g. depths=2,2,6,2 attn_type=l2)')
        super().__call__(parser, namespace, values, option_string)
