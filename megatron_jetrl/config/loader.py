"""Typed configuration from YAML: build frozen dataclasses from mappings, with ``key=value``
overrides, and turn them back into plain data for the run directory.

Every section of a job is a frozen dataclass whose ``__post_init__`` validates values and raises
``ConfigError`` naming the dotted key. This module adds what the dataclasses cannot see: unknown
keys, missing required keys, and values of the wrong type for the field's annotation. Supported
annotations: ``bool``, ``int``, ``float``, ``str``, ``Optional[X]``, ``X | Y``, ``tuple[X, ...]``,
``list[X]``, ``dict``/``Mapping``, ``Any``, ``Literal[...]``, ``Enum`` subclasses and nested
dataclasses.

YAML 1.1 reads ``1e-5`` as a string (it wants ``1.0e-5``); a float field accepts such strings, so
learning rates can be written the way people write them.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from pathlib import Path
from typing import Any, Hashable, Mapping, Sequence

import yaml

from megatron_jetrl.config.errors import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping: PyYAML would keep the last
    silently, so a second ``run:`` block would replace the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # SafeLoader names it
                continue
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice (first at line {first_line[key] + 1}); keep one",
                    key_node.start_mark)
            first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping at the top of a YAML file; a missing or unreadable file, bad syntax, a key given
    twice or another top-level type is a ``ConfigError`` on ``config`` saying where."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError("config", str(path), "is a directory; pass the path of a YAML job config file")
    if not p.exists():
        raise ConfigError("config", str(path), "no such file; pass the path of a YAML job config")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError("config", str(path), f"is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise ConfigError("config", str(path), f"cannot be read ({e.strerror or e})") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError("config", str(path), f"is not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError("config", str(path), f"must hold a mapping of sections; found {type(raw).__name__}")
    return raw


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b.c=value`` -> ("a.b.c", value); the value is read as YAML (``true``, ``3``, ``[1, 2]``,
    ``null``, ``{k: v}``), anything else stays a string."""
    key, sep, value = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError("override", text, "must look like section.key=value, e.g. actor.optimizer.lr=1e-6")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    return key, parsed


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A deep copy of ``raw`` with each ``key=value`` applied in order. A key given twice is an error
    (which one was meant?), as is a key whose parent is set to a non-mapping value; unknown keys are
    left for ``build`` to name."""
    out = _deep_copy(raw)
    given: dict[str, str] = {}
    for text in overrides:
        key, value = parse_override(text)
        if key in given:
            raise ConfigError(key, value, f"is given twice ({given[key]} and {text.strip()}): give it once")
        given[key] = text.strip()
        parts = key.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                prefix = ".".join(parts[: i + 1])
                raise ConfigError(prefix, child, f"is a value, not a section, so {key} cannot be set")
            node = child
        node[parts[-1]] = value
    return out


def build(cls: type, raw: Any, key: str, *, fixed: Mapping[str, Any] | None = None):
    """An instance of dataclass ``cls`` from mapping ``raw`` (None = all defaults). ``key`` is the
    dotted path of this section, used in every error. ``fixed`` supplies fields the caller sets
    itself; the config may not contain them."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise ConfigError(key, raw, f"must be a mapping of {_allowed_keys(cls, fixed)}")
    fixed = dict(fixed or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for name in raw:
        if name in fixed:
            raise ConfigError(_join(key, name), raw[name], "is set by the job itself; remove it from the config")
        if name not in fields:
            raise ConfigError(_join(key, str(name)), raw[name], f"unknown key; {key or 'the config'} allows "
                                                                 f"{_allowed_keys(cls, fixed)}")
    kwargs: dict[str, Any] = dict(fixed)
    for name, f in fields.items():
        if name in fixed:
            continue
        sub = _join(key, name)
        if name in raw:
            kwargs[name] = _value(hints[name], raw[name], sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(sub, None, "is required")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(key, dict(raw), str(e)) from None


def check_fields(obj: Any, key: str, names: tuple[str, ...] | None = None) -> None:
    """Check the fields ``names`` (default: all) of dataclass instance ``obj`` against their
    annotations, exactly as ``build`` checks a config's values (``Literal`` choices, ``bool``,
    ``Optional`` ...): the one type check, for sections built by the loader and in code alike.
    Call it first in ``__post_init__``; cross-field rules follow it there."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.init and (names is None or f.name in names):
            _value(hints[f.name], getattr(obj, f.name), _join(key, f.name))


def to_plain(obj: Any) -> Any:
    """Dataclasses, enums and tuples as YAML-safe dicts, strings and lists (for the run directory)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Mapping):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return obj


def _value(tp: Any, value: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is object:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(key, None, f"must be set ({_describe(tp)})")
        errors = []
        for arm in (a for a in args if a is not type(None)):
            try:
                return _value(arm, value, key)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:
            raise errors[0]
        raise ConfigError(key, value, f"must be {_describe(tp)}")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(key, value, f"must be one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, key)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        allowed = [m.value for m in tp]
        if value not in allowed:
            raise ConfigError(key, value, f"must be one of {allowed}")
        return tp(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, value, "must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, value, "must be an integer")
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(key, value, "must be a number") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(key, value, "must be a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, value, "must be a string")
        return value
    if origin in (tuple, list) or tp in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, value, "must be a list")
        if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise ConfigError(key, value, f"must be a list of {len(args)} values")
            items = [_value(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True))]
        else:
            item_tp = args[0] if args else Any
            items = [_value(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin in (dict, Mapping, typing.Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(key, value, "must be a mapping")
        return dict(value)
    if isinstance(tp, type):
        if not isinstance(value, tp):
            raise ConfigError(key, value, f"must be {tp.__name__}")
        return value
    raise TypeError(f"{key}: the config loader does not support the annotation {tp!r}")


def _describe(tp: Any) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    names = [getattr(a, "__name__", str(a)) for a in args]
    return " or ".join(names) + (" or null" if type(None) in typing.get_args(tp) else "")


def _allowed_keys(cls: type, fixed: Mapping[str, Any] | None) -> str:
    names = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in (fixed or {})]
    return "{" + ", ".join(names) + "}"


def _join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def _deep_copy(raw: Any) -> Any:
    if isinstance(raw, Mapping):
        return {k: _deep_copy(v) for k, v in raw.items()}
    if isinstance(raw, list):
        return [_deep_copy(v) for v in raw]
    return raw


__all__ = ["apply_overrides", "build", "load_yaml", "parse_override", "to_plain"]
