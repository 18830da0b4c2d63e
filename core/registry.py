"""The one registry shape behind every user choice: backbones, data sets, losses,
regularizers and refinement strategies.

An entry is a name, a builder, a parameter dataclass, a one-line doc and the registry's
typed metadata (its `Spec`, e.g. a regularizer's default weight).  From the entries come
argparse `choices`, `--help` text that lists every name with its doc, typed `key=value`
parsing that refuses unknown keys with the valid ones, and the `list` subcommands' output.
A new choice is one module with `@REG.register(...)` plus one import line.  A name ending in
":" registers a family: "timm:" takes any "timm:NAME", and its builder gets `variant=NAME`.
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .errors import UserError
from .params import build_params, conforms, field_default, parse_items, shown


@dataclass
class NoParams:
    """For entries without parameters."""


@dataclass(frozen=True, kw_only=True)
class Spec:
    """What a registry records about each entry beyond its builder, parameters and doc.

    Each registry declares a subclass (a frozen, keyword-only dataclass) with typed fields;
    `register(name, Params, doc=..., field=value, ...)` fills it, and an unknown keyword, a
    missing required one or a value of the wrong type is an error when the module registering
    it is imported.  This base has no fields: a registry without metadata."""

    def check(self, entry: Entry) -> None:
        """Refuse metadata that does not fit the entry (called at registration).  The base
        checks every field's value against its annotation; a subclass adds its own rules."""
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not conforms(value, hints[f.name]):
                raise ValueError(f"{entry.what}: {f.name}={value!r} is not {_type_name(hints[f.name])}")

    def listing_lines(self) -> list[str]:
        """Lines the `list` subcommands show under the entry's doc line."""
        return []


def _type_name(t) -> str:
    return getattr(t, "__name__", None) or str(t).replace("typing.", "")


S = TypeVar("S", bound=Spec)


@dataclass(frozen=True)
class Entry(Generic[S]):
    name: str
    builder: Callable[..., Any]
    params: type
    doc: str
    spec: S
    kind: str  # the registry's, for messages

    @property
    def what(self) -> str:
        return f"{self.kind} {self.name!r}"

    @property
    def family(self) -> bool:
        """A family of names ("timm:" takes "timm:NAME"), not one name."""
        return self.name.endswith(":")

    @property
    def shown(self) -> str:
        """The name as a user writes it: "timm:NAME" for a family."""
        return f"{self.name}NAME" if self.family else self.name

    def param_defaults(self) -> dict:
        return {f.name: field_default(f) for f in dataclasses.fields(self.params)}

    def shown_defaults(self) -> dict:
        """The defaults as a user sees them (a named value as its word: pool = all)."""
        return {f.name: shown(f, field_default(f)) for f in dataclasses.fields(self.params)}

    def param_help(self) -> dict:
        return {f.name: f.metadata.get("help", "") for f in dataclasses.fields(self.params)}


def first_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return lines[0].strip() if lines else ""


class Registry(Generic[S]):
    """name → Entry(builder, params dataclass, doc, spec).  `spec`: the registry's metadata
    type, a `Spec` subclass (the base: no metadata)."""

    def __init__(self, kind: str, plural: str | None = None, *, spec: type[S]):
        dc = getattr(spec, "__dataclass_params__", None)
        if not (isinstance(spec, type) and issubclass(spec, Spec) and dc is not None and dc.frozen):
            raise TypeError(f"{kind} registry: spec must be a frozen dataclass derived from Spec, got {spec!r}")
        self.kind = kind
        self.plural = plural or kind + "s"
        self.spec_type = spec
        self._entries: dict[str, Entry[S]] = {}

    # ------------------------------------------------------------ registration
    def register(self, name: str, params: type = NoParams, doc: str | None = None, **spec):
        """Decorator: `@REG.register("name", Params, doc="...", **spec_fields)` over the builder.
        The keywords are the fields of the registry's spec type; any other is a TypeError, a
        value of the wrong type or a name registered already a ValueError."""
        what = f"{self.kind} {name!r}"
        if not dataclasses.is_dataclass(params):
            raise TypeError(f"{what}: params must be a dataclass")
        fields = {f.name: f for f in dataclasses.fields(self.spec_type) if f.init}
        unknown = sorted(set(spec) - set(fields))
        if unknown:
            raise TypeError(f"{what}: unknown keyword {', '.join(map(repr, unknown))} for "
                            f"{self.spec_type.__name__}; it takes {', '.join(fields) or 'none'}")
        missing = [n for n, f in fields.items() if n not in spec and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise TypeError(f"{what}: {self.spec_type.__name__} needs {', '.join(map(repr, missing))}")
        filled = self.spec_type(**spec)

        def deco(fn):
            if name in self._entries:
                first = self._entries[name].builder
                by = f"{getattr(first, '__module__', '?')}.{getattr(first, '__qualname__', first)}"
                raise ValueError(f"{what} is registered already (by {by}); choose another name")
            entry = Entry(name, fn, params, doc or first_line(fn.__doc__), filled, self.kind)
            filled.check(entry)
            self._entries[name] = entry
            return fn
        return deco

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    # ------------------------------------------------------------ lookup
    def names(self) -> list[str]:
        return sorted(self._entries)

    def entries(self) -> list[Entry[S]]:
        return [self._entries[n] for n in self.names()]

    def __contains__(self, name) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return iter(self.names())

    def get(self, name: str) -> Entry[S]:
        """The entry of `name`, or of its family ("timm:NAME" → "timm:")."""
        if name in self._entries and not name.endswith(":"):
            return self._entries[name]
        head, sep, variant = name.partition(":")
        if sep and variant.strip() and head + ":" in self._entries:
            return self._entries[head + ":"]
        if sep and head + ":" in self._entries:
            raise UserError(f"{self.kind} {name!r} names no member of the family; write {head}:NAME")
        shown = ", ".join(e.shown for e in self.entries())
        raise UserError(f"unknown {self.kind} {name!r}; choose from {shown}")

    def check_name(self, name: str) -> str:
        """`name` itself, once it names an entry or a member of a family."""
        self.get(name)
        return name

    __getitem__ = get

    # ------------------------------------------------------------ parameters
    def params(self, name: str, given: dict | Iterable[str] | None = None, *, ignore_unknown: bool = False):
        """The entry's typed parameters from a dict or `key=value` strings."""
        e = self.get(name)
        if given is not None and not isinstance(given, dict):
            given = parse_items(given, f"{self.kind} {name!r}")
        return build_params(e.params, given, f"{self.kind} {name!r}", ignore_unknown=ignore_unknown)

    def build(self, name: str, *args, **kwargs):
        e = self.get(name)
        if e.family:
            return e.builder(*args, variant=name.partition(":")[2].strip(), **kwargs)
        return e.builder(*args, **kwargs)

    # ------------------------------------------------------------ help
    def help_text(self) -> str:
        """'a: doc; b: doc' for argparse help (argparse folds the lines)."""
        return "; ".join(f"{e.shown}: {e.doc}" for e in self.entries())

    def params_help(self) -> str:
        """Every entry's parameter keys with their defaults, for --*-param help."""
        parts = []
        for e in self.entries():
            d = e.shown_defaults()
            if d:
                parts.append(f"{e.name}: " + ", ".join(f"{k}={v}" for k, v in d.items()))
        return "; ".join(parts) or "none take parameters"

    def describe(self) -> list[dict]:
        return [{"name": e.shown, "doc": e.doc,
                 "params": {k: {"default": v, "help": e.param_help()[k]} for k, v in e.shown_defaults().items()}}
                for e in self.entries()]

    def listing(self) -> str:
        """Human-readable listing for the `list` subcommands."""
        lines = [f"{self.plural}:"]
        for e in self.entries():
            lines.append(f"  {e.shown:<20} {e.doc}")
            lines += [f"      {line}" for line in e.spec.listing_lines()]
            helps, raw = e.param_help(), e.param_defaults()
            for k, v in e.shown_defaults().items():
                h = f"  {helps[k]}" if helps[k] else ""
                lines.append(f"      {k} = {v if v is not raw[k] else repr(v)}{h}")  # a named value: its word
        return "\n".join(lines)

    def add_argument(self, parser, flag: str, *, many: bool = False, default_help: str = "%(default)s", **kw):
        """An argparse option whose choices are this registry's names and whose help lists each
        name with its doc.  `many`: a comma-separated list of names.  `default_help`: how the
        default reads in --help (e.g. "the checkpoint's" where it is inherited)."""
        hlp = kw.pop("help", f"{self.kind} name")
        text = f"{hlp} (default: {default_help}). Choices: {self.help_text()}".replace("%", "%%")
        text = text.replace("%%(default)s", "%(default)s")
        if many:
            def check(value: str) -> tuple[str, ...]:
                names = tuple(v.strip() for v in value.split(",") if v.strip())
                for v in names:
                    self.get(v)
                return names
            return parser.add_argument(flag, type=_argtype(check), metavar="NAME,...", help=text, **kw)
        return parser.add_argument(flag, type=_argtype(self.check_name),
                                   metavar="{" + ",".join(e.shown for e in self.entries()) + "}", help=text, **kw)


def _argtype(fn, post=lambda v: v):
    """Turn a UserError into argparse's own error (one line, exit 2)."""
    import argparse

    def parse(value):
        try:
            return post(fn(value))
        except UserError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = "name"
    return parse
