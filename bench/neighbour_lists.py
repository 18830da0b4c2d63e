"""The offline passes of index/rerankers/neighbours.py, exact scans against one HNSW index over
Fᵀ key(x) (M′ = F Fᵀ), every score re-computed exactly, per gallery size: the neighbour lists
(the exact scan; the HNSW build, then its search) and the row extremes (the exact scan; a search
of the same index for −Fᵀ key(x), with the antipodes: the exact least similar items of a drawn
sample).  Seconds of each (CPU time of the single thread with
--threads 1), the HNSW lists' recall of the exact top L (the item itself included, as the lists
hold it), and how often the HNSW extremes find the exact least similar item.

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
import tempfile
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

    import index.rerankers.neighbours as nb
    from core.atomic import write_json, write_text
    from index.backends.search import Searcher
    from index.backends.store import in_memory_index
    from index.rerankers.neighbours import HNSW, approximate_extremes, approximate_lists, hnsw_index, searched_lists
    from index.space import SearcherSpace

    faiss.omp_set_num_threads(args.threads)
    threadpool_limits(args.threads)
    clock = 2 if args.threads == 1 else 1  # CPU time of the one thread; wall time beyond one
    rows = []
    # fresh offline stores, removed after: the seeded gallery's exact extremes from an earlier run are not timed
    stores = tempfile.TemporaryDirectory(prefix="neighbour-lists-")
    for n in (int(s) for s in args.sizes.split(",")):
        x, y, W = synthetic(n)
        space = SearcherSpace(Searcher(in_memory_index(x, y, W)), "trained", None, "cosine",
                              cache_dir=Path(stores.name) / str(n))
        space.keys  # noqa: B018  (in RAM first, as the offline passes read them)
        F = space.factor()
        index = clocked(lambda: hnsw_index(space, F))
        approx = clocked(lambda: approximate_lists(space, F, args.length, index[0]))
        ext_a = clocked(lambda: approximate_extremes(space, F, index[0]))
        exact = clocked(lambda: searched_lists(space, np.arange(n), args.length))
        saved, nb.APPROXIMATE_ABOVE = nb.APPROXIMATE_ABOVE, 10**12  # row_extremes' exact scan at any size
        ext_e = clocked(lambda: nb.row_extremes(space))
        nb.APPROXIMATE_ABOVE = saved
        a, e = approx[0]["rows"].astype(np.int64), exact[0]["rows"].astype(np.int64)
        found = (a[:, :, None] == e[:, None, :]).any(1).sum()
        hnsw_s = index[clock] + approx[clock]
        rows.append({"n": n, "exact_s": exact[clock], "hnsw_build_s": index[clock], "hnsw_s": hnsw_s,
                     "ratio": hnsw_s / exact[clock], "recall": float(found / e.size),
                     "self_listed": float((a == np.arange(n)[:, None]).any(1).mean()),
                     "extremes_exact_s": ext_e[clock], "extremes_hnsw_s": ext_a[clock],
                     "extremes_arg1_share": float((ext_a[0]["arg1"] == ext_e[0]["arg1"]).mean())})
        print(rows[-1], flush=True)
    stores.cleanup()
    meta = {"command": "python bench/neighbour_lists.py " + shlex.join(sys.argv[1:]),
            "date": _dt.date.today().isoformat(), "threads": args.threads, "length": args.length, "dim": D,
            "rank": K_EMB, "hnsw": HNSW, "clock": "cpu" if clock == 2 else "wall",
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
            "faiss": faiss.__version__}
    out = Path(args.out)
    write_json(out / "results.json", {"meta": meta, "rows": rows})
    lines = [f"# Neighbour lists and row extremes: exact scans against HNSW ({meta['date']})", "",
             f"`{meta['command']}`; {meta['machine']}; {meta['threads']} thread(s), {meta['clock']} time; "
             f"faiss {meta['faiss']}; d = {D}, trained M′ of rank {K_EMB}, cosine; L = {args.length}; "
             f"HNSW {HNSW}.", "",
             "| N | lists: exact s | HNSW s (build + search) | HNSW ÷ exact | recall of the exact top L | "
             "item in its own list | extremes: exact s | HNSW search + antipodes s | least similar item found |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['n']:,} | {r['exact_s']:.1f} | {r['hnsw_s']:.1f} ({r['hnsw_build_s']:.1f} + "
              f"{r['hnsw_s'] - r['hnsw_build_s']:.1f}) | {r['ratio']:.2f} | {r['recall']:.4f} | "
              f"{r['self_listed']:.4f} | {r['extremes_exact_s']:.1f} | {r['extremes_hnsw_s']:.1f} | "
              f"{r['extremes_arg1_share']:.4f} |" for r in rows]
    write_text(out / "results.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
