"""The package's layout: its parts depend on each other in one direction only.

The import graph is read from the source with ``ast`` (every ``import`` and ``from ... import``, relative or absolute,
at module level or inside a function), one node per subpackage or top-level module of ``lipsformer`` and one for the
root package itself (``lipsformer/__init__.py``, which imports the models). A cycle between two parts means neither
can be understood, tested or imported without the other, and that the package loads only by the order of the
imports in its ``__init__`` files.
"""
import ast
from pathlib import Path

import pytest

import lipsformer

PACKAGE_DIR = Path(lipsformer.__file__).resolve().parent
ROOT = 'lipsformer'


def _module_name(path: Path, source_root: Path) -> tuple[str, bool]:
    """The dotted name of the module at ``path`` and whether it is a package's ``__init__``."""
    parts = list(path.relative_to(source_root).with_suffix('').parts)
    if parts[-1] == '__init__':
        return '.'.join(parts[:-1]), True
    return '.'.join(parts), False


def _is_module(name: str, source_root: Path) -> bool:
    """Whether the dotted name ``lipsformer.x.y`` is a module or package of the source tree."""
    path = source_root.joinpath(*name.split('.'))
    return path.with_suffix('.py').is_file() or (path / '__init__.py').is_file()


def _imported_modules(path: Path, source_root: Path) -> list[tuple[str, int]]:
    """The ``lipsformer`` modules that the file at ``path`` imports, with the line of each import."""
    name, is_package = _module_name(path, source_root)
    package = name.split('.') if is_package else name.split('.')[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = '.'.join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module
            for alias in node.names:
                # `from package import name` imports the module package.name where there is one; otherwise it
                # reads a name of the package's __init__.
                child = f'{base}.{alias.name}'
                found.append((child if _is_module(child, source_root) else base, node.lineno))
    return [(module, line) for module, line in found if module == ROOT or module.startswith(ROOT + '.')]


def _part(module: str) -> str:
    """The node of the layout a module belongs to: ``lipsformer`` (the root ``__init__``) or ``lipsformer.<part>``."""
    return '.'.join(module.split('.')[:2])


def import_graph(package_dir: Path = PACKAGE_DIR, by_module: bool = False) -> dict[str, dict[str, list[str]]]:
    """``graph[a][b]``: where part ``a`` imports part ``b`` (``file:line``), for every pair of distinct parts (with
    ``by_module``, of distinct modules: a package's ``__init__`` is the package's node)."""
    graph: dict[str, dict[str, list[str]]] = {}
    source_root = package_dir.parent
    node = (lambda module: module) if by_module else _part
    for path in sorted(package_dir.rglob('*.py')):
        name, _ = _module_name(path, source_root)
        for module, line in _imported_modules(path, source_root):
            source, target = node(name), node(module)
            if source != target:
                where = f'{path.relative_to(source_root)}:{line}'
                graph.setdefault(source, {}).setdefault(target, []).append(where)
    return graph


def find_cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One cycle of the graph as its nodes (first node repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, {})):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_find_cycle_names_the_cycle():
    graph = {'a': {'b': ['a.py:1']}, 'b': {'c': ['b.py:2']}, 'c': {'a': ['c.py:3']}, 'd': {'a': ['d.py:4']}}
    assert find_cycle(graph) == ['a', 'b', 'c', 'a']
    del graph['c']['a']
    assert find_cycle(graph) is None


def test_imports_are_read_relative_absolute_and_inside_functions(tmp_path):
    package = tmp_path / ROOT
    for folder in ('one', 'two'):
        (package / folder).mkdir(parents=True)
        (package / folder / '__init__.py').write_text('')
    (package / '__init__.py').write_text('')
    (package / 'one' / 'a.py').write_text('def f():\n    from ..two import b\n')
    (package / 'two' / 'b.py').write_text('import lipsformer.one.a\n')
    graph = import_graph(package)
    assert graph == {'lipsformer.one': {'lipsformer.two': ['lipsformer/one/a.py:2']},
                     'lipsformer.two': {'lipsformer.one': ['lipsformer/two/b.py:1']}}
    assert find_cycle(graph) == ['lipsformer.one', 'lipsformer.two', 'lipsformer.one']


@pytest.mark.parametrize('by_module', [False, True], ids=['parts', 'modules'])
def test_no_import_cycle_between_parts_or_modules_of_the_package(by_module):
    """Neither between parts nor between two modules of one part, an import inside a function included (it defers a
    cycle to run time; it does not remove it)."""
    graph = import_graph(by_module=by_module)
    assert graph, 'the import graph came out empty: the test reads no source'
    cycle = find_cycle(graph)
    if cycle:
        steps = [f'  {a} -> {b}  ({", ".join(sorted(set(graph[a][b])))})' for a, b in zip(cycle, cycle[1:])]
        pytest.fail('import cycle in lipsformer:\n' + '\n'.join(steps))


# Names a package may use in every room: the package itself, ``python -m`` and a command line.
SHARED_MODULE_NAMES = {'__init__.py', '__main__.py', 'cli.py'}


def test_no_two_modules_share_a_file_name():
    """One name, one module: a name such as ``datasets.py`` in two rooms would mean two concepts under one name."""
    by_name: dict[str, list[str]] = {}
    for path in sorted(PACKAGE_DIR.rglob('*.py')):
        by_name.setdefault(path.name, []).append(str(path.relative_to(PACKAGE_DIR.parent)))
    assert len(by_name) > 20, 'the test reads no source'
    # a root module that defines nothing is a command's short name (python -m lipsformer.benchmark), not a concept
    by_name = {name: [path for path in paths if Path(path).parent.name != PACKAGE_DIR.name
                      or _public_definitions(PACKAGE_DIR.parent / path)] for name, paths in by_name.items()}
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1 and name not in SHARED_MODULE_NAMES}
    assert not shared, f'modules that share a file name: {shared}'


# Names every command or timm model file defines for itself, by convention: a command's entry point and parser, a
# model file's checkpoint filter and pretrained configs (as timm's model files do).
CONVENTIONAL_NAMES = {'main', 'parse_args', 'checkpoint_filter_fn', 'default_cfgs'}


def _public_definitions(path: Path) -> list[str]:
    """The public names a module defines at its top level: functions, classes and assigned constants."""
    names = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, ast.Assign):
            names += [target.id for target in node.targets if isinstance(target, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
    return [name for name in names if not name.startswith('_')]


def test_no_public_name_is_defined_in_two_modules():
    """One name, one thing: a public function, class or constant defined in two modules is either one concept
    written twice (it belongs in one place) or two concepts under one name (one of them wants another)."""
    by_name: dict[str, list[str]] = {}
    for path in sorted(PACKAGE_DIR.rglob('*.py')):
        for name in _public_definitions(path):
            by_name.setdefault(name, []).append(str(path.relative_to(PACKAGE_DIR.parent)))
    assert len(by_name) > 200, 'the test reads no source'
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1 and name not in CONVENTIONAL_NAMES}
    assert not shared, f'public names defined in more than one module: {shared}'
