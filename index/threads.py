"""Thread settings, made once per process (by the command at start-up) and once per worker
thread, never swapped around a call: the settings are shared, and a call that saved and
restored one would restore the wrong value whenever two calls overlap (two app requests).

What each library's setting reaches:
- numpy's BLAS (OpenBLAS): one count for the whole process, whichever thread sets it.
- FAISS's OpenMP: a count per thread; a thread that never set one runs OMP_NUM_THREADS, else
  every core.  FAISS's bundled BLAS follows its OpenMP count, and setting that BLAS's count
  (threadpoolctl) sets the calling thread's OpenMP count with it.
- torch: one count for the process.

Serving (`serving_threads`): a single query's M′q is a d × d mat-vec, far too small for BLAS
threads, and OpenBLAS's worker threads keep spinning after the call, stealing the core FAISS
is about to search on (measured: +5 ms on a 7.7 ms search at d = 1280, N = 10⁴, 2 cores), so
numpy's BLAS runs on one thread; FAISS keeps its own thread setting.

Batch commands (`batch_threads`): every core by default, for torch, FAISS and the pool of
`in_threads`.  Where re-rankers run, numpy's BLAS stays on one thread: their batches run in the
pool, one core each, and threaded BLAS inside threads oversubscribes the cores.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import faiss

_serving_limit = None  # kept for the process: a limit object restores its setting when collected
# the process's worker pools, one per size: threads, not computed values; each made once under
# the lock and never replaced
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
_serving_faiss: int | None = None  # the serving process's FAISS count, for every request thread
_thread = threading.local()


def cores() -> int:
    """The cores this process may run on (taskset, cgroup cpusets), else the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def serving_threads(faiss_threads: int | None = None) -> None:
    """numpy's BLAS on one thread for the process; FAISS's OpenMP in the calling thread on
    `faiss_threads`, else left as it was."""
    global _serving_limit, _serving_faiss
    from threadpoolctl import ThreadpoolController

    before = faiss.omp_get_max_threads()
    _serving_faiss = faiss_threads or before
    if _serving_limit is None:
        _serving_limit = ThreadpoolController().limit(limits=1, user_api="blas")
    # limiting FAISS's bundled BLAS set this thread's OpenMP count to 1 with it: FAISS's own
    # searches and the pool of `in_threads` (sized from that count) would run on one core
    faiss.omp_set_num_threads(faiss_threads or before)


def batch_threads(n: int = 0, *, one_blas_thread: bool = True, torch: bool = True) -> int:
    """A batch command's thread settings, once at its start-up: `n` threads for FAISS (this
    thread's OpenMP, and so the pool of `in_threads`), torch (`torch`: a command that runs a
    model) and numpy's BLAS, or numpy's BLAS on one thread (`one_blas_thread`: where re-rankers'
    batches or single queries run).  `n` = 0: OMP_NUM_THREADS where set (a launcher's or the
    user's choice, e.g. torchrun's one thread per rank), else every core this process may use.
    Returns the thread count."""
    from threadpoolctl import ThreadpoolController

    n = n or env_threads() or cores()
    blas = 1 if one_blas_thread else n
    for lib in ThreadpoolController().select(user_api="blas").lib_controllers:
        # FAISS's bundled BLAS follows FAISS's OpenMP count, set below; a count of 1 here would
        # leave FAISS's batched searches on one core
        lib.set_num_threads(n if _is_faiss(lib.filepath) else blas)
    faiss.omp_set_num_threads(n)  # after the BLAS calls, which set it as a side effect
    if torch:
        import torch as th

        th.set_num_threads(n)
    return n


def env_threads() -> int | None:
    """OMP_NUM_THREADS as a thread count (its first level where a list), None where unset or not one."""
    text = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def _is_faiss(path: str | None) -> bool:
    return path is not None and "faiss" in os.path.basename(os.path.dirname(path)).lower()


def request_threads() -> None:
    """In a serving process, this thread's FAISS count set to the process's, once per thread:
    OpenMP's count is per thread, and a server's request threads never saw the call its main
    thread made at start-up (without it they run OMP_NUM_THREADS, else every core)."""
    if _serving_faiss is not None and getattr(_thread, "faiss", None) != _serving_faiss:
        faiss.omp_set_num_threads(_serving_faiss)
        _thread.faiss = _serving_faiss


def in_threads(fn: Callable[[Any], Any], items: Iterable) -> list:
    """[fn(a) for a in items], in as many threads as FAISS has in the calling thread (the work
    units are independent, and numpy's sorts and set operations release the GIL).  The threads
    are a pool kept for the process, each running FAISS on one thread (set once, when it
    starts): FAISS's threads inside the pool's threads would oversubscribe the cores, and a call
    from inside the pool runs in its caller.  numpy's BLAS is the process's setting, made once
    by the command (`serving_threads`, `batch_threads`): one thread there."""
    items = list(items)
    workers = max(1, faiss.omp_get_max_threads())
    if workers > 1 and len(items) > 1:
        return list(_pool(workers).map(fn, items))
    return [fn(a) for a in items]


def _pool(size: int) -> ThreadPoolExecutor:
    """The pool of `size` threads (started as work comes, up to `size`), made once."""
    with _pools_lock:
        pool = _pools.get(size)
        if pool is None:
            pool = _pools[size] = ThreadPoolExecutor(size, thread_name_prefix="index-batch",
                                                     initializer=faiss.omp_set_num_threads, initargs=(1,))
        return pool
