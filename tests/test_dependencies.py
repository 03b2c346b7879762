"""pyproject.toml declares every third-party package lipsformer imports, with the floors CI tests.

`.ci/run` runs the suite once with the newest releases pip resolves and once with `.ci/lowest-versions.txt`, which
must pin every runtime dependency to exactly its declared floor, so the floors cannot drift from what was tested.
"""
import ast
import importlib.metadata
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
LOWEST = ROOT / '.ci' / 'lowest-versions.txt'


def declared_floors() -> dict[str, Version]:
    floors = {}
    for line in PYPROJECT['dependencies']:
        requirement = Requirement(line)
        lower = [Version(spec.version) for spec in requirement.specifier if spec.operator == '>=']
        assert len(lower) == 1, f'{line!r}: every runtime dependency needs one tested floor (>=)'
        floors[canonicalize_name(requirement.name)] = lower[0]
    return floors


def pinned_versions() -> dict[str, str]:
    pins = {}
    for line in LOWEST.read_text().splitlines():
        line = line.split('#')[0].strip()
        if line:
            name, separator, version = line.partition('==')
            assert separator and version, f'{LOWEST.name}: {line!r} is not an exact pin (name==version)'
            pins[canonicalize_name(name)] = version.strip()
    return pins


def test_lowest_versions_pin_exactly_the_declared_floors():
    # Written the same, not only equal as versions: the CI log and pyproject.toml must read alike.
    assert {name: str(floor) for name, floor in declared_floors().items()} == pinned_versions()


def imported_distributions() -> set[str]:
    """Distributions of every top-level module imported anywhere in lipsformer/ (lazy imports included)."""
    modules = set()
    for path in (ROOT / 'lipsformer').rglob('*.py'):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split('.')[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split('.')[0])
    third_party = modules - set(sys.stdlib_module_names) - {'lipsformer'}
    distributions = importlib.metadata.packages_distributions()
    missing = sorted(module for module in third_party if module not in distributions)
    assert not missing, f'imported but not installed by pip install -e ".[dev]": {missing}'
    return {canonicalize_name(dist) for module in third_party for dist in distributions[module]}


def test_every_imported_package_is_declared():
    # A lazy import of an optional feature's package (matplotlib for plots) may be declared by that feature's extra;
    # the dev extra is for the tests and is not what a user installs.
    extras = {canonicalize_name(Requirement(line).name) for extra, lines in PYPROJECT['optional-dependencies'].items()
              if extra != 'dev' for line in lines}
    undeclared = imported_distributions() - set(declared_floors()) - extras
    assert not undeclared, f'lipsformer imports {sorted(undeclared)} without declaring them in pyproject.toml'


def test_every_declared_package_is_imported():
    # A runtime dependency nothing imports only costs users an install.
    unused = set(declared_floors()) - imported_distributions()
    assert not unused, f'pyproject.toml declares {sorted(unused)} but lipsformer never imports them'


def test_installed_accelerate_runs_the_fsdp2_recipe():
    """configs/accelerate/fsdp.yaml asks for FSDP2 (``fsdp_version: 2``), which accelerate has from 1.6.0 on."""
    import yaml
    from accelerate.utils import FullyShardedDataParallelPlugin

    recipe = yaml.safe_load((ROOT / 'configs' / 'accelerate' / 'fsdp.yaml').read_text())['fsdp_config']
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=recipe['fsdp_version'], reshard_after_forward=recipe['fsdp_reshard_after_forward'],
        auto_wrap_policy=recipe['fsdp_auto_wrap_policy'].lower(),
        transformer_cls_names_to_wrap=[recipe['fsdp_transformer_layer_cls_to_wrap']])
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
