"""Typed parameters: a dataclass field's type turns text (a flag, `key=value`, a TOML value)
into a value, once, for the registries (core/registry.py), the config files and the generated
flags (core/config.py).

Types understood: bool, int, float, str, `Literal[...]`, `X | None` (`Optional[X]`),
`tuple[X, ...]` and `tuple[X, Y]` (a comma-separated string or a list).
"""
from __future__ import annotations

import collections.abc
import dataclasses
import math
import types
import typing
from collections.abc import Iterable
from dataclasses import field
from typing import Any

from .errors import UserError


@dataclasses.dataclass(frozen=True)
class Bounds:
    """An interval a numeric parameter must lie in, written as in mathematics: "[0, 1]", "(0, 1)",
    "[1, inf)" (an open end refuses its endpoint; an infinite end bounds nothing)."""
    lo: float
    hi: float
    lo_open: bool
    hi_open: bool
    text: str

    @classmethod
    def parse(cls, text: str) -> Bounds:
        s = text.strip()
        if len(s) < 5 or s[0] not in "[(" or s[-1] not in "])" or "," not in s:
            raise ValueError(f"bounds {text!r}: want an interval such as '[0, 1]' or '(0, inf)'")
        lo_s, hi_s = (v.strip() for v in s[1:-1].split(",", 1))
        lo, hi = float(lo_s), float(hi_s)
        if not lo <= hi:
            raise ValueError(f"bounds {text!r}: the lower end is above the upper one")
        return cls(lo, hi, s[0] == "(" or math.isinf(lo), s[-1] == ")" or math.isinf(hi), s)

    def __contains__(self, v) -> bool:
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return bool(above and below)

    def finite(self) -> tuple[float, float] | None:
        """(lo, hi) where both ends are finite (a slider's range), else None."""
        return None if math.isinf(self.lo) or math.isinf(self.hi) else (self.lo, self.hi)

    def describe(self) -> str:
        """'in [0, 1]', or '≥ 1' / '> 0' / '≤ 4' where one end is infinite."""
        if math.isinf(self.hi) and not math.isinf(self.lo):
            return f"{'>' if self.lo_open else '≥'} {_num(self.lo)}"
        if math.isinf(self.lo) and not math.isinf(self.hi):
            return f"{'<' if self.hi_open else '≤'} {_num(self.hi)}"
        return f"in {self.text}"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def param(default, help_: str, *, bounds: str | None = None, step: float | None = None,
          nonfinite: bool = False, named: dict[str, Any] | None = None, **metadata):
    """The one way to declare a parameter or setting: a dataclass field with its default, the help
    that `--help`, `list` and the app show, and optionally
      bounds     an interval ("[0, 1]", "(0, inf)", "[1, inf)") that validation enforces and the
                 app's slider or number box spans (core.params.check_fields);
      step       the app's slider step;
      nonfinite  a float may be NaN or ±inf (by default it must be finite);
      named      words that stand for values ({"all": WHOLE_GALLERY}): accepted as input, and shown
                 instead of the value wherever a user sees it (`shown`);
    plus free metadata a registry reads (`flag`, `file`, `label`, `cli`)."""
    md = {"help": help_, **metadata}
    if bounds is not None:
        md["bounds"] = Bounds.parse(bounds)
    if step is not None:
        md["step"] = step
    if nonfinite:
        md["nonfinite"] = True
    if named:
        md["named"] = dict(named)
    return field(default=default, metadata=md)


def shown(f: dataclasses.Field, value):
    """How a user sees a field's value: the word declared for it (`param(named=...)`), or the value."""
    for word, v in f.metadata.get("named", {}).items():
        if value == v and type(value) is type(v):
            return word
    return value


def shown_params(params) -> dict:
    """A parameter dataclass's values as a user sees them (named values as their words)."""
    return {f.name: shown(f, getattr(params, f.name)) for f in dataclasses.fields(params)}


def bounds_of(f: dataclasses.Field) -> Bounds | None:
    return f.metadata.get("bounds")


def check_fields(obj, what: str, name=lambda n: n) -> None:
    """Refuse a field value outside its declared bounds or its `Literal` choices, and a non-finite
    float where the field does not allow one (each value of a tuple field too).  `name` turns a field
    name into how the message names it (a flag: '--embed-dim')."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        t = unwrap_optional(hints[f.name])
        v = getattr(obj, f.name)
        values = list(v) if typing.get_origin(t) is tuple and isinstance(v, tuple) else [v]
        b = bounds_of(f)
        label = f"{what}: {name(f.name)}" if what else name(f.name)
        if typing.get_origin(t) is typing.Literal and v is not None and v not in typing.get_args(t):
            raise UserError(f"{label} must be one of {list(typing.get_args(t))}, got {v!r}")
        for x in values:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                continue
            if isinstance(x, float) and not math.isfinite(x) and not f.metadata.get("nonfinite"):
                raise UserError(f"{label} must be a finite number, got {x}")
            if b is not None and x not in b:
                raise UserError(f"{label} must be {b.describe()}, got {x}")


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
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = list(fields)
    kw = {}
    for k, v in (given or {}).items():
        key = str(k).strip().replace("-", "_")
        if key not in names:
            if ignore_unknown:
                continue
            raise UserError(f"{what}: no parameter {key!r}; valid: {names or 'none'}")
        if v is None:
            continue
        words = fields[key].metadata.get("named", {})
        if isinstance(v, str) and v.strip().lower() in words:
            kw[key] = words[v.strip().lower()]
            continue
        kw[key] = convert(v, hints[key], f"{what}: {key}")
    p = cls(**kw)
    check_fields(p, what)
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
