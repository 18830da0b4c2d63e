"""Typed parameters: a dataclass field's type turns text (a flag, `key=value`, a TOML value)
into a value, once, for the registries (core/registry.py), the config files and the generated
flags (core/config.py).

Types understood: bool, int, float, str, `Literal[...]`, `X | None` (`Optional[X]`),
`tuple[X, ...]` and `tuple[X, Y]` (a comma-separated string or a list).
"""
from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from collections.abc import Iterable
from dataclasses import field
from typing import Any

from .errors import UserError


def param(default, help_: str, **metadata):
    """A parameter field: its default and the help that `--help` and `list` show."""
    return field(default=default, metadata={"help": help_, **metadata})


def field_default(f: dataclasses.Field):
    """The field's default (its factory's value), None where it has none."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def optional_of(t) -> Any | None:
    """X for `X | None` / `Optional[X]`, else None."""
    if typing.get_origin(t) not in (typing.Union, types.UnionType):
        return None
    args = typing.get_args(t)
    rest = [a for a in args if a is not type(None)]
    if len(rest) != 1 or len(rest) == len(args):
        raise TypeError(f"unsupported union {t}: only X | None is")
    return rest[0]


def unwrap_optional(t):
    """X for `X | None`, `t` itself otherwise."""
    inner = optional_of(t)
    return t if inner is None else inner


def tuple_items(value) -> list:
    """A tuple value's items: a list or tuple as it is, a string split on commas (empty parts dropped)."""
    if isinstance(value, (list, tuple)):
        return list(value)
    return [s for s in str(value).split(",") if s.strip()]


def convert(value, t, what: str):
    """`value` (a string, or a TOML value) as the field type `t`; a UserError that names `what`
    where it is not one."""
    inner = optional_of(t)
    if inner is not None:
        # "" is None for every optional; "none" only where it cannot be a value (not for strings:
        # `weights = "none"` means no pretrained weights, not the default)
        if value is None or (isinstance(value, str) and (value == "" or (value.lower() == "none"
                                                                          and inner is not str))):
            return None
        t = inner
    origin = typing.get_origin(t)
    if origin is typing.Literal:
        choices = typing.get_args(t)
        if value not in choices:
            raise UserError(f"{what}: {value!r} is not one of {list(choices)}")
        return value
    if origin is tuple:
        args = typing.get_args(t)
        items = tuple_items(value)
        if len(args) == 2 and args[1] is Ellipsis:
            elems = [args[0]] * len(items)
        elif len(items) == len(args):
            elems = list(args)
        else:
            raise UserError(f"{what}: {value!r} is not {len(args)} comma-separated values")
        return tuple(convert(x, e, what) for x, e in zip(items, elems, strict=True))
    if t is bool:
        if isinstance(value, bool):
            return value
        s = str(value).lower()
        if s not in ("1", "true", "yes", "0", "false", "no"):
            raise UserError(f"{what}: {value!r} is not a boolean (true/false)")
        return s in ("1", "true", "yes")
    try:
        return t(value)
    except (TypeError, ValueError):
        kind = {int: "an integer", float: "a number", str: "a string"}.get(t, f"a {getattr(t, '__name__', t)}")
        raise UserError(f"{what}: {value!r} is not {kind}") from None


def conforms(value, t) -> bool:
    """Whether an already typed value fits the annotation `t` (for declarations written in code,
    which are not parsed from text): bool, int, float (an int is one too), str, Literal,
    X | None, tuple[X, ...], Mapping/dict[K, V], Any and plain classes."""
    if t is Any:
        return True
    inner = optional_of(t)
    if inner is not None:
        return value is None or conforms(value, inner)
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin is typing.Literal:
        return value in args
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(conforms(v, args[0]) for v in value)
        return len(value) == len(args) and all(conforms(v, a) for v, a in zip(value, args, strict=True))
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, collections.abc.Mapping):
            return False
        kt, vt = args or (Any, Any)
        return all(conforms(k, kt) and conforms(v, vt) for k, v in value.items())
    if t is bool:
        return isinstance(value, bool)
    if t is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(t, type):
        return isinstance(value, t)
    raise TypeError(f"unsupported annotation {t}")


def build_params(cls: type, given: dict | None, what: str, *, ignore_unknown: bool = False):
    """The dataclass `cls` from a dict of raw values, each converted to its field's type.
    Unknown keys are refused (with the valid ones) unless `ignore_unknown`; a
    `validate()` method on the dataclass runs last."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kw = {}
    for k, v in (given or {}).items():
        key = str(k).strip().replace("-", "_")
        if key not in names:
            if ignore_unknown:
                continue
            raise UserError(f"{what}: no parameter {key!r}; valid: {names or 'none'}")
        if v is None:
            continue
        kw[key] = convert(v, hints[key], f"{what}: {key}")
    p = cls(**kw)
    if hasattr(p, "validate"):
        p.validate()
    return p


def parse_items(items: Iterable[str], what: str, prefix: str | None = None) -> dict:
    """`key=value` (or `prefix.key=value`, keeping only those for `prefix`) → dict of strings."""
    out = {}
    for item in items:
        if "=" not in item:
            raise UserError(f"{what}: want key=value, got {item!r}")
        key, value = item.split("=", 1)
        if prefix is not None:
            if "." not in key:
                raise UserError(f"{what}: want name.key=value, got {item!r}")
            owner, key = key.split(".", 1)
            if owner != prefix:
                continue
        out[key.strip()] = value.strip()
    return out
