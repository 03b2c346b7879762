"""The examples in README.md and docs/*.md, run or parsed, so that the docs cannot name an API, a flag or a config key
that is gone.

- Every ```python block runs, each in a fresh namespace, in a temporary working folder prepared by :func:`doc_world`:
  - ``timm.create_model`` builds LipsFormer models at a tiny size (:data:`TINY`: width 16, one block per stage, the
    real windows and stripes) unless the call sets those arguments itself, so that the whole file runs in seconds;
  - the files the examples name exist, holding tiny models: ``lipsformer-swin-tiny.pth`` (a state dict of the tiny
    Swin-T), the timm model folders ``runs/cswin_tiny/export/best`` and ``models/lipsformer_swin_tiny``;
  - ``configs``, ``scripts``, ``train.py`` and ``validate.py`` link to the repository's, and ``runs/quickstart``
    holds a run's ``config.yaml``.
- Every command line in a ```bash / ```sh / ```shell block (and every ``$ `` line of a ```console block) that runs a
  command of the package goes through that command's own parser, in this process, without running the command:
  ``lipsformer-*`` through the function pyproject.toml's ``[project.scripts]`` names, ``python -m lipsformer...``
  through the module's ``__main__``, ``python train.py`` / ``validate.py`` through the clone's scripts. The parse
  stops the command at its ``ArgumentParser.parse_args``, after every argument has been checked. Training command
  lines go further: they run with ``--print-config``, which resolves the config with every flag and ``key=value``
  override and exits. ``accelerate launch`` lines are parsed by Accelerate's own launch parser, then the script's
  arguments as above; ``sbatch scripts/slurm_train.sh CONFIG RUN_DIR ARGS`` as the ``train.py`` line the script runs.
  ``bash SCRIPT`` is checked with ``bash -n``, and ``python -m pytest PATH`` names test files that exist.
- A block preceded by ``<!-- docs-test: skip REASON -->`` is left out, and must give its reason.
- Every relative link names a file and heading that exist; installation.md's floors are ``.ci/lowest-versions.txt``;
  README's set-up commands are what ``.ci/run`` runs.
"""
import argparse
import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
import tomllib
import warnings
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

import pytest
import timm
import timm.layers.config as timm_layer_config
import torch

from lipsformer.fastpath import switch as fast_path_switch

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / 'README.md', *sorted((ROOT / 'docs').glob('*.md'))]

# LipsFormer models at a tiny size: width 16, one block per stage, the real windows (7) and stripes (1, 2, 7, 7), so
# that 224x224 and 256x320 inputs take the paths (and the padding) of the full-size models.
TINY = {
    'lipsformer_swin': dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4)),
    'lipsformer_cswin': dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(2, 2, 4, 4)),
}

SKIP_MARK = re.compile(r'<!--\s*docs-test:\s*skip\b(?P<reason>[^>]*)-->')
FENCE = re.compile(r'^```(?P<info>[^\n`]*)\n(?P<body>.*?)^```\s*$', re.MULTILINE | re.DOTALL)
SHELL_LANGUAGES = {'bash', 'sh', 'shell', 'console'}


@dataclass
class Block:
    path: Path
    line: int
    language: str
    body: str
    skip_reason: str | None

    @property
    def id(self) -> str:
        return f'{self.path.relative_to(ROOT)}:{self.line}'


def _blocks() -> list[Block]:
    blocks = []
    for path in DOCS:
        text = path.read_text()
        for match in FENCE.finditer(text):
            before = text[:match.start()].rstrip().rsplit('\n', 1)[-1]
            skip = SKIP_MARK.search(before)
            blocks.append(Block(path, text.count('\n', 0, match.start()) + 1, match['info'].strip().split(' ')[0],
                                match['body'], skip['reason'].strip() if skip else None))
    return blocks


BLOCKS = _blocks()
PYTHON_BLOCKS = [b for b in BLOCKS if b.language == 'python']
SHELL_BLOCKS = [b for b in BLOCKS if b.language in SHELL_LANGUAGES]


def _tiny_kwargs(name: str) -> dict:
    base = name.split('.', 1)[0]
    for prefix, kwargs in TINY.items():
        if base.startswith(prefix + '_'):
            return kwargs
    return {}


def _tiny_create_model(create_model):
    def tiny_create_model(model_name, *args, **kwargs):
        for key, value in _tiny_kwargs(model_name).items():
            kwargs.setdefault(key, value)
        return create_model(model_name, *args, **kwargs)

    return tiny_create_model


@pytest.fixture(scope='module')
def doc_folder(tmp_path_factory):
    """The files of the examples' working folder (this module's docstring says what is in it), made once."""
    from lipsformer.hub import save_model_folder
    from lipsformer.training import config_to_yaml, load_config

    folder = tmp_path_factory.mktemp('docs')
    create_model = _tiny_create_model(timm.create_model)
    torch.manual_seed(0)
    torch.save(create_model('lipsformer_swin_tiny').state_dict(), folder / 'lipsformer-swin-tiny.pth')
    for name, path, classes in (('lipsformer_cswin_tiny', 'runs/cswin_tiny/export/best', 3),
                                ('lipsformer_swin_tiny', 'models/lipsformer_swin_tiny', 1000)):
        labels = [f'class_{i}' for i in range(classes)]
        save_model_folder(create_model(name, num_classes=classes), str(folder / path), dict(label_names=labels))
    for entry in ('configs', 'scripts', 'train.py', 'validate.py'):
        os.symlink(ROOT / entry, folder / entry)
    (folder / 'runs/quickstart').mkdir(parents=True)
    (folder / 'runs/quickstart/config.yaml').write_text(config_to_yaml(load_config('quickstart')))
    return folder


# Process-wide switches an example may set for "the rest of the process" (set_fast_path(False), timm's
# set_fused_attn / set_layer_config): each is put back after the example, so that no later test runs under it.
_PROCESS_SWITCHES = ((fast_path_switch, ('_enabled',)),
                     (timm_layer_config, ('_USE_FUSED_ATTN', '_EXPORTABLE', '_SCRIPTABLE', '_NO_JIT',
                                          '_NO_ACTIVATION_JIT', '_USE_REENTRANT_CKPT')))


@pytest.fixture
def doc_world(doc_folder, monkeypatch):
    """The examples' working folder as the current directory, with ``timm.create_model`` building tiny LipsFormers and
    the process-wide switches restored afterwards."""
    for module, names in _PROCESS_SWITCHES:
        for name in names:
            monkeypatch.setattr(module, name, getattr(module, name))
    monkeypatch.setattr(timm, 'create_model', _tiny_create_model(timm.create_model))
    monkeypatch.chdir(doc_folder)
    return doc_folder


def test_the_docs_have_examples():
    """The parsers below found the blocks (a change of fence syntax must not silence every test)."""
    assert len(PYTHON_BLOCKS) >= 10 and len(SHELL_BLOCKS) >= 10, (len(PYTHON_BLOCKS), len(SHELL_BLOCKS))
    assert all(b.skip_reason for b in BLOCKS if b.skip_reason is not None), 'a skipped block must say why'


@pytest.mark.parametrize('block', PYTHON_BLOCKS, ids=lambda b: b.id)
def test_python_example_runs(block, doc_world, one_thread):
    if block.skip_reason:
        pytest.skip(block.skip_reason)
    if re.search(r'^\s*(import|from) peft\b', block.body, re.MULTILINE):
        pytest.importorskip('peft')
    if re.search(r'^\s*(import|from) transformers\b', block.body, re.MULTILINE):
        pytest.importorskip('transformers')
    code = compile(block.body, block.id, 'exec')
    with contextlib.redirect_stdout(io.StringIO()):
        exec(code, {'__name__': '__doc_example__'})


def test_the_examples_leave_the_fast_path_switch_as_they_found_it():
    """Runs after the examples above (pytest keeps a file's order), one of which switches the fast path off "for the
    rest of the process": the tests after this file must not run without the fast form unknowingly."""
    assert any('set_fast_path(False)' in block.body for block in PYTHON_BLOCKS)
    assert fast_path_switch._enabled == fast_path_switch._from_environment()


# ---------------------------------------------------------------------------------------------------------------------
# Command lines

class _Parsed(Exception):
    """Raised by the patched ``ArgumentParser.parse_args`` once a command line has been parsed."""


def _command_lines(block: Block) -> list[str]:
    """The block's commands: continuation lines joined, comments dropped, ``&&`` / ``;`` chains split."""
    lines = block.body.splitlines()
    if block.language == 'console':
        lines = [line[2:] for line in lines if line.startswith('$ ')]
    joined, current = [], ''
    for line in lines:
        if line.rstrip().endswith('\\'):
            current += line.rstrip()[:-1] + ' '
            continue
        joined.append(current + line)
        current = ''
    commands = []
    for line in joined:
        tokens = shlex.split(line, comments=True)
        segment = []
        for token in [*tokens, '&&']:
            if token in ('&&', ';', '||'):
                if segment:
                    commands.append(segment)
                segment = []
            else:
                segment.append(token)
    return commands


def _strip_wrappers(tokens: list[str]) -> list[str]:
    """Drop ``VAR=value``, ``env``, ``nice -n N`` and ``taskset -c CPUS`` in front of a command."""
    while tokens:
        if re.fullmatch(r'[A-Za-z_][A-Za-z0-9_]*=.*', tokens[0]) or tokens[0] == 'env':
            tokens = tokens[1:]
        elif tokens[0] in ('nice', 'taskset') and len(tokens) > 2:
            tokens = tokens[3:]
        else:
            return tokens
    return tokens


def _scripts() -> dict[str, str]:
    return tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['scripts']


def _call_parser(argv0: str, args: list[str], run) -> argparse.Namespace:
    """Run ``run()`` with ``sys.argv = [argv0, *args]`` until its ``ArgumentParser.parse_args`` returns."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, *a, **k):
        raise _Parsed(original(self, *a, **k))

    saved = sys.argv
    sys.argv = [argv0, *args]
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(argparse.ArgumentParser, 'parse_args', parse_args)
            run()
    except _Parsed as parsed:
        return parsed.args[0]
    except SystemExit as e:
        raise AssertionError(f'{argv0} {shlex.join(args)}: the parser refused it (exit {e.code})') from e
    finally:
        sys.argv = saved
    raise AssertionError(f'{argv0} {shlex.join(args)}: finished without parsing a command line')


def _train(args: list[str], capsys) -> None:
    """A training command line, resolved to its config (every flag and override applied) and not run."""
    module, function = _scripts()['lipsformer-train'].split(':')
    capsys.readouterr()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            status = getattr(import_module(module), function)([*args, '--print-config'])
    except SystemExit as e:
        raise AssertionError(f'lipsformer-train {shlex.join(args)}: the parser refused it (exit {e.code})') from e
    assert status == 0, f'lipsformer-train {shlex.join(args)} --print-config: exit status {status}: ' \
                        f'{capsys.readouterr().err[-2000:]}'


def _entry_point(command: str, args: list[str]) -> None:
    module, function = _scripts()[command].split(':')
    _call_parser(command, args, getattr(import_module(module), function))


def _python_module(module: str, args: list[str]) -> None:
    with warnings.catch_warnings():  # runpy warns that the module was imported before (as lipsformer imports it)
        warnings.simplefilter('ignore', RuntimeWarning)
        _call_parser(f'python -m {module}', args, lambda: runpy.run_module(module, run_name='__main__'))


def _accelerate_launch(args: list[str], capsys) -> None:
    from accelerate.commands.launch import launch_command_parser

    try:
        launch = launch_command_parser().parse_args(args)
    except SystemExit as e:
        raise AssertionError(f'accelerate launch {shlex.join(args)}: Accelerate refused it (exit {e.code})') from e
    if launch.module:
        _check([sys.executable, '-m', launch.training_script, *launch.training_script_args], capsys)
    else:
        _check([sys.executable, launch.training_script, *launch.training_script_args], capsys)


def _check(tokens: list[str], capsys) -> bool:
    """Check one command (see the module docstring); False if it runs nothing of the package's."""
    tokens = _strip_wrappers(tokens)
    if not tokens:
        return False
    command, args = tokens[0], tokens[1:]
    if command == 'lipsformer-train':
        _train(args, capsys)
    elif command in _scripts():
        _entry_point(command, args)
    elif command == 'accelerate' and args[:1] == ['launch']:
        _accelerate_launch(args[1:], capsys)
    elif command == 'sbatch' and len(args) >= 3 and args[0] == 'scripts/slurm_train.sh':
        assert (ROOT / args[0]).is_file()
        _train(['--config', args[1], '--output', args[2], '--resume', 'auto', '--wait-for-lock', '900', *args[3:]],
               capsys)
    elif command == 'bash' and args and args[0].endswith('.sh'):
        subprocess.run(['bash', '-n', str(ROOT / args[0])], check=True)
    elif re.fullmatch(r'python3?|.*/python3?', command) and args[:2] == ['-m', 'pytest']:
        for path in (a for a in args[2:] if not a.startswith('-') and a.startswith('tests')):
            assert (ROOT / path.split('::')[0]).exists(), f'python -m pytest {path}: no such test file'
    elif re.fullmatch(r'python3?|.*/python3?', command) and args[:1] == ['-m'] and args[1].startswith('lipsformer'):
        if args[1] == 'lipsformer.training' or args[1].endswith('train_command'):
            _train(args[2:], capsys)
        else:
            _python_module(args[1], args[2:])
    elif re.fullmatch(r'python3?|.*/python3?', command) and args and args[0] == 'train.py':
        _train(args[1:], capsys)
    elif re.fullmatch(r'python3?|.*/python3?', command) and args and args[0] == 'validate.py':
        _call_parser('validate.py', args[1:], lambda: runpy.run_path(str(ROOT / 'validate.py'), run_name='__main__'))
    else:
        assert 'lipsformer' not in command and not any(a.endswith(('train.py', 'validate.py')) for a in args), \
            f'{shlex.join(tokens)}: a command of the package that this test does not know how to check'
        return False
    return True


@pytest.mark.parametrize('block', SHELL_BLOCKS, ids=lambda b: b.id)
def test_command_lines_parse(block, doc_world, capsys):
    if block.skip_reason:
        pytest.skip(block.skip_reason)
    for tokens in _command_lines(block):
        _check(tokens, capsys)


@pytest.mark.parametrize('line', [
    'lipsformer-train --config quickstart --no-such-flag',
    'lipsformer-train --config quickstart no_such_section.key=1',
    'python train.py --config quickstart -b not_a_number',
    'accelerate launch --no-such-launcher-flag train.py --config quickstart',
    'accelerate launch --multi_gpu train.py --config quickstart --no-such-flag',
    'lipsformer-validate --model lipsformer_swin_tiny --no-such-flag',
    'python validate.py --model lipsformer_swin_tiny --amp fp64',
    'python -m lipsformer.hub card',
    'python -m lipsformer.hub.convert only_one_argument',
    'lipsformer-benchmark --models lipsformer_swin_tiny --precision fp64',
    'sbatch scripts/slurm_train.sh quickstart runs/x --no-such-flag',
    'python -m pytest tests/test_no_such_file.py',
    'lipsformer-no-such-command --help',
])
def test_the_checks_refuse_a_wrong_command_line(line, doc_world, capsys):
    """What the checks above would let through if they did not parse: each of these lines must fail them."""
    with pytest.raises(AssertionError):
        _check(shlex.split(line), capsys)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = FENCE.sub('', path.read_text())
    headings = re.findall(r'^#+\s+(.*?)\s*$', text, re.MULTILINE)
    return {re.sub(r'[^\w\- ]', '', heading.lower()).replace(' ', '-') for heading in headings}


@pytest.mark.parametrize('path', DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    """Every relative link names a file of the repository, and its #anchor a heading there."""
    text = FENCE.sub('', path.read_text())
    broken = []
    for target in re.findall(r'\]\(([^)\s]+)\)', text):
        if re.match(r'[a-z]+:', target):
            continue
        file, _, anchor = target.partition('#')
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists() or (anchor and resolved.suffix == '.md' and anchor not in _anchors(resolved)):
            broken.append(target)
    assert not broken, f'{path.name}: links to nothing: {broken}'


def test_the_floors_in_installation_md_are_the_pinned_ones():
    """docs/installation.md's table of floors is .ci/lowest-versions.txt, package for package."""
    pins = dict(re.findall(r'^([\w-]+)==([\w.]+)', (ROOT / '.ci' / 'lowest-versions.txt').read_text(), re.MULTILINE))
    table = (ROOT / 'docs' / 'installation.md').read_text().split('| package | floor |', 1)[1].split('\n\n', 1)[0]
    documented = dict(re.findall(r'^\| ([\w-]+) \| ([\w.]+) \|', table, re.MULTILINE))
    assert documented == pins


def test_ci_runs_the_readme_set_up_commands():
    """README's two set-up commands are what .ci/run and scripts/quickstart.sh do."""
    readme = (ROOT / 'README.md').read_text()
    section = readme.split('## Set-up on a fresh machine', 1)[1].split('\n## ', 1)[0]
    (block,) = [b for b in FENCE.finditer(section)]
    commands = [shlex.join(c) for c in _command_lines(Block(ROOT, 0, 'bash', block['body'], None))]
    assert commands == ['bash scripts/quickstart.sh', 'python3 -m venv .venv', '. .venv/bin/activate',
                        "pip install -e '.[dev]'", 'python -m pytest -n auto'], commands
    ci = (ROOT / '.ci' / 'run').read_text()
    assert re.search(r'pip install --quiet -e "\.\[dev\]" "\$@"', ci)
    assert 'run_suite newest .venv' in ci and 'python -m pytest -n auto' in ci
