"""Cost of each re-ranker (index/rerankers): online time per query as a ratio to one plain search
in the same run, and the offline part once per index.

  python bench/rerank_cost.py [--sizes 5750,100000] [--queries 200] [--reps 5] [--threads 1]
                              [--out bench/results/rerank]

Synthetic gallery: N trunk features, d = 128, drawn around N/30 class centres and L2-normalised
(an index's features are); a random neck W (64 × d); queries are fresh draws around the same
centres.  Searched under the trained M′ = WᵀW in cosine mode (the app's default).  Online:
`rerank(name, space, queries, k=10)` as a whole (its own first search included) against the
plain `space.search(queries, 10)` run just before it, rep by rep, so that the shared machine's
drift hits both alike; the median of the reps' ratios is reported (CPU time of the single thread
with --threads 1, which leaves out the time other jobs held the core; wall time otherwise).
Offline: each cached pass from an empty cache (neighbour lists, shared
by dba, kreciprocal and diffusion; row extremes and gallery k-reciprocal sets for kreciprocal;
the augmented gallery for dba).  Default parameters throughout.
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
from common import timed

D, K_EMB, PER_CLASS, K = 128, 64, 30, 10
TARGETS = {"aqe": 3.0, "kreciprocal": 3.0}  # at N = 10⁵


def synthetic(n: int, n_queries: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((max(1, n // PER_CLASS), D)).astype(np.float32)

    def draw(m):
        lab = rng.integers(0, len(centres), m)
        return (centres[lab] + 1.2 * rng.standard_normal((m, D)).astype(np.float32)), lab
    x, y = draw(n)
    q, _ = draw(n_queries)
    W = (rng.standard_normal((K_EMB, D)) / np.sqrt(D)).astype(np.float32)
    return x, y, q, W


def cpu_timed(fn) -> tuple[float, float]:
    """(wall, CPU) seconds: on a shared machine a single-threaded run's CPU time leaves out the
    time other jobs held the core."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def offline(space) -> dict[str, float]:
    """Each cached pass, in the order the re-rankers would first ask for it, from an empty cache."""
    from index.rerankers import reranker_params
    from index.rerankers.dba import augmented
    from index.rerankers.diffusion import whole_graph
    from index.rerankers.kreciprocal.cache import PAIR_SHARE, gallery_similarities
    from index.rerankers.kreciprocal.engine import support_index
    from index.rerankers.kreciprocal.sets import gallery_sets
    from index.rerankers.neighbours import neighbour_lists, row_extremes
    from index.space import memory_budget

    dp, kp, bp = (reranker_params(n) for n in ("diffusion", "kreciprocal", "dba"))
    out = {"neighbour lists": timed(lambda: neighbour_lists(space, max(dp.k + 1, kp.k1 + 2, bp.n + 2)))[1],
           "row extremes": timed(lambda: row_extremes(space))[1]}
    lists = neighbour_lists(space, kp.k1 + 2)
    if space.n * space.n * 4 <= memory_budget() // PAIR_SHARE:  # kept in RAM only where it fits (the sets read it)
        out["k-reciprocal pair similarities (RAM)"] = timed(lambda: gallery_similarities(space))[1]
    out["k-reciprocal gallery sets"] = timed(lambda: gallery_sets(space, lists, row_extremes(space), kp.k1))[1]
    sets = gallery_sets(space, lists, row_extremes(space), kp.k1)
    out["k-reciprocal inverted index"] = timed(lambda: support_index(space, lists, row_extremes(space), sets,
                                                                     kp.k1, kp.k2))[1]
    out["diffusion graph"] = timed(lambda: whole_graph(space, dp))[1]
    out["dba augmented gallery"] = timed(lambda: augmented(space, bp))[1]
    return out


def online(space, queries, names, reps: int) -> dict[str, dict[str, float]]:
    """Per query, median over reps: seconds of the plain search and of each re-ranker (wall and
    CPU), and each re-ranker's ratio to the plain search run just before it (so that the shared
    machine's drift hits both alike)."""
    from index.rerankers import rerank

    q = space.prepare(queries)
    for name in names:  # warm: lazily built in-memory parts (FAISS index over the augmented gallery)
        rerank(name, space, q[:2], K)

    import index.rerankers.kreciprocal.cache as kr_cache

    kr_cache.TERMS_SHARE = 1 << 62  # k-reciprocal keeps a call's terms for one that differs in λ: not a cost

    def fresh(name):
        return rerank(name, space, q, K)
    times = {name: [] for name in ["plain", *names]}
    ratios = {name: {"wall": [], "cpu": []} for name in names}
    for _ in range(reps):
        for name in names:
            base = cpu_timed(lambda: space.search(q, K))
            got = cpu_timed(lambda name=name: fresh(name))
            times["plain"].append(base)
            times[name].append(got)
            for i, clock in enumerate(("wall", "cpu")):
                ratios[name][clock].append(got[i] / base[i])
    out = {name: {c: float(np.median([t[i] for t in ts])) / len(q) for i, c in enumerate(("wall", "cpu"))}
           for name, ts in times.items()}
    for name in names:
        out[name] |= {f"ratio_{c}": float(np.median(ratios[name][c])) for c in ("wall", "cpu")}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="5750,100000")
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="FAISS and BLAS threads (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/rerank")
    args = ap.parse_args()

    import faiss
    from threadpoolctl import threadpool_limits

    from core.atomic import write_json, write_text
    from index.backends.search import Searcher
    from index.backends.store import in_memory_index
    from index.rerankers import RERANKERS, SearcherSpace

    faiss.omp_set_num_threads(args.threads)
    threadpool_limits(args.threads)
    names = [n for n in RERANKERS.names() if n != "none"]
    command = "python bench/rerank_cost.py " + shlex.join(sys.argv[1:])
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for n in (int(s) for s in args.sizes.split(",")):
            x, y, q, W = synthetic(n, args.queries)
            searcher = Searcher(in_memory_index(x, y, W))
            space = SearcherSpace(searcher, "trained", None, "cosine", cache_dir=Path(cache) / str(n))
            off = offline(space)
            on = online(space, q, names, args.reps)
            clock = "cpu" if args.threads == 1 else "wall"  # CPU time sums threads: wall time beyond one
            rows.append({"n": n, "clock": clock, "plain_ms": {c: on["plain"][c] * 1e3 for c in ("wall", "cpu")},
                         "online_ms": {m: {c: on[m][c] * 1e3 for c in ("wall", "cpu")} for m in names},
                         "ratio": {m: on[m][f"ratio_{clock}"] for m in names},
                         "ratio_wall": {m: on[m]["ratio_wall"] for m in names},
                         "offline_s": off})
            print(f"N = {n}: plain {on['plain'][clock] * 1e3:.3f} ms/query ({clock}); "
                  + ", ".join(f"{m} {rows[-1]['ratio'][m]:.2f}×" for m in names), flush=True)
    meta = {"command": command, "date": _dt.date.today().isoformat(), "threads": args.threads,
            "queries": args.queries, "reps": args.reps, "k": K, "dim": D, "strategy": "trained", "mode": "cosine",
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
            "numpy": np.__version__, "faiss": faiss.__version__,
            "params": {m: RERANKERS.get(m).param_defaults() for m in names}, "targets_at_1e5": TARGETS}
    out = Path(args.out)
    write_json(out / "cost.json", {"meta": meta, "rows": rows})
    write_text(out / "cost.md", table(meta, rows, names))
    print(table(meta, rows, names))


def table(meta: dict, rows: list[dict], names: list[str]) -> str:
    lines = [f"# Re-ranking cost ({meta['date']})", "",
             f"`{meta['command']}`; {meta['machine']}; {meta['threads']} thread(s); numpy {meta['numpy']}, "
             f"faiss {meta['faiss']}; d = {meta['dim']}, k = {meta['k']}, {meta['queries']} queries, median of "
             f"{meta['reps']} reps of (plain, re-ranker) pairs; strategy {meta['strategy']}, mode {meta['mode']}; "
             "default parameters.",
             "", "Online: time per query of `rerank(...)` (its first search included) ÷ the plain search run "
             f"just before it ({'CPU time of the single thread' if rows[0]['clock'] == 'cpu' else 'wall time'}; "
             "median of the reps' ratios; in brackets the median time per query; wall-time ratios in cost.json).",
             "",
             "| re-ranker | " + " | ".join(f"N = {r['n']:,}" for r in rows) + " | target at N = 10⁵ |",
             "|---|" + "---|" * len(rows) + "---|",
             "| plain search (ms/query) | " + " | ".join(f"{r['plain_ms'][r['clock']]:.3f}" for r in rows) + " | |"]
    for m in names:
        tgt = f"≤ {TARGETS[m]:g}×" if m in TARGETS else "—"
        lines.append(f"| {m} | " + " | ".join(f"{r['ratio'][m]:.2f}× ({r['online_ms'][m][r['clock']]:.2f} ms)"
                                              for r in rows) + f" | {tgt} |")
    lines += ["", "Offline, once per (index, strategy, params, mode), seconds:", "",
              "| pass | used by | " + " | ".join(f"N = {r['n']:,}" for r in rows) + " |",
              "|---|---|" + "---|" * len(rows)]
    users = {"neighbour lists": "dba, kreciprocal, diffusion", "row extremes": "kreciprocal",
             "k-reciprocal gallery sets": "kreciprocal", "dba augmented gallery": "dba",
             "k-reciprocal inverted index": "kreciprocal", "diffusion graph": "diffusion",
             "k-reciprocal pair similarities (RAM)": "kreciprocal, where N² ≤ 2²⁵"}
    passes = list(dict.fromkeys(p for r in rows for p in r["offline_s"]))
    for p in passes:
        lines.append(f"| {p} | {users.get(p, '')} | " + " | ".join(
            f"{r['offline_s'][p]:.1f}" if p in r["offline_s"] else "—" for r in rows) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
