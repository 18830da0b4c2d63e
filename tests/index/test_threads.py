"""Thread settings (index/threads.py): made once per process and once per worker thread, never
swapped around a call, so that overlapping calls (two app requests) leave them as they were; a
batch command's default is every core."""
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import faiss
import pytest
from threadpoolctl import ThreadpoolController, threadpool_info

from index.threads import cores, in_threads

ROOT = Path(__file__).resolve().parents[2]


def blas_threads() -> list[tuple[str, int]]:
    """The process-wide BLAS thread counts (an OpenMP build of OpenBLAS, as FAISS bundles, reports
    the calling thread's OpenMP count instead)."""
    return sorted((i["filepath"], i["num_threads"]) for i in threadpool_info()
                  if i["user_api"] == "blas" and i.get("threading_layer") != "openmp")


def test_overlapping_calls_leave_the_process_blas_setting_as_it_was():
    """Six threads started together (the main thread one of them), each making overlapping
    `in_threads` calls with FAISS on two threads (so each call runs in the pool): the process's
    BLAS setting stays the one it had, during the calls and after them, the calling threads' own
    FAISS setting too, and every call returns its items' results in order."""
    main_omp = faiss.omp_get_max_threads()
    libs = ThreadpoolController().select(user_api="blas").lib_controllers
    saved = [lib.get_num_threads() for lib in libs]
    for lib in libs:  # a process setting a per-call limit of 1 would change
        lib.set_num_threads(2)
    try:
        before = blas_threads()
        assert before and {n for _, n in before} == {2}
        start = threading.Barrier(6)
        out: dict[int, list] = {}
        during: list = []
        omp_after: dict[int, int] = {}

        def caller(c: int):
            rng = random.Random(c)
            start.wait()
            got = []
            def square(a: int) -> int:
                during.append(blas_threads())
                time.sleep(rng.random() * 0.005)
                return a * a

            for _ in range(4):
                faiss.omp_set_num_threads(2)  # this thread's setting only
                got.append(in_threads(square, range(c, c + 4)))
                omp_after[c] = faiss.omp_get_max_threads()
            out[c] = got

        ts = [threading.Thread(target=caller, args=(c,)) for c in range(1, 6)]
        for t in ts:
            t.start()
        caller(0)
        for t in ts:
            t.join()
        assert len(during) == 6 * 4 * 4 and all(seen == before for seen in during)
        assert blas_threads() == before
    finally:
        for lib, n in zip(libs, saved, strict=True):
            lib.set_num_threads(n)
        faiss.omp_set_num_threads(main_omp)
    assert omp_after == {c: 2 for c in range(6)}
    assert out == {c: [[a * a for a in range(c, c + 4)]] * 4 for c in range(6)}


def test_pool_threads_run_faiss_on_one_thread_and_nested_calls_in_place():
    """The pool's threads run FAISS on one thread (set when each starts): a call made from inside
    the pool runs in the thread that made it, never waiting on the pool it runs in."""
    seen: dict = {}

    def run():
        faiss.omp_set_num_threads(2)
        me = threading.get_ident()

        def inner(b):
            return threading.get_ident()

        def outer(a):
            return faiss.omp_get_max_threads(), threading.get_ident(), in_threads(inner, range(3))

        seen["out"], seen["me"] = in_threads(outer, range(6)), me

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert [omp for omp, _, _ in seen["out"]] == [1] * 6
    assert all(worker != seen["me"] for _, worker, _ in seen["out"])  # ran in the pool
    assert all(nested == [worker] * 3 for _, worker, nested in seen["out"])  # ran in the worker itself


def test_a_single_item_or_one_faiss_thread_runs_in_the_calling_thread():
    me = threading.get_ident()
    before = faiss.omp_get_max_threads()
    try:
        faiss.omp_set_num_threads(1)
        assert in_threads(lambda a: threading.get_ident(), range(4)) == [me] * 4
        faiss.omp_set_num_threads(2)
        assert in_threads(lambda a: threading.get_ident(), [0]) == [me]
    finally:
        faiss.omp_set_num_threads(before)


PROBE = """
import json, faiss
from threadpoolctl import threadpool_info
from index.threads import {fn}
{fn}({args})
print(json.dumps({{"faiss": faiss.omp_get_max_threads(), "blas": {{i["filepath"]: i["num_threads"]
      for i in threadpool_info() if i["user_api"] == "blas"}}}}))
"""


def probe(fn: str, args: str, env: dict) -> dict:
    """The thread settings a fresh process has after `fn(args)` (settings are process-wide: a
    test process keeps its own)."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    r = subprocess.run([sys.executable, "-c", PROBE.format(fn=fn, args=args)], cwd=ROOT, env=base | env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.skipif(cores() < 2, reason="every core is one core here")
def test_a_batch_command_runs_faiss_on_every_core_by_default_and_numpy_blas_on_one():
    """`batch_threads(0)`: FAISS (and its bundled BLAS, which its batched searches use) on every
    core this process may use, numpy's BLAS on one thread where re-rankers run; OMP_NUM_THREADS,
    where set, is the count instead."""
    got = probe("batch_threads", "0, torch=False", {})
    assert got["faiss"] == cores()
    assert {("faiss" in path, n) for path, n in got["blas"].items()} <= {(True, cores()), (False, 1)}
    assert any("faiss" not in path for path in got["blas"])  # numpy's own BLAS was seen and set
    assert probe("batch_threads", "0, torch=False", {"OMP_NUM_THREADS": "1"})["faiss"] == 1
    plain = probe("batch_threads", "0, one_blas_thread=False, torch=False", {})["blas"]
    assert set(plain.values()) == {cores()}


@pytest.mark.skipif(cores() < 2, reason="every core is one core here")
def test_serving_keeps_faiss_threads_when_it_puts_blas_on_one_thread():
    """Setting OpenBLAS's count also sets the calling thread's OpenMP count (FAISS's bundled BLAS
    is an OpenMP build): serving's BLAS limit leaves FAISS's own setting as it was."""
    got = probe("serving_threads", "None", {})
    assert got["faiss"] == cores()
    assert any(n == 1 for path, n in got["blas"].items() if "faiss" not in path)


def test_a_serving_process_gives_each_request_thread_its_faiss_setting(monkeypatch):
    """OpenMP's count is per thread: a server's request threads never saw the start-up call, so
    each search sets its thread's FAISS count to the serving process's, once."""
    import faiss

    from index import threads

    def in_a_new_thread() -> int:
        seen = []

        def request():
            faiss.omp_set_num_threads(1)  # what a fresh request thread may run with
            threads.request_threads()
            seen.append(faiss.omp_get_max_threads())
        t = threading.Thread(target=request)
        t.start()
        t.join()
        return seen[0]
    monkeypatch.setattr(threads, "_serving_faiss", 3)
    assert in_a_new_thread() == 3
    monkeypatch.setattr(threads, "_serving_faiss", None)  # a batch command: nothing is changed
    assert in_a_new_thread() == 1
