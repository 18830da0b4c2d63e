"""What a bounded candidate pool costs: MAP@R and time per query of k-reciprocal's `pool` and
diffusion's `truncation`, against the whole gallery (the papers' code), at the demo's size and at 10⁵.

  python bench/rerank_pool.py [--sizes demo,100000] [--queries 300] [--threads 1] [--out bench/results/rerank]

demo: the demo's trained-tail model (`python -m demo --no-ui` first), kanji test classes, trained
M′ in cosine mode, every item a query with itself left out (query = gallery), as
`index evaluate --rerankers` scores it.  A number N: synthetic clustered features (N items,
d = 128, classes of 30 on average, as bench/rerank_cost.py draws them) with their class labels,
and `--queries` gallery items as queries, each left out of its own ranking.

Per setting: MAP@R over the queries (the top R re-ranked, R = the query's class size − 1), and
the CPU time per query of `rerank(...)` (one thread; the offline passes done before, reported
apart) as a ratio to the plain search of the same queries in the same run (`space.search`, the
query left out), run just before it.
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

BATCH = 256  # queries per rerank call
SETTINGS = [("none", {}), ("kreciprocal", {"pool": 100}), ("kreciprocal", {"pool": 200}),
            ("kreciprocal", {"pool": 500}), ("kreciprocal", {}), ("diffusion", {"truncation": 100}),
            ("diffusion", {"truncation": 1000}), ("diffusion", {"truncation": 10000}), ("diffusion", {})]


def query_rows(y: np.ndarray, size: str, n_queries: int) -> tuple[np.ndarray, np.ndarray]:
    """(items per class, the query rows): every item with a class-mate on the demo, a seeded sample
    of `n_queries` of them on a synthetic gallery."""
    counts = np.bincount(y)
    valid = np.flatnonzero(counts[y] > 1)
    if size == "demo":
        return counts, valid
    return counts, np.sort(np.random.default_rng(0).choice(valid, min(n_queries, len(valid)), replace=False))


def demo_split():
    """The demo's test features, labels and neck."""
    from demo.pipeline import demo_tail_config
    from index.build import split_features

    cfg = demo_tail_config()
    f, y, W = split_features(Path(cfg.out) / "best.pt", cfg.data_config(), "test", cfg.cache_dir, progress=False)
    return np.asarray(f, dtype=np.float32), np.asarray(y), W


def synthetic_split(n: int):
    from rerank_cost import synthetic  # a sibling script: bench/ is first on sys.path

    x, y, _, W = synthetic(n, 1)
    return x, y, W


def label(name: str, params: dict, n: int) -> str:
    if name == "none":
        return "none (plain search)"
    v = next(iter(params.values()), None)
    what = "pool" if name == "kreciprocal" else "truncation"
    return f"{name} {what} = {'all' if v is None or v >= n else f'{v:,}'}"


def measure(space, q, ids, labels, name, params, k) -> dict:
    """MAP@R of the queries and the CPU seconds per query of re-ranking and of the plain search."""
    from evaluation.evaluator import per_query_metrics
    from index.rerankers import rerank

    R = np.bincount(labels)[labels[ids]] - 1
    rerank(name, space, q[:2], k, params=params, self_ids=ids[:2])  # the offline passes, before the clock
    plain = cpu = 0.0
    aps = []
    for a in range(0, len(q), BATCH):
        sl = slice(a, a + BATCH)
        c = time.process_time()
        space.search(q[sl], k, exclude=ids[sl])
        plain += time.process_time() - c
        c = time.process_time()
        h = rerank(name, space, q[sl], k, params=params, self_ids=ids[sl])
        cpu += time.process_time() - c
        nbr = np.where(h.rows >= 0, labels[np.maximum(h.rows, 0)], -1)
        aps.append(per_query_metrics(nbr, labels[ids[sl]], R[sl], ks=(1,))["map@r"])
    return {"map@r": float(np.mean(np.concatenate(aps))), "ms": cpu / len(q) * 1e3, "plain_ms": plain / len(q) * 1e3}


def offline(space, name: str, params: dict) -> float:
    """Wall seconds of the offline passes a setting needs beyond those measured before it."""
    from index.rerankers import rerank

    t = time.perf_counter()
    rerank(name, space, space.prepare(np.asarray(space.searcher.data.features[:1], dtype=np.float32)), 1,
           params=params, self_ids=np.array([0]))
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="demo,100000", help="demo and/or synthetic gallery sizes (default: %(default)s)")
    ap.add_argument("--queries", type=int, default=300,
                    help="queries of a synthetic gallery (the demo: every item) (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="FAISS and BLAS threads (default: %(default)s)")
    ap.add_argument("--only", default="", help="comma-separated re-rankers to run (default: all)")
    ap.add_argument("--out", default="bench/results/rerank", help="results folder (default: %(default)s)")
    args = ap.parse_args()

    import faiss
    from threadpoolctl import threadpool_limits

    from core.atomic import write_json, write_text
    from index.backends.search import Searcher
    from index.backends.store import in_memory_index
    from index.space import SearcherSpace

    faiss.omp_set_num_threads(args.threads)
    threadpool_limits(args.threads)
    only = {s for s in args.only.split(",") if s}
    out = Path(args.out)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for size in args.sizes.split(","):
            x, y, W = demo_split() if size == "demo" else synthetic_split(int(size))
            n = len(y)
            space = SearcherSpace(Searcher(in_memory_index(x, y, W)), "trained", None, "cosine",
                                  cache_dir=Path(cache) / size)
            counts, ids = query_rows(y, size, args.queries)
            q = space.prepare(x[ids])
            k = int(counts[y[ids]].max() - 1)
            what = "demo: kanji test classes, trained tail" if size == "demo" else "synthetic"
            for name, params in SETTINGS:
                if only and name not in only and name != "none":
                    continue
                if size == "demo" and params and next(iter(params.values())) >= n:
                    continue  # as the whole gallery
                off = offline(space, name, params)
                m = measure(space, q, ids, y, name, params, k)
                rows.append({"size": size, "n": n, "data": what, "queries": len(ids), "setting": label(name, params, n),
                             "reranker": name, "params": params, **m, "ratio": m["ms"] / m["plain_ms"],
                             "offline_s": off})
                print(f"{size}: {rows[-1]['setting']}: MAP@R {100 * m['map@r']:.2f}, {m['ms']:.2f} ms/query "
                      f"({rows[-1]['ratio']:.1f}× plain), offline {off:.1f} s", flush=True)
    meta = {"command": "python bench/rerank_pool.py " + shlex.join(sys.argv[1:]), "date": _dt.date.today().isoformat(),
            "threads": args.threads, "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    for r in rows:
        r["command"], r["date"] = meta["command"], meta["date"]
    if (out / "pool.json").is_file():  # rows of other sizes or settings measured before are kept
        import json

        done = {(r["size"], r["setting"]) for r in rows}
        old = [r for r in json.loads((out / "pool.json").read_text())["rows"] if (r["size"], r["setting"]) not in done]
        rows = sorted(old + rows, key=lambda r: (r["size"] != "demo", r["n"], setting_order(r)))
    write_json(out / "pool.json", {"meta": meta, "rows": rows})
    write_text(out / "pool.md", table(meta, rows))
    print(table(meta, rows))


def setting_order(row: dict) -> int:
    return next(i for i, (name, params) in enumerate(SETTINGS) if label(name, params, row["n"]) == row["setting"])


def table(meta: dict, rows: list[dict]) -> str:
    runs = list(dict.fromkeys((r["command"], r["date"]) for r in rows))
    lines = [f"# What a bounded candidate pool costs ({max(d for _, d in runs)})", "",
             f"{meta['machine']}; {meta['threads']} thread(s); trained M′, cosine mode; query = gallery item, left "
             "out of its own ranking. ms/query: CPU time of `rerank(...)`, offline passes excluded; × plain: against "
             "the plain search of the same queries in the same run. Runs: "
             + "; ".join(f"[{i + 1}] `{c}` ({d})" for i, (c, d) in enumerate(runs)) + ".", "",
             "| gallery | setting | MAP@R | ms/query | × plain | offline (s) | run |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        g = f"{r['data']} ({r['n']:,} items, {r['queries']:,} queries)"
        lines.append(f"| {g} | {r['setting']} | {100 * r['map@r']:.2f} | {r['ms']:.2f} | {r['ratio']:.1f}× | "
                     f"{r['offline_s']:.1f} | {runs.index((r['command'], r['date'])) + 1} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
