"""Model specs, as the benchmark and the kernel counter take them: ``name[key=value,...]`` or
``file:/path/module.py:factory[...]``, with keys that are no constructor arguments: ``fast_path=True`` / ``False``
switches ``lipsformer.fastpath`` for that model, ``grouped_weight_casts=False`` casts its weights one at a time at
their use in an eager training step under autocast (as autocast does alone) instead of together
(``lipsformer.training.weight_casts``), and ``compile=True``, ``compile=regional`` / ``whole`` (the scope) or
``compile='<mode>'`` runs that model through ``torch.compile`` (``False``: eager, whatever ``--compile`` says), in the
mode ``compile_mode='<mode>'`` names where the scope is given; the precisions they run in; the loss of a timed
training step; and the checks of their JSON reports.
"""
import argparse
import ast
import difflib
import functools
import importlib.util
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lipsformer.fastpath import set_fast_path, to_fast_form
from lipsformer.training.compilation import COMPILE_SCOPES  # a compile key may name a scope instead of a mode
from lipsformer.utils import write_json
from lipsformer.utils.cli import usage_error
from lipsformer.utils.io import unwritable_file_reason
from lipsformer.weights.model_names import check_model_source, expand_model_names, meant_argument, model_source

__all__ = ['PRECISIONS', 'REMOVED_SPEC_KEYS', 'SPEC_KEYS', 'ModelSpec', 'check_report_path', 'parse_model_specs',
           'rejected_argument_message', 'step_loss', 'write_json_report']

PRECISIONS = {'fp32': torch.float32, 'bf16': torch.bfloat16, 'fp16': torch.float16}
MODES = ('infer', 'train')  # an inference forward; a training step (forward, loss, backward, optimizer step)


@dataclass(frozen=True)
class ModelSpec:
    """One model to benchmark, parsed from ``name[key=value,...]`` or ``file:/path.py:factory[key=value,...]``."""

    text: str
    source: str  # timm name, or 'file:/path.py:factory'
    kwargs: dict[str, Any] = field(default_factory=dict)
    fast_path: bool | None = None  # lipsformer.fastpath's switch while this model runs (None: the device defaults)
    compile: bool | str | None = None  # torch.compile: True, a scope or a mode, or False (eager); None: --compile
    mode: str | None = None  # torch.compile's mode from compile_mode= (None: the compile key's, else --compile-mode)
    # an eager training step's autocast weight casts made together (lipsformer.training.weight_casts; None: on)
    grouped_weight_casts: bool | None = None

    def in_form(self, model: nn.Module, device_type: str) -> nn.Module:
        """``model`` in the form this spec asks for on ``device_type``: its fast form where the fast path is switched
        on there (the spec's ``fast_path=``, else the device's default), else its plain module graph."""
        with set_fast_path(self.fast_path):
            return to_fast_form(model, device_type)

    def running(self, step: Callable[[], Any]) -> Callable[[], Any]:
        """``step`` with the fast paths switched as this spec asks."""
        def switched() -> Any:
            with set_fast_path(self.fast_path):
                return step()
        return switched

    def compile_mode(self, default: str | None) -> str | None:
        """The ``torch.compile`` mode this model runs in ('default' for the default mode), or None for eager;
        ``default`` is the mode of the command line's ``--compile`` (None without it), for a spec without the keys."""
        if self.compile is False:
            return None
        if self.mode is not None:
            return self.mode
        if self.compile is None:
            return default
        return self.compile if self.compile not in (True, *COMPILE_SCOPES) else 'default'

    def compile_scope(self, default: str) -> str:
        """The scope this model compiles in, if it compiles: the ``compile`` key's (regional or whole), else
        ``default`` (the command line's ``--compile-scope``)."""
        return self.compile if self.compile in COMPILE_SCOPES else default

    @property
    def is_file(self) -> bool:
        return self.source.startswith('file:')

    def factory(self) -> str | Callable[..., nn.Module]:
        """The timm name, or the callable loaded from the file."""
        if not self.is_file:
            return self.source
        path, name = self.source[len('file:'):].rsplit(':', 1)
        return _load_factory(Path(path), name)


@functools.cache  # a file is imported once, however often its factory is asked for
def _load_factory(path: Path, name: str) -> Callable[..., nn.Module]:
    if not path.is_file():
        raise ValueError(f'file {path} does not exist (model spec file:/path/to/module.py:factory_name)')
    # Like running the file as a script: its own directory is importable, for its sibling modules.
    sys.path.insert(0, str(path.resolve().parent))
    module_spec = importlib.util.spec_from_file_location(f'_benchmarked_{path.stem}', path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, name):
        available = sorted(key for key, value in vars(module).items() if callable(value) and not key.startswith('_'))
        raise ValueError(f'{path} has no callable {name!r}; callables there: {available}')
    factory = getattr(module, name)
    if not callable(factory):
        raise TypeError(f'{path}: {name!r} is not callable ({type(factory).__name__}); name a function or class that '
                        'returns an nn.Module')
    return factory


def _split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and parentheses, at any depth (``a[x=[1,2]],b``)."""
    parts, depth, start = [], 0, 0
    for position, char in enumerate(text):
        depth += char in '([{'
        depth -= char in ')]}'
        if char == ',' and depth == 0:
            parts.append(text[start:position])
            start = position + 1
    return [part.strip() for part in [*parts, text[start:]] if part.strip()]


# The keys of a spec that are no constructor arguments.
SPEC_KEYS = ('fast_path', 'compile', 'compile_mode', 'grouped_weight_casts')
# Keys that earlier releases took, and what became of them: refused with that, not passed to the constructor.
REMOVED_SPEC_KEYS = {
    'native': "native= was removed with the package's C kernels: the fast path runs its PyTorch code, as it did with "
              'native=False',
}


def _parse_kwargs(text: str, spec: str) -> dict[str, Any]:
    kwargs = {}
    for item in _split_top_level(text):
        key, sep, value = item.partition('=')
        if not sep or not key.strip().isidentifier():
            raise ValueError(f'bad constructor argument {item!r} in {spec!r}; write name[key=value,key=value]')
        if key.strip() in REMOVED_SPEC_KEYS:
            raise ValueError(f'{spec!r}: {REMOVED_SPEC_KEYS[key.strip()]}; drop {item!r} from the spec')
        near = difflib.get_close_matches(key.strip(), SPEC_KEYS, n=1, cutoff=0.7)
        if near and key.strip() not in SPEC_KEYS:  # a misspelt key would reach the constructor as an argument
            raise ValueError(f'{spec!r}: unknown key {key.strip()!r}; did you mean {near[0]}? (the spec keys are '
                             f'{", ".join(SPEC_KEYS)}; any other key is a constructor argument)')
        try:
            kwargs[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            kwargs[key.strip()] = value.strip()  # a bare word such as a layer name
    return kwargs


def _compile_setting(value: Any, spec: str, key: str = 'compile') -> bool | str | None:
    """A spec's ``compile`` value, checked: None, True, False, a scope (:data:`COMPILE_SCOPES`) or one of
    torch.compile's modes; for ``key`` ``compile_mode``, None or a mode."""
    scopes = COMPILE_SCOPES if key == 'compile' else ()
    if value is None or (isinstance(value, bool) and key == 'compile'):
        return value
    if not isinstance(value, str):
        raise TypeError(f'{spec!r}: {key} must be {"True, False, a scope or " if scopes else ""}a torch.compile mode, '
                        f'got {value!r}')
    from torch._inductor import list_mode_options  # the modes torch.compile takes (its docstring points here)
    modes = list(list_mode_options())
    if value not in (*scopes, *modes):
        raise ValueError(f'{spec!r}: {key}={value!r} is no torch.compile {"scope or " if scopes else ""}mode; write '
                         + (f'compile=True (the default mode and scope), one of the scopes {", ".join(scopes)} or '
                            f'of the modes ' if scopes else 'one of ') + ', '.join(modes))
    return value


def parse_model_specs(text: str) -> list[ModelSpec]:
    """Parse the ``--models`` comma list (commas inside brackets belong to the constructor arguments).

    Raises:
        ValueError: a malformed spec, an unknown timm name (with close matches), a duplicate, or a key a release
            removed (:data:`REMOVED_SPEC_KEYS`).
        TypeError: an ``img_size`` argument that is not one integer; a ``fast_path`` that is not True or False, a
            ``compile`` that is not True, False or a string (an unknown mode is a ValueError).
    """
    specs = []
    for item in _split_top_level(text):
        match = re.fullmatch(r'([^\[\]]+?)(?:\[(.*)\])?', item)
        if match is None:
            raise ValueError(f'bad model spec {item!r}; write name, name[key=value,...] or file:/path.py:factory')
        source, kwargs = match.group(1).strip(), _parse_kwargs(match.group(2) or '', item)
        if not isinstance(kwargs.get('img_size', 1), int):
            raise TypeError(f'{item!r}: img_size must be one integer (square input), got {kwargs["img_size"]!r}')
        fast_path, grouped_casts = kwargs.pop('fast_path', None), kwargs.pop('grouped_weight_casts', None)
        for key, value in (('fast_path', fast_path), ('grouped_weight_casts', grouped_casts)):
            if value is not None and not isinstance(value, bool):
                raise TypeError(f'{item!r}: {key} must be True or False, got {value!r}')
        compile_setting = _compile_setting(kwargs.pop('compile', None), item)
        mode_setting = _compile_setting(kwargs.pop('compile_mode', None), item, key='compile_mode')
        if mode_setting is not None and compile_setting not in (None, True, *COMPILE_SCOPES):  # False or a mode
            raise ValueError(f'{item!r}: compile_mode={mode_setting!r} with compile={compile_setting!r}; give the mode '
                             f'once, with compile=True, regional or whole')
        if source.startswith('file:'):
            if source.count(':') < 2:
                raise ValueError(f'bad model spec {item!r}; write file:/path/to/module.py:factory_name')
        elif any(char in source for char in '*?['):
            raise ValueError(f'{item!r}: the benchmark takes exact model names, not patterns')
        elif model_source(source):  # local-dir:FOLDER / hf-hub:REPO: the architecture saved there
            check_model_source(source)
        else:
            expand_model_names(source)  # raises with close matches if the name is unknown
        specs.append(ModelSpec(item, source, kwargs, fast_path, compile_setting, mode_setting, grouped_casts))
    if len({spec.text for spec in specs}) != len(specs):
        raise ValueError(f'a model is listed twice in {text!r}')
    if not specs:
        raise ValueError('no model given')
    return specs


def rejected_argument_message(error: TypeError, specs: list[ModelSpec]) -> str | None:
    """A one-line message for a model constructor's refusal of a spec's argument (``got an unexpected keyword
    argument 'X'``), naming the spec, with the spec key it may be a misspelling of; None for another TypeError."""
    match = re.search(r"unexpected keyword argument '(\w+)'", str(error))
    if match is None:
        return None
    name = match.group(1)
    spec = next((spec for spec in specs if name in spec.kwargs), None)
    near = meant_argument(error, SPEC_KEYS)
    return (f'{spec.text if spec else "a model"!r}: the model takes no argument {name!r}'
            + (f'; did you mean {near}?' if near else f' ({error})'))


def step_loss(output: Any, targets: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss of a timed training step: cross-entropy against labels drawn once (seeded) for a classifier's logits,
    the mean square of any other output."""
    logits = output[0] if isinstance(output, (tuple, list)) else output
    if logits.ndim != 2:
        return logits.float().square().mean()
    if 'labels' not in targets:  # drawn once, when the number of classes is known
        generator = torch.Generator().manual_seed(1)
        targets['labels'] = torch.randint(logits.shape[1], (logits.shape[0],), generator=generator).to(logits.device)
    return F.cross_entropy(logits.float(), targets['labels'])



def add_step_arguments(parser: argparse.ArgumentParser, batch_size: int, precision: str) -> None:
    """The flags that name the models and the step every instrument measures (the benchmark, the kernel counter):
    ``--models``, ``--mode``, ``--batch-size``, ``--img-size``, ``--precision``, with the instrument's own defaults
    for the batch size and the precision. :func:`step_modes` checks them once parsed."""
    parser.add_argument('--models', required=True,
                        help='comma list of model specs: timm names, name[key=value,...] constructor arguments '
                             '(img_size there sets that model\'s input; fast_path=True or False; compile=...), or '
                             'file:/path/module.py:factory[...]')
    parser.add_argument('--mode', default=','.join(MODES),
                        help=f'comma list of {", ".join(MODES)} (default: %(default)s)')
    parser.add_argument('--batch-size', type=int, default=batch_size, help='images a step (default: %(default)s)')
    parser.add_argument('--img-size', type=int, default=224, help='input height and width (default: %(default)s)')
    parser.add_argument('--precision', choices=sorted(PRECISIONS), default=precision,
                        help='fp32, or autocast to bf16 / fp16 (fp16 training uses a GradScaler; default: '
                             '%(default)s)')


def step_modes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The modes ``--mode`` names, in its order, once :func:`add_step_arguments`' flags are checked: a bad mode or a
    size under 1 is a usage error (exit 2) that says what was wrong."""
    for name in ('batch_size', 'img_size'):
        if getattr(args, name) < 1:
            usage_error(parser, f'--{name.replace("_", "-")} must be at least 1, got {getattr(args, name)}')
    modes = [mode.strip() for mode in args.mode.split(',') if mode.strip()]
    if not modes or set(modes) - set(MODES):
        usage_error(parser, f'--mode must be a comma list of {", ".join(MODES)}, got {args.mode!r}')
    return modes


def check_report_path(parser: argparse.ArgumentParser, path: str | os.PathLike | None) -> None:
    """Refuse a ``--json`` file that cannot be written before any model runs (a usage error, exit 2)."""
    reason = unwritable_file_reason(path) if path is not None else None
    if reason:
        usage_error(parser, f'--json {str(path)!r} cannot be written: {reason}')


def write_json_report(parser: argparse.ArgumentParser, path: str | os.PathLike, data: Any,
                      partial: bool = False) -> bool:
    """Write the JSON report atomically (a reader sees the previous whole file or the new one); a write that fails
    after the table was printed ends the process with exit status 4 and one line naming the file, the table kept above
    it (printed by the caller before). A ``partial`` report (the rows so far, while the run goes on) that cannot be
    written is one warning line, and False returned: the run goes on to its final write."""
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_json(path, data)
    except OSError as error:
        if partial:
            print(f'{parser.prog}: warning: the report so far could not be written to --json {str(path)!r}: '
                  f'{error.strerror or error}; the run goes on', file=sys.stderr)
            return False
        print(f'{parser.prog}: error: the report could not be written to --json {str(path)!r}: '
              f'{error.strerror or error}; the table is printed above (free space or fix the permissions, or give '
              f'another --json)', file=sys.stderr)
        raise SystemExit(4) from None
    return True
