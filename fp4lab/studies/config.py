"""A study's config: a frozen dataclass of plain typed fields, set from strings and JSON.

A study's config is a dataclass whose fields are of the types below, so that the command
line (``--set key=value``) and a results folder's ``config.json`` can set every field
without evaluating code:

    int, float, bool, str, Literal["a", "b", ...], tuple[T, ...] of those, and X | None.

`apply_overrides` parses ``key=value`` strings into the fields' types (a tuple is a
comma-separated list, None is ``none``) and rebuilds the config, so the dataclass's own
``__post_init__`` checks run; an unknown key or a value of the wrong type is a ValueError
naming the key before anything runs. The config goes to and from ``config.json`` through
`fp4lab.config` (`to_fields`, `from_fields`), as every fp4lab config does.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

from fp4lab.config import KIND

__all__ = ["config_types", "apply_overrides", "parse_value", "describe_type"]

_SCALARS = (bool, int, float, str)
_TRUE = ("true", "yes", "1", "on")
_FALSE = ("false", "no", "0", "off")


def config_types(cls: type) -> dict[str, Any]:
    """The resolved type of each field of the config dataclass `cls`, checked to be one the
    command line and JSON can set (TypeError otherwise)."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"a study's config must be a dataclass, got {cls!r}")
    hints = typing.get_type_hints(cls)
    found = {}
    for field in dataclasses.fields(cls):
        if field.name == KIND:
            raise TypeError(f"{cls.__name__}.{KIND}: the name {KIND!r} is fp4lab.config's tag "
                            "of a dataclass's class in config.json; rename the field")
        kind = hints[field.name]
        _check_supported(kind, f"{cls.__name__}.{field.name}")
        found[field.name] = kind
    return found


def _check_supported(kind, where: str) -> None:
    if kind in _SCALARS or _literal(kind) is not None:
        return
    inner = _optional(kind)
    if inner is not None:
        return _check_supported(inner, where)
    item = _tuple_item(kind)
    if item is not None and (item in _SCALARS or _literal(item) is not None):
        return
    raise TypeError(
        f"{where}: type {kind!r} cannot be set from the command line; use int, float, bool, "
        "str, Literal[...], tuple[T, ...] of those, or X | None"
    )


def _literal(kind) -> tuple | None:
    return typing.get_args(kind) if typing.get_origin(kind) is Literal else None


def _optional(kind):
    """X for X | None (or Optional[X]), else None."""
    if typing.get_origin(kind) in (Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(kind)) == 2:
            return args[0]
    return None


def _tuple_item(kind):
    """T for tuple[T, ...], else None."""
    args = typing.get_args(kind)
    if typing.get_origin(kind) is tuple and len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return None


def describe_type(kind) -> str:
    """A field type in words, for help text and error messages."""
    if kind in _SCALARS:
        return kind.__name__
    if _literal(kind) is not None:
        return "one of " + ", ".join(map(str, _literal(kind)))
    if _optional(kind) is not None:
        return f"{describe_type(_optional(kind))} or none"
    return f"comma-separated list of {describe_type(_tuple_item(kind))}"


def parse_value(text: str, kind, key: str):
    """`text` parsed as a value of type `kind`; ValueError naming `key` if it is not one."""
    try:
        return _parse(text.strip(), kind)
    except ValueError as err:
        raise ValueError(
            f"--set {key}={text}: {key} takes a {describe_type(kind)} ({err})"
        ) from None


def _parse(text: str, kind):
    inner = _optional(kind)
    if inner is not None:
        return None if text.lower() in ("none", "null") else _parse(text, inner)
    item = _tuple_item(kind)
    if item is not None:
        return tuple(_parse(part.strip(), item) for part in text.split(",")) if text else ()
    choices = _literal(kind)
    if choices is not None:
        for choice in choices:
            if text == str(choice):
                return choice
        raise ValueError(f"{text!r} is not one of them")
    if kind is bool:
        if text.lower() in _TRUE + _FALSE:
            return text.lower() in _TRUE
        raise ValueError(f"{text!r} is not true or false")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not an integer") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a number") from None
    return text


def apply_overrides(config, overrides: list[str] | tuple[str, ...]):
    """`config` with each ``key=value`` of `overrides` parsed and set (a new instance, so the
    dataclass's checks run again); ValueError naming the key on any bad entry."""
    kinds = config_types(type(config))
    changes = {}
    for entry in overrides:
        if not isinstance(entry, str) or "=" not in entry:
            raise ValueError(f"--set {entry!r}: expected key=value")
        key, text = (part.strip() for part in entry.split("=", 1))
        if key not in kinds:
            raise ValueError(
                f"--set {entry}: unknown key {key!r}; {type(config).__name__} has "
                f"{', '.join(kinds)}"
            )
        changes[key] = parse_value(text, kinds[key], key)
    return dataclasses.replace(config, **changes)
