"""Typed configuration: dataclasses with defaults, argparse generated from them, TOML files.

Fields are declared with `core.params.param` (default, help, bounds); validation checks the bounds;
tuples are given on the command line comma-separated; bools get --x/--no-x.
`--config FILE.toml` loads the same fields from a file; flags given on the
command line override the file (the file's values become the parser's defaults).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tomllib
import typing
from pathlib import Path

from .errors import UserError
from .params import convert, field_default, tuple_items, unwrap_optional


def _parse_tuple(elem_type):
    def parse(s: str):
        return tuple(elem_type(v) for v in tuple_items(s))
    parse.__name__ = f"comma-separated {elem_type.__name__}s"
    return parse


def add_config_args(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = (),
                    defaults: dict | None = None, registries: dict | None = None,
                    inherit: str | None = None) -> None:
    """One option per dataclass field.  `defaults` (from a config file) replace the field defaults;
    `registries` maps a field name to the Registry whose names it takes (choices + docs in --help).
    `inherit` (e.g. "the checkpoint's"): the values come from a recorded artifact unless given, so
    an unset option is None and --help says where its default comes from."""
    hints = typing.get_type_hints(cls)
    registries = registries or {}
    for f in dataclasses.fields(cls):
        if f.name in skip or f.metadata.get("cli") is False:
            continue
        t = unwrap_optional(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = (defaults or {}).get(f.name, None if inherit else field_default(f))
        hlp = f.metadata.get("help", "")
        origin, args = typing.get_origin(t), typing.get_args(t)
        default_help = inherit.replace("%", "%%") if inherit else "%(default)s"
        if f.name in registries:
            registries[f.name].add_argument(parser, flag, default=default, help=hlp, many=origin is tuple,
                                            default_help=default_help)
            continue
        help_ = hlp.replace("%", "%%") + f" (default: {default_help})"
        if t is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_)
        elif origin is tuple:
            parser.add_argument(flag, type=_parse_tuple(args[0]), default=default, help=help_,
                                metavar="A,B,...")
        elif origin is typing.Literal:
            parser.add_argument(flag, choices=list(args), default=default, help=help_)
        else:
            parser.add_argument(flag, type=t, default=default, help=help_)


def config_from_args(cls, ns: argparse.Namespace, **override):
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in vars(ns).items() if k in names}
    kw.update(override)
    return cls(**kw)


# ---------------------------------------------------------------- files
def read_config_file(cls, path) -> dict:
    """A TOML file's values for `cls`, typed; unknown keys are refused with the valid ones.
    Tables are flattened (a `[data]` table's keys count as top-level keys)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file not found: {p}")
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"config file {p} is not valid TOML: {e}") from None
    flat: dict = {}
    for k, v in raw.items():
        if isinstance(v, dict):
            flat.update(v)
        else:
            flat[k] = v
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = {}
    for k, v in flat.items():
        key = k.replace("-", "_")
        if key not in fields:
            raise UserError(f"config file {p}: unknown setting {k!r}; valid: {sorted(fields)}")
        out[key] = convert(v, hints[key], f"config file {p}: {k}")  # a tuple: a list or "a,b"
    return out


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")
        return repr(v)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if v is None:
        return '""'  # no null in TOML: "" reads back as None for optional fields
    return json.dumps(str(v))


def config_toml(cfg, header: str = "") -> str:
    """A dataclass config as a flat TOML document that `read_config_file` reads back."""
    lines = [f"# {line}" for line in header.splitlines()]
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        hlp = f.metadata.get("help", "")
        lines.append(f"{f.name} = {_toml_value(v)}" + (f"  # {hlp}" if hlp else ""))
    return "\n".join(lines) + "\n"


def parse_with_config_file(build_parser, argv, cls_of_command: dict):
    """Parse `argv`; when the chosen command takes `--config FILE`, re-parse with the file's
    values as defaults, so flags on the command line override the file."""
    args = build_parser().parse_args(argv)
    path = getattr(args, "config", None)
    cls = cls_of_command.get(getattr(args, "command", None))
    if path and cls is not None:
        values = read_config_file(cls, path)
        args = build_parser({args.command: values}).parse_args(argv)
    return args
