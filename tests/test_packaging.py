"""A non-editable install: the four console scripts and the packaged configs."""
import fnmatch
import glob
import importlib
import os
import subprocess
import sys
import tomllib
import zipfile

import pytest

from lipsformer.training.config import ConfigError
from lipsformer.training.config_io import PACKAGED_CONFIGS, load_config, packaged_config_names, resolve_config_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = ('lipsformer-train', 'lipsformer-validate', 'lipsformer-lipschitz', 'lipsformer-benchmark')


def _pyproject() -> dict:
    with open(os.path.join(REPO, 'pyproject.toml'), 'rb') as f:
        return tomllib.load(f)


def test_console_scripts_name_importable_mains():
    scripts = _pyproject()['project']['scripts']
    assert set(COMMANDS) <= set(scripts)
    for command in COMMANDS:
        module, _, name = scripts[command].partition(':')
        assert callable(getattr(importlib.import_module(module), name)), scripts[command]


def test_every_config_is_package_data_and_the_top_level_folder_is_the_same():
    patterns = _pyproject()['tool']['setuptools']['package-data']['lipsformer']
    package = os.path.join(REPO, 'lipsformer')
    shipped = [os.path.relpath(p, package) for p in glob.glob(os.path.join(PACKAGED_CONFIGS, '**', '*.yaml'),
                                                                recursive=True)]
    assert len(shipped) > 40 and all(any(fnmatch.fnmatch(p, pattern) and p.count('/') == pattern.count('/')
                                         for pattern in patterns) for p in shipped), shipped
    assert os.path.samefile(os.path.join(REPO, 'configs'), PACKAGED_CONFIGS)  # README's configs/... paths
    # No C source in the package nor in what ships: nothing is compiled at run time.
    assert glob.glob(os.path.join(package, '**', '*.c'), recursive=True) == []
    assert not any(pattern.endswith('.c') for pattern in patterns), patterns


def test_a_bare_name_loads_the_packaged_config_and_paths_still_win(tmp_path, monkeypatch):
    assert load_config('lipsformer_cswin_tiny') == load_config(os.path.join(REPO, 'configs',
                                                                             'lipsformer_cswin_tiny.yaml'))
    assert load_config('ablations/alpha_0.1.yaml').model.kwargs['alpha_init'] == 0.1
    assert 'quickstart' in packaged_config_names() and 'ablations/alpha_0.1' in packaged_config_names()
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'quickstart').write_text('train: {epochs: 1}\n')  # a file of that name in the working folder wins
    assert resolve_config_path('quickstart') == 'quickstart' and load_config('quickstart').train.epochs == 1
    with pytest.raises(ConfigError, match=r"'lipsformer_cswin_tinny': no such file, nor a packaged config \(did you "
                                          r"mean lipsformer_cswin_tiny\?\)"):
        load_config('lipsformer_cswin_tinny')
    with pytest.raises(ConfigError, match='no such file'):
        load_config('../configs/quickstart')  # nothing outside the packaged folder is reached by name


@pytest.mark.slow  # about 30 s: a wheel build and five processes that import torch
def test_a_wheel_install_has_the_commands_and_the_configs(tmp_path):
    """Build the wheel, install it (not editable) into a folder of its own and run the installed commands from
    elsewhere: they import the installed package and find the configs by name."""
    pytest.importorskip('setuptools')
    wheels, target = tmp_path / 'wheels', tmp_path / 'site'
    pip = [sys.executable, '-m', 'pip', '--disable-pip-version-check', '-q']
    subprocess.run([*pip, 'wheel', '--no-deps', '--no-build-isolation', '--no-index', REPO, '-w', str(wheels)],
                   check=True, capture_output=True, timeout=300)
    wheel = glob.glob(str(wheels / '*.whl'))[0]
    names = zipfile.ZipFile(wheel).namelist()
    assert sum(n.startswith('lipsformer/configs/') and n.endswith('.yaml') for n in names) == len(
        packaged_config_names())
    assert [n for n in names if n.endswith(('.c', '.so'))] == []  # no C to compile, none compiled
    subprocess.run([*pip, 'install', '--no-deps', '--no-index', '--target', str(target), wheel], check=True,
                   capture_output=True, timeout=300)
    env = {**os.environ, 'PYTHONPATH': str(target), 'OMP_NUM_THREADS': '1'}  # before the editable checkout

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(target / 'bin' / argv[0]), *argv[1:]], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    printed = run('lipsformer-train', '--config', 'lipsformer_cswin_tiny', '--print-config', '-b', '64')
    assert printed.returncode == 0, printed.stderr
    assert 'drop_path_rate: 0.2' in printed.stdout and 'batch_size: 64' in printed.stdout  # base: followed too
    where = subprocess.run([sys.executable, '-c', 'import lipsformer; print(lipsformer.__file__)'], cwd=tmp_path,
                           env=env, capture_output=True, text=True, timeout=120)
    assert where.stdout.startswith(str(target))  # the wheel's copy ran, not the checkout
    for command in COMMANDS[1:]:
        shown = run(command, '--help')
        assert shown.returncode == 0 and '--model' in shown.stdout, (command, shown.stderr)
