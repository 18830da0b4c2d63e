"""What the bench scripts share: the mean ± std of a table cell, timing a call, a free port,
writing a results table.

A script run as `python bench/NAME.py` has bench/ first on sys.path, so it imports this module as
`from common import …`; it imports the product as installed (`pip install -e .`, which `make test`
and `make demo` set up).
"""
from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]  # the checkout: the default paths of runs, caches and results


def pm(values, scale: float = 100.0, digits: int = 2) -> str:
    """'mean ± std' of `values` × `scale` (population std, over seeds): every table's spread; '—' for none."""
    v = np.asarray(values, dtype=float) * scale
    return "—" if not v.size else f"{v.mean():.{digits}f} ± {v.std():.{digits}f}"


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn(), its wall seconds)."""
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    """Median ms of `repeat` calls, after one call to warm."""
    fn()
    return 1e3 * statistics.median(timed(fn)[1] for _ in range(repeat))


def interleaved_ms(fns: dict, repeat: int) -> dict:
    """Median ms of each callable, called in turn `repeat` times (the same noise for each), after one warm call."""
    for f in fns.values():
        f()
    times: dict = {k: [] for k in fns}
    for _ in range(repeat):
        for k, f in fns.items():
            times[k].append(timed(f)[1])
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_table(path: Path, md: str) -> None:
    """A results table: written (atomically) and printed."""
    from core.atomic import write_text

    write_text(path, md)
    print(md)
