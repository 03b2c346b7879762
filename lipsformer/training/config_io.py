"""Reading, overriding, checking and writing training configs.

A config is YAML with the sections of :class:`~lipsformer.training.config.Config`. A file may start from
another with ``base: other.yaml``: a path relative to the file, else a packaged config's name (``base: quickstart``),
as ``--config`` takes it (:func:`resolve_config_path` resolves both). Its keys are merged over the base's, mapping by
mapping; a mapping tagged ``!replace`` (``kwargs: !replace {split_size: [1, 2, 7, 7]}``) replaces the base's instead,
so that keys it leaves out are gone. Command-line overrides ``key.sub=value`` are parsed as YAML values and applied
last, each replacing the value at its key. Every key, type and value is checked before anything is built, and a
mistake raises :class:`ConfigError` naming the key, the value and what is allowed. A key given twice in one mapping is
an error too (plain YAML keeps the last one and drops the other without a word).
The recipes ship inside the package (``lipsformer/configs``; a clone's top-level ``configs`` links there), so a bare
name such as ``lipsformer_cswin_tiny`` works from an installed wheel (:func:`resolve_config_path`).
"""
import dataclasses
import difflib
import math
import os
import textwrap
import types
import typing
from typing import Any, Literal

import yaml

from ..utils.io import write_text
from .config import Config, ConfigError, NotFiniteError, Rule, check_config, check_finite, not_finite_message

__all__ = ['PACKAGED_CONFIGS', 'coerce_key', 'config_from_dict', 'config_to_dict', 'config_to_yaml', 'dump_config',
           'flat_dict', 'load_config', 'packaged_config_names', 'parse_override', 'reference_yaml',
           'resolve_config_path']

_BASE_KEY = 'base'
REPLACE_TAG = '!replace'
PACKAGED_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs')


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that names a key twice (merge keys ``<<`` excepted)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == 'tag:yaml.org,2002:merge':
                continue
            key = self.construct_object(key_node, deep=True)
            if key in lines:
                raise yaml.constructor.ConstructorError(
                    'while reading a mapping', node.start_mark,
                    f'found the key {key!r} twice (first on line {lines[key] + 1}); YAML would keep the last value '
                    f'and ignore the other, so keep one of them', key_node.start_mark)
            lines[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


class _Replace(dict):
    """A mapping tagged ``!replace`` in a config with ``base:``: it replaces the base's mapping at its key instead of
    being merged into it."""


def _construct_replace(loader: _UniqueKeyLoader, node: yaml.Node) -> _Replace:
    if not isinstance(node, yaml.MappingNode):
        raise yaml.constructor.ConstructorError(
            None, None, f'{REPLACE_TAG} marks a mapping (kwargs: {REPLACE_TAG} {{split_size: [1, 2, 7, 7]}}); any '
                        f'other value replaces the base\'s already', node.start_mark)
    return _Replace(loader.construct_mapping(node, deep=True))


_UniqueKeyLoader.add_constructor(REPLACE_TAG, _construct_replace)


def _load_yaml(stream: Any) -> Any:
    return yaml.load(stream, Loader=_UniqueKeyLoader)


def load_config(path: str | os.PathLike | None = None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read a YAML config (following ``base:`` links), apply ``key.sub=value`` overrides and validate it.

    Args:
        path: YAML file or the name of a packaged config (:func:`resolve_config_path`); None starts from the
            defaults.
        overrides: Strings ``key.sub=value``; the value is parsed as YAML (``optimizer.betas=[0.9,0.99]``).

    Returns:
        The checked config.

    Raises:
        ConfigError: Unreadable file, unknown key, wrong type or impossible value.
    """
    raw = _read_yaml_with_bases(resolve_config_path(path), chain=()) if path is not None else {}
    for override in overrides:
        key, value = parse_override(override)
        _set_dotted(raw, key, value)
    return config_from_dict(raw)


def resolve_config_path(name: str | os.PathLike, relative_to: str | os.PathLike | None = None) -> str:
    """A config file: ``name`` itself when it exists, else the packaged config it names.

    ``--config`` and a config's ``base:`` both resolve here, so that they take the same names:
    ``lipsformer_cswin_tiny``, ``lipsformer_cswin_tiny.yaml`` and ``ablations/alpha_0.1`` name files under
    :data:`PACKAGED_CONFIGS`; a path that exists always wins over a packaged name.

    Args:
        name: A path or a packaged config's name.
        relative_to: The config file whose ``base:`` gives ``name``: a relative path is then read from its folder
            (None: from the working directory, as ``--config``).

    Raises:
        ConfigError: Neither a file nor a packaged name; the message lists the packaged names.
    """
    path = os.fspath(name)
    if relative_to is not None:
        path = os.path.join(os.path.dirname(os.fspath(relative_to)), path)
    if os.path.isfile(path):
        return path
    missing = f'cannot read config file {path!r}: no such file'
    if relative_to is not None:
        missing = f'{os.fspath(relative_to)!r}: base: {os.fspath(name)!r}: {missing}'
    return _packaged_config(os.fspath(name), missing)


def _packaged_config(name: str, missing: str) -> str:
    """The packaged config ``name`` names, or a :class:`ConfigError` that starts with ``missing`` and lists them."""
    stem = name.removesuffix('.yaml')
    packaged = os.path.join(PACKAGED_CONFIGS, *stem.split('/')) + '.yaml'
    if not os.path.isabs(name) and '..' not in stem.split('/') and os.path.isfile(packaged):
        return packaged
    close = difflib.get_close_matches(os.path.basename(stem), packaged_config_names(), n=1, cutoff=0.7)
    hint = f' (did you mean {close[0]}?)' if close else ''
    raise ConfigError(f'{missing}, nor a packaged config{hint}; packaged: '
                      f'{", ".join(n for n in packaged_config_names() if "/" not in n)} and the folders ablations/, '
                      f'authors/, base/')


def packaged_config_names() -> list[str]:
    """The names of the packaged configs (``lipsformer_cswin_tiny``, ``ablations/alpha_0.1``, ...), sorted."""
    names = []
    for folder, _, files in os.walk(PACKAGED_CONFIGS):
        relative = os.path.relpath(folder, PACKAGED_CONFIGS)
        names += [os.path.normpath(os.path.join(relative, f[:-5])).replace(os.sep, '/') for f in files
                  if f.endswith('.yaml')]
    return sorted(names)


def parse_override(override: str) -> tuple[str, Any]:
    """Split ``key.sub=value`` into the dotted key and the YAML-parsed value."""
    key, sep, text = override.partition('=')
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f'override {override!r} is not of the form key.sub=value (e.g. optimizer.lr=1e-3)')
    try:
        value = _load_yaml(text) if text.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f'override {override!r}: the value is not valid YAML ({e})') from e
    return key, _plain_data(value)  # an override replaces the value at its key, tagged !replace or not


def coerce_key(key: str, value: Any) -> Any:
    """``value`` checked and converted as the config reads ``key`` (``'1e-3'`` -> 0.001 for a float key).

    A key inside a mapping-valued key (``model.kwargs.depth``) is returned as given.

    Raises:
        ConfigError: An unknown key, or a value of the wrong type.
    """
    cls, prefix = Config, ''
    for part in key.split('.'):
        if not dataclasses.is_dataclass(cls):
            return value
        fields = [f.name for f in dataclasses.fields(cls)]
        if part not in fields:
            raise ConfigError(_unknown_key_message(prefix, part, fields))
        cls, prefix = typing.get_type_hints(cls)[part], f'{prefix}{part}.'
    return value if dataclasses.is_dataclass(cls) or typing.get_origin(cls) is dict else _coerce(key, value, cls)


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a :class:`Config` from nested plain data (missing keys take their defaults)."""
    if not isinstance(raw, dict):
        raise ConfigError(f'a config must be a mapping of sections, got {type(raw).__name__}')
    raw = _upgrade_legacy_keys({k: v for k, v in raw.items() if k != _BASE_KEY})
    config = _build_dataclass(Config, raw, prefix='')
    check_config(config)
    return config


def _upgrade_legacy_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """Read the keys of earlier versions as the keys that replaced them, so that older run folders' ``config.yaml``
    still load (validate.py, model cards): ``log.tensorboard`` true / false / null is ``log.trackers`` [tensorboard] /
    [] / null."""
    log = raw.get('log')
    if not isinstance(log, dict) or 'tensorboard' not in log:
        return raw
    if 'trackers' in log:
        raise ConfigError('log.tensorboard is replaced by log.trackers; give only log.trackers (e.g. [tensorboard])')
    log = dict(log)
    tensorboard = log.pop('tensorboard')
    log['trackers'] = None if tensorboard is None else (['tensorboard'] if tensorboard else [])
    return {**raw, 'log': log}


def config_to_dict(config: Config) -> dict[str, Any]:
    """The config as nested plain data (what ``config.yaml`` holds)."""
    return dataclasses.asdict(config)


def config_to_yaml(config: Config) -> str:
    """The fully resolved config as YAML (what ``config.yaml`` holds and ``train.py --print-config`` prints)."""
    return yaml.safe_dump(config_to_dict(config), sort_keys=False, default_flow_style=None)


def dump_config(config: Config, path: str | os.PathLike) -> None:
    """Write the fully resolved config as YAML, atomically."""
    write_text(path, config_to_yaml(config))


def flat_dict(data: dict[str, Any], prefix: str = '') -> dict[str, Any]:
    """Nested config data as ``{'section.key': value}`` with plain values (for trackers and comparisons)."""
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(flat_dict(value, f'{prefix}{key}.'))
        else:
            flat[f'{prefix}{key}'] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


def reference_yaml() -> str:
    """A YAML file with every key at its default, each preceded by its documentation and what it allows."""
    lines = ['# Every training config key, at its default, documented once (generated from',
             '# lipsformer/training/config.py by `python train.py --print-reference`).',
             '# A config file may start with `base: other.yaml` (relative to the file) or `base: NAME` (a packaged',
             '# config) and override any subset of these keys; a mapping tagged !replace replaces the base\'s',
             '# instead of being merged into it;',
             '# train.py also takes overrides as key.sub=value arguments (values parsed as YAML).', '']
    defaults = Config()
    hints = typing.get_type_hints(Config)
    for section in dataclasses.fields(Config):
        section_value = getattr(defaults, section.name)
        lines.append(f'# {"-" * 70}')
        lines.append(f'# {section.name}: {type(section_value).__doc__.strip()}')
        lines.append(f'{section.name}:')
        key_hints = typing.get_type_hints(hints[section.name])
        for key in dataclasses.fields(section_value):
            lines += [f'  # {line}' for line in textwrap.wrap(key.metadata['help'], width=100)]
            allowed = _allowed(key.metadata['rule'], key_hints[key.name])
            if allowed:
                lines.append(f'  # allowed: {allowed}')
            dumped = yaml.safe_dump({key.name: getattr(section_value, key.name)}, default_flow_style=True)
            lines.append('  ' + dumped.strip()[1:-1])
        lines.append('')
    return '\n'.join(lines)


def _allowed(rule: Rule | None, annotation: Any) -> str | None:
    """What a key allows beyond its plain type: its rule, or the values of a Literal type."""
    if rule is not None:
        return rule.allowed
    literal = any(typing.get_origin(a) is Literal for a in (annotation, *typing.get_args(annotation)))
    return _describe(annotation) if literal else None


def _read_yaml_with_bases(path: str, chain: tuple[str, ...]) -> dict[str, Any]:
    """Load a YAML mapping, merged over the file named by its ``base`` key (recursively)."""
    real_path = os.path.realpath(path)
    if real_path in chain:
        raise ConfigError(f'config {path!r} includes itself through base: ' + ' -> '.join(chain + (real_path,)))
    try:
        with open(path) as f:
            data = _load_yaml(f)
    except OSError as e:
        raise ConfigError(f'cannot read config file {path!r}: {e.strerror}') from e
    except yaml.YAMLError as e:
        raise ConfigError(f'config file {path!r} is not valid YAML: {e}') from e
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f'config file {path!r} must hold a mapping of sections, got {type(data).__name__}')
    base = data.pop(_BASE_KEY, None)
    if base is None:
        replaced = _replaced_keys(data)
        if replaced:
            raise ConfigError(f'{path!r} marks {", ".join(replaced)} {REPLACE_TAG}, which replaces a mapping of the '
                              f'base config, but has no base:; remove the tag or add base: NAME')
        return data
    if not isinstance(base, str) or not base:
        raise ConfigError(f'{path!r}: base must name another YAML file (a path relative to this file, or a packaged '
                          f'config such as quickstart), got {base!r}')
    base_path = resolve_config_path(base, relative_to=path)
    return _deep_merge(_read_yaml_with_bases(base_path, chain + (real_path,)), data)


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """``update`` merged into ``base``: mappings key by key, except those tagged ``!replace``, which replace."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, _Replace):
            merged[key] = _plain_data(value)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _plain_data(value: Any) -> Any:
    """``value`` with every ``!replace`` mapping in it a plain dict (what a config holds once merged)."""
    if isinstance(value, dict):
        return {key: _plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain_data(item) for item in value]
    return value


def _replaced_keys(data: dict[str, Any], prefix: str = '') -> list[str]:
    """The dotted keys of the mappings tagged ``!replace`` in ``data``."""
    found = []
    for key, value in data.items():
        if isinstance(value, _Replace):
            found.append(f'{prefix}{key}')
        elif isinstance(value, dict):
            found += _replaced_keys(value, f'{prefix}{key}.')
    return found


def _set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    parts = key.split('.')
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


def _build_dataclass(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f'{prefix.rstrip(".") or "config"}: expected a mapping of keys, got {raw!r}')
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise ConfigError(_unknown_key_message(prefix, str(key), list(fields)))
    values = {}
    for name, value in raw.items():
        annotation = hints[name]
        if dataclasses.is_dataclass(annotation):
            values[name] = _build_dataclass(annotation, value, f'{prefix}{name}.')
        else:
            rule = fields[name].metadata['rule']
            values[name] = _coerce(f'{prefix}{name}', value, annotation,
                                   None if rule is None else f'allowed: {rule.allowed}')
    return cls(**values)


def _unknown_key_message(prefix: str, key: str, valid: list[str]) -> str:
    where = prefix.rstrip('.') or 'the top level'
    close = difflib.get_close_matches(key, valid, n=1)
    hint = f" (did you mean '{prefix}{close[0]}'?)" if close else ''
    return f"unknown config key '{prefix}{key}'{hint}; keys allowed in {where}: {', '.join(valid)}"


def _coerce(key: str, value: Any, annotation: Any, allowed: str | None = None) -> Any:
    """Check ``value`` against ``annotation``, converting only lossless cases (int -> float, '1e-3' -> 0.001);
    ``allowed`` (the key's rule) completes the message for a number that is not finite."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(key, value, option, allowed)
            except NotFiniteError:  # the type fits: say why the number is refused, not which types the key takes
                raise
            except ConfigError:
                continue
        raise ConfigError(f'{key}: got {value!r}; expected {_describe(annotation)}')
    if origin is Literal:
        if value is False and 'no' in args:  # YAML 1.1 reads a bare `no` as false
            return 'no'
        if value in args and not isinstance(value, bool):
            return value
        raise ConfigError(f'{key}: got {value!r}; allowed values: {", ".join(map(repr, args))}')
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f'{key}: got {value!r}; expected a list of {_describe(args[0])}')
        return [_coerce(f'{key}[{i}]', item, args[0], allowed) for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f'{key}: got {value!r}; expected a mapping')
        check_finite(key, value)
        return dict(value)
    if annotation is bool:
        if isinstance(value, bool):
            return value
    elif annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif annotation is float:
        number = _as_float(value)
        if number is not None and math.isfinite(number):
            return number
        if number is not None:  # .inf, .nan, 1e400: nothing the run could train or schedule with
            raise NotFiniteError(not_finite_message(key, value, allowed))
    elif annotation is str:
        if isinstance(value, str):
            return value
    if value is None:  # key= on the command line, or a key with nothing after its colon
        empty = f': {key}="\'\'" gives an empty string' if annotation is str else ''
        raise ConfigError(f'{key}: got an empty value (YAML null); expected {_describe(annotation)}{empty}')
    raise ConfigError(f'{key}: got {value!r} ({type(value).__name__}); expected {_describe(annotation)}')


def _as_float(value: Any) -> float | None:
    """A float from a number or from a numeric string (PyYAML reads ``1e-3`` as a string)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def _describe(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return ' or '.join('null' if a is type(None) else _describe(a) for a in args)
    if origin is Literal:
        return 'one of ' + ', '.join(map(repr, args))
    if origin is list:
        return f'a list of {_describe(args[0])}'
    if origin is dict:
        return 'a mapping'
    return {bool: 'true or false', int: 'an integer', float: 'a number', str: 'a string'}.get(
        annotation, str(annotation))
