"""Formats, recipes and run settings as plain JSON fields, and back, without running code.

What. `to_fields(obj)` turns a dataclass of fp4lab (a number format `FloatFormat`, a block
format `QuantSpec`, an attention recipe `AttentionRecipe`, or a config built of them: the
synthetic input's `SyntheticConfig`, the CLI's `AttentionRun`, a study's config) into
JSON-ready fields: every field by value, nested formats by their own fields, enums by their
values, tuples as lists, each dataclass tagged with its class name under ``"kind"``.
`from_fields(cls, fields)` builds the object back, and ``from_fields(type(x), to_fields(x))
== x`` for every registered format and recipe (tests/test_config.py).

Why fields, not names. A results folder's ``config.json`` must rerun its run in a fresh
process that never imported the code defining a custom format or recipe, where the name
alone would be unknown, and a name whose registered object has changed since would silently
rerun something else. The fields are the facts; the name is one of them.

How loading stays safe. Nothing is evaluated and nothing is looked up in the registry: each
JSON value is checked against its field's type annotation (bool, int, float, str, a
Literal's values, an enum's value, a tuple, None where the annotation allows it, a nested
dataclass chosen by its ``"kind"``) and the dataclass is then built, so its own checks run
too. An unknown field, a missing required one, a value of the wrong type or an unknown value
raises `ConfigError`, naming where it sits (``run.recipes[1].p.scale_rule``) and, for names,
the accepted ones closest first. Objects built this way are not registered; they are used as
they are. Numbers keep their JSON type (an int field value stays an int), so a rerun
computes with the very values recorded.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import types
import typing
from typing import Any

__all__ = ["ConfigError", "to_fields", "from_fields", "closest_first", "suggestions", "KIND"]

KIND = "kind"  # the key that names a dataclass's class in its fields


class ConfigError(ValueError):
    """A value that does not parse into its field; the message says where and why."""


def closest_first(name: str, candidates) -> list[str]:
    """`candidates` ordered by their similarity to `name` (difflib's ratio), closest first."""
    candidates = list(candidates)
    return difflib.get_close_matches(name, candidates, n=max(len(candidates), 1), cutoff=0.0)


def suggestions(name: str, candidates, limit: int = 8) -> str:
    """The `limit` candidates closest to `name`, as a comma-separated list with the count of
    the others ("a, b, c and 12 more")."""
    order = closest_first(name, candidates)
    shown = ", ".join(order[:limit]) or "none"
    return shown + (f" and {len(order) - limit} more" if len(order) > limit else "")


# -- writing --------------------------------------------------------------------------------
def to_fields(obj: Any) -> Any:
    """`obj` as JSON-ready values: a dataclass as ``{"kind": class name, field: value, ...}``
    (every init field, nested dataclasses the same way), an enum by its value, a tuple or
    list as a list; None, bools, ints, floats and strings as they are."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {KIND: type(obj).__name__}
        for f in dataclasses.fields(obj):
            if f.init:
                fields[f.name] = to_fields(getattr(obj, f.name))
        return fields
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (tuple, list)):
        return [to_fields(x) for x in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise ConfigError(f"a {type(obj).__name__} has no JSON fields: {_show(obj)}")


# -- reading --------------------------------------------------------------------------------
def from_fields(cls: type, fields: Any, *, where: str = "config") -> Any:
    """An instance of dataclass `cls` from its fields (as `to_fields` writes them), each
    value checked against its field's annotation; `where` names the place in error messages."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"cls must be a dataclass, got {cls!r}")
    return _parse(cls, fields, where)


def _parse(annotation: Any, value: Any, where: str) -> Any:
    """`value` parsed as `annotation` says (see the module docstring)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return _parse_union(typing.get_args(annotation), value, where)
    if origin is tuple:
        return _parse_tuple(typing.get_args(annotation), value, where)
    if origin is typing.Literal:
        return _parse_literal(typing.get_args(annotation), value, where)
    if annotation is type(None):
        if value is not None:
            raise ConfigError(f"{where}: must be null, got {_show(value)}")
        return None
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return _parse_dataclass(annotation, value, where)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return _parse_enum(annotation, value, where)
    if annotation in _SCALARS:
        return _parse_scalar(annotation, value, where)
    raise ConfigError(f"{where}: fields annotated {annotation!r} cannot be read from a config")


def _parse_scalar(annotation: type, value: Any, where: str) -> Any:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = {
        bool: isinstance(value, bool),
        int: is_number and isinstance(value, int),
        float: is_number,  # an int stays an int: the value recorded is the value used
        str: isinstance(value, str),
    }[annotation]
    if not ok:
        raise ConfigError(f"{where}: must be {_SCALARS[annotation]}, got {_show(value)}")
    return value


_SCALARS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _parse_union(members: tuple, value: Any, where: str) -> Any:
    """None where the union allows it; a dataclass member chosen by the value's "kind"; else
    the one other member."""
    optional = type(None) in members
    if value is None and optional:
        return None
    members = tuple(m for m in members if m is not type(None))
    classes = {m.__name__: m for m in members if dataclasses.is_dataclass(m)}
    if len(members) == 1:
        return _parse(members[0], value, where)
    if classes and len(classes) == len(members):
        kind = value.get(KIND) if isinstance(value, dict) else None
        if kind not in classes:
            allowed = " or ".join(classes) + (" or null" if optional else "")
            raise ConfigError(
                f"{where}: must be {allowed} by its fields, an object whose {KIND!r} names the "
                f"class; got {_show(value)}"
            )
        return _parse_dataclass(classes[kind], value, where)
    raise ConfigError(f"{where}: a union of {members!r} cannot be read from a config")


def _parse_tuple(args: tuple, value: Any, where: str) -> tuple:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}: must be a list, got {_show(value)}")
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_parse(args[0], x, f"{where}[{i}]") for i, x in enumerate(value))
    if len(value) != len(args):
        raise ConfigError(f"{where}: must be a list of {len(args)} values, got {_show(value)}")
    return tuple(
        _parse(a, x, f"{where}[{i}]") for i, (a, x) in enumerate(zip(args, value, strict=True))
    )


def _parse_literal(allowed: tuple, value: Any, where: str) -> Any:
    if value not in allowed or type(value) not in {type(a) for a in allowed}:
        shown = [str(a) for a in allowed]
        raise ConfigError(
            f"{where}: {_show(value)} is not allowed; one of, closest first: "
            f"{suggestions(str(value), shown, limit=len(shown))}"
        )
    return value


def _parse_enum(kind: type[enum.Enum], value: Any, where: str) -> enum.Enum:
    try:
        return kind(value)
    except ValueError:
        known = [str(m.value) for m in kind]
        raise ConfigError(
            f"{where}: {_show(value)} is not a {kind.__name__} value; its values, closest "
            f"first: {suggestions(str(value), known, limit=len(known))}"
        ) from None


def _parse_dataclass(cls: type, value: Any, where: str) -> Any:
    """The fields of `cls`, each parsed; unknown and missing fields are errors."""
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: must be a {cls.__name__} by its fields, got {_show(value)}")
    if value.get(KIND, cls.__name__) != cls.__name__:
        raise ConfigError(f"{where}: {KIND} must be {cls.__name__!r}, got {value[KIND]!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for name in value:
        if name != KIND and name not in fields:
            raise ConfigError(
                f"{where}: {cls.__name__} has no field {name!r}; its fields, closest first: "
                f"{suggestions(str(name), fields)}"
            )
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and name not in value:
            raise ConfigError(f"{where}: {cls.__name__} needs the field {name!r}")
    hints = _hints(cls)
    kwargs = {n: _parse(hints[n], value[n], f"{where}.{n}") for n in fields if n in value}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"{where}: {err}") from None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The evaluated field annotations of `cls` (its own module's names, never the config's)."""
    return typing.get_type_hints(cls)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
