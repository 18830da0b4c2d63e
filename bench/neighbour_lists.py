"""The offline neighbour-list pass (index/rerankers/neighbours.py): an exact scan against an HNSW
index over Fᵀ key(x) (M′ = F Fᵀ), each list re-scored exactly, per gallery size: seconds of
each (CPU time of the single thread with --threads 1), their ratio, and the HNSW lists' recall
of the exact top L (the item itself included, as the lists hold it).

  python bench/neighbour_lists.py [--sizes 10000,25000,50000,100000] [--length 32] [--threads 1]
                                  [--out bench/results/neighbour_lists]

Synthetic gallery as bench/rerank_cost.py's: N features, d = 128, around N/30 class centres,
L2-normalised; a random neck W (64 × d); the trained M′ = WᵀW in cosine mode.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import numpy as np

D, K_EMB, PER_CLASS = 128, 64, 30


def synthetic(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(1, n // PER_CLASS), D)).astype(np.float32)
    lab = rng.integers(0, len(centres), n)
    x = centres[lab] + 1.2 * rng.standard_normal((n, D)).astype(np.float32)
    W = (rng.standard_normal((K_EMB, D)) / np.sqrt(D)).astype(np.float32)
    return x, lab, W


def clocked(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,25000,50000,100000")
    ap.add_argument("--length", type=int, default=32, help="list length L (the stored length of the defaults)")
    ap.add_argument("--threads", type=int, default=1, help="FAISS and BLAS threads (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/neighbour_lists")
    args = ap.parse_args()

    import faiss
    from threadpoolctl import threadpool_limits

    from core.atomic import write_json, write_text
    from index.backends.search import Searcher
    from index.backends.store import in_memory_index
    from index.rerankers.neighbours import HNSW, approximate_lists, exact_lists
    from index.space import SearcherSpace

    faiss.omp_set_num_threads(args.threads)
    threadpool_limits(args.threads)
    clock = 2 if args.threads == 1 else 1  # CPU time of the one thread; wall time beyond one
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        x, y, W = synthetic(n)
        space = SearcherSpace(Searcher(in_memory_index(x, y, W)), "trained", None, "cosine")
        space.keys  # noqa: B018  (in RAM first, as the offline passes read them)
        F = space.factor()
        approx = clocked(lambda: approximate_lists(space, F, args.length))
        exact = clocked(lambda: exact_lists(space, np.arange(n), args.length))
        a, e = approx[0]["rows"].astype(np.int64), exact[0]["rows"].astype(np.int64)
        found = (a[:, :, None] == e[:, None, :]).any(1).sum()
        rows.append({"n": n, "exact_s": exact[clock], "hnsw_s": approx[clock], "ratio": approx[clock] / exact[clock],
                     "recall": float(found / e.size),
                     "self_listed": float((a == np.arange(n)[:, None]).any(1).mean())})
        print(rows[-1], flush=True)
    meta = {"command": "python bench/neighbour_lists.py " + shlex.join(sys.argv[1:]),
            "date": _dt.date.today().isoformat(), "threads": args.threads, "length": args.length, "dim": D,
            "rank": K_EMB, "hnsw": HNSW, "clock": "cpu" if clock == 2 else "wall",
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
            "faiss": faiss.__version__}
    out = Path(args.out)
    write_json(out / "results.json", {"meta": meta, "rows": rows})
    lines = [f"# Neighbour lists: exact scan against HNSW ({meta['date']})", "",
             f"`{meta['command']}`; {meta['machine']}; {meta['threads']} thread(s), {meta['clock']} time; "
             f"faiss {meta['faiss']}; d = {D}, trained M′ of rank {K_EMB}, cosine; L = {args.length}; "
             f"HNSW {HNSW}.", "",
             "| N | exact s | HNSW s | HNSW ÷ exact | recall of the exact top L | item in its own list |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['n']:,} | {r['exact_s']:.1f} | {r['hnsw_s']:.1f} | {r['ratio']:.2f} | {r['recall']:.4f} | "
              f"{r['self_listed']:.4f} |" for r in rows]
    write_text(out / "results.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
