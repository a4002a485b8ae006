"""Names to objects: every named format, block-scaling recipe and attention recipe.

Anything with a ``name`` attribute can be registered: `FloatFormat`, `QuantSpec`, and the
analysis layer's `AttentionRecipe`. A user's own object registered here is found by name
everywhere a preset is: in `quantize`, in attention recipes and in the CLI (and, once they
exist, the kernels).
"""

from __future__ import annotations

import difflib
import enum
from typing import Any

__all__ = ["register", "get", "names", "unregister", "parse_enum", "closest_first"]

_REGISTRY: dict[str, Any] = {}


def register(obj: Any, *, replace: bool = False) -> Any:
    """Register `obj` under ``obj.name`` and return it (so it can be used as a decorator
    of a literal). A taken name raises ValueError unless ``replace=True``."""
    name = getattr(obj, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"obj must have a non-empty string .name to be registered, got {obj!r}")
    if name in _REGISTRY and not replace and _REGISTRY[name] != obj:
        raise ValueError(f"name {name!r} is already registered; pass replace=True to replace it")
    _REGISTRY[name] = obj
    return obj


def unregister(name: str) -> None:
    """Remove a registered name (for tests and interactive work)."""
    if name not in _REGISTRY:
        raise KeyError(f"name {name!r} is not registered")
    del _REGISTRY[name]


def get(name: str, kind: type | tuple[type, ...] | None = None) -> Any:
    """The object registered under `name`; `kind` optionally demands its type."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a string, got {type(name).__name__}")
    try:
        obj = _REGISTRY[name]
    except KeyError:
        kinds = "" if kind is None else f" {_kind_name(kind)}"
        listed = ", ".join(closest_first(name, names(kind)))
        raise ValueError(
            f"unknown name {name!r}; registered{kinds} names, closest first: {listed}"
        ) from None
    if kind is not None and not isinstance(obj, kind):
        raise ValueError(f"{name!r} is a {type(obj).__name__}, not a {_kind_name(kind)}")
    return obj


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)


def closest_first(name: str, candidates: list[str]) -> list[str]:
    """`candidates` ordered by their similarity to `name` (difflib's ratio), the closest
    first, ties in registration order."""
    ratio = lambda c: difflib.SequenceMatcher(None, name, c).ratio()  # noqa: E731
    return sorted(candidates, key=ratio, reverse=True)


def names(kind: type | tuple[type, ...] | None = None) -> list[str]:
    """Registered names in registration order, optionally only those of type `kind`."""
    return [n for n, obj in _REGISTRY.items() if kind is None or isinstance(obj, kind)]


def parse_enum(kind: type[enum.Enum], value: Any, field: str) -> enum.Enum:
    """A member of `kind` from itself or its value (a name such as ``"nearest_even"``);
    anything else raises ValueError naming `field` and the accepted values."""
    if isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        known = ", ".join(str(m.value) for m in kind)
        raise ValueError(f"{field} must be one of {known}; got {value!r}") from None
