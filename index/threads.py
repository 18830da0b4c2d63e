"""Thread settings for serving queries on a small machine.

A single query's M′q is a d × d mat-vec: far too small for BLAS threads, and
OpenBLAS's worker threads keep spinning after the call, stealing the core
FAISS is about to search on (measured: +5 ms on a 7.7 ms search at d = 1280,
N = 10⁴, 2 cores).  Serving processes therefore run numpy's BLAS on one
thread; FAISS (which bundles its own BLAS) keeps its own thread setting.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import faiss

_limit = None


def serving_threads(faiss_threads: int | None = None) -> None:
    global _limit
    from threadpoolctl import ThreadpoolController

    if _limit is None:
        _limit = ThreadpoolController().limit(limits=1, user_api="blas")  # kept for the process
    if faiss_threads:
        faiss.omp_set_num_threads(faiss_threads)


def in_threads(fn: Callable[[Any], Any], items: Iterable) -> list:
    """[fn(a) for a in items], in as many threads as FAISS has (the work units are independent,
    and numpy's sorts and set operations release the GIL), each with BLAS on one thread:
    threaded BLAS under threads oversubscribes the cores."""
    items = list(items)
    workers = min(len(items), max(1, faiss.omp_get_max_threads()))
    if workers > 1:
        from threadpoolctl import threadpool_limits

        with threadpool_limits(1, user_api="blas"), ThreadPoolExecutor(workers) as ex:
            return list(ex.map(fn, items))
    return [fn(a) for a in items]
