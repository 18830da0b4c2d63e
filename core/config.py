"""Typed configuration: dataclasses with defaults, and argparse generated from them.

A field's help text lives in its metadata (`field(default, metadata={"help": ...})`);
tuples are given on the command line comma-separated; bools get --x/--no-x.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing


def _parse_tuple(elem_type):
    def parse(s: str):
        return tuple(elem_type(v) for v in s.split(",") if v.strip())
    return parse


def add_config_args(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or f.metadata.get("cli") is False:
            continue
        t = hints[f.name]
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_ = f.metadata.get("help", "") + f" (default: {default})"
        origin = typing.get_origin(t)
        args = typing.get_args(t)
        if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
            t = next(a for a in args if a is not type(None))
            origin, args = typing.get_origin(t), typing.get_args(t)
        if t is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
        elif origin is tuple:
            parser.add_argument(flag, type=_parse_tuple(args[0]), default=default, help=help_,
                                metavar="A,B,...")
        elif origin is typing.Literal:
            parser.add_argument(flag, choices=list(args), default=default, help=help_)
        else:
            kw = {"choices": f.metadata["choices"]} if "choices" in f.metadata else {}
            parser.add_argument(flag, type=t, default=default, help=help_, **kw)


def config_from_args(cls, ns: argparse.Namespace, **override):
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in vars(ns).items() if k in names}
    kw.update(override)
    return cls(**kw)


def parse_typed_items(cls, items, what: str, prefix: str | None = None):
    """Build dataclass `cls` from `key=value` strings (or `prefix.key=value`, keeping only
    those for `prefix`), converting each value to its field's type."""
    from .errors import UserError

    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {}
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
        k = key.strip().replace("-", "_")
        if k not in fields:
            raise UserError(f"{what}: no parameter {k!r}; it has {sorted(fields)}")
        t = hints[k]
        try:
            kw[k] = (value.lower() in ("1", "true", "yes")) if t is bool else t(value)
        except ValueError:
            raise UserError(f"{what}: {k}={value!r} is not a {t.__name__}") from None
    return cls(**kw)
