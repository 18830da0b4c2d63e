"""Flags shared by every command that runs a model or computes features: one name, one meaning,
one help text and one default everywhere (`training`, `index`, `app`)."""
from __future__ import annotations

import argparse
import re
from typing import Any

HELP = {
    "threads": "CPU threads for torch and FAISS; 0 = OMP_NUM_THREADS where set, else every core",
    "progress": "show progress bars",
    "cache_dir": "trunk-feature cache folder ('' = off)",
    "device": "where the model runs: auto (CUDA when available) | cpu | cuda | cuda:N",
    "json": "also write the result as JSON to this file",
    "cache_memory": "memory kept between searches for every metric space's state and what is computed from it, "
                    "together (gallery keys, neighbour lists, re-rankers' offline sets, comparisons; the app's "
                    "maps and pictures), least recently used dropped first: a size such as 512M or 4G",
}
CACHE_MEMORY_ENV = "DML_CACHE_MEMORY"  # the same budget for a process started without the flag
CACHE_MEMORY_DEFAULT = "4G"
# the flag name → its default (an int, a bool, a str or None: the flag's own type)
DEFAULTS: dict[str, Any] = {"threads": 0, "progress": True, "cache_dir": "cache/features", "device": "auto",
                            "json": None, "cache_memory": None}
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def add_shared_args(parser: argparse.ArgumentParser, *names: str, defaults: dict | None = None,
                    shown: dict | None = None) -> None:
    """Add the named shared flags (`threads`, `progress`, `cache_dir`, `device`, `json`, `cache_memory`).  A command
    may give one another default (`defaults`), and `shown` the text --help gives for a default
    the command resolves later (None until then)."""
    shown = {"cache_memory": f"${CACHE_MEMORY_ENV}, else {CACHE_MEMORY_DEFAULT}"} | (shown or {})
    for name in names:
        default = (defaults or {}).get(name, DEFAULTS[name])
        flag = "--" + name.replace("_", "-")
        text = HELP[name].replace("%", "%%") + (
            f" (default: {shown[name].replace('%', '%%')})" if name in shown else " (default: %(default)s)"
        )
        if name == "progress":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        elif name == "threads":
            parser.add_argument(flag, type=at_least(0, flag), default=default, help=text)
        elif name == "cache_memory":
            parser.add_argument(flag, type=size_arg(flag), default=default, metavar="SIZE", help=text)
        else:
            parser.add_argument(flag, default=default, metavar="FILE" if name == "json" else None, help=text)


def parse_size(text: str | int, what: str) -> int:
    """A byte count from `123`, `512M`, `4G`, `1.5G` (binary units; a trailing B or iB allowed)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"{what} must be ≥ 0, got {text}")
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), flags=re.IGNORECASE)
    if m is None:
        raise ValueError(f"{what} wants a size such as 512M or 4G, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def size_arg(flag: str):
    def parse(s: str) -> int:
        try:
            return parse_size(s, flag)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = "size"
    return parse


def at_least(lo: int, flag: str):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} wants an integer, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{flag} must be ≥ {lo}, got {v}")
        return v

    parse.__name__ = "integer"
    return parse


def apply_threads(n: int) -> None:
    """Scope the thread limit to the command that asked for it (called from the command, never
    from an import or a constructor)."""
    if n:
        import torch

        torch.set_num_threads(n)
        try:
            import faiss

            faiss.omp_set_num_threads(n)
        except ImportError:
            pass
        # numpy's BLAS too (the eigenvalue checks of `index evaluate`): left alone it spins up its
        # own threads on cores the command was told not to use
        from threadpoolctl import threadpool_limits

        threadpool_limits(n)
