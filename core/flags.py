"""Flags shared by every command that runs a model or computes features: one name, one meaning,
one help text and one default everywhere (`training`, `index`, `app`)."""
from __future__ import annotations

import argparse
from typing import Any

HELP = {
    "threads": "CPU threads for torch and FAISS; 0 = the libraries' own setting",
    "progress": "show progress bars",
    "cache_dir": "trunk-feature cache folder ('' = off)",
    "device": "where the model runs: auto (CUDA when available) | cpu | cuda | cuda:N",
    "json": "also write the result as JSON to this file",
}
# the flag name → its default (an int, a bool, a str or None: the flag's own type)
DEFAULTS: dict[str, Any] = {"threads": 0, "progress": True, "cache_dir": "cache/features", "device": "auto",
                            "json": None}


def add_shared_args(parser: argparse.ArgumentParser, *names: str, defaults: dict | None = None,
                    shown: dict | None = None) -> None:
    """Add the named shared flags (`threads`, `progress`, `cache_dir`, `device`, `json`).  A command
    may give one another default (`defaults`), and `shown` the text --help gives for a default
    the command resolves later (None until then)."""
    shown = shown or {}
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
        else:
            parser.add_argument(flag, default=default, metavar="FILE" if name == "json" else None, help=text)


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
