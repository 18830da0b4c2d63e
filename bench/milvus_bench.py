"""Single-query latency of Milvus Lite vs FAISS Flat, and their top-k agreement.

  python bench/milvus_bench.py [--n 100000] [--queries 200] [--out bench/results/milvus]

Data: bench/ondisk_bench.py's synthetic gallery (N unit vectors, d = 128, 1000 classes,
neck W 32 × 128), in an index directory (exact FAISS Flat) exported to a Milvus Lite
collection (FLAT, metric IP) in a scratch folder.  Per strategy, each query is searched
once by each backend, interleaved query by query so the shared machine's load hits both;
FAISS (index.backends.search.Searcher) and numpy BLAS run on 1 thread, as a serving process does.
Milvus Lite answers from its own server process over gRPC, which the latency includes.
The ratio of the two totals is the figure to read.  Agreement: the share of queries whose
Milvus top-10 equals FAISS's, up to ties (equal scores).
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from common import timed
from ondisk_bench import STRATEGIES, K, draw, label, model

from core.atomic import write_json, write_text
from index.backends.milvus_store import MilvusGallery, export_index
from index.backends.search import Searcher
from index.backends.store import Items, read_index, write_index
from index.threads import serving_threads


def same_up_to_ties(a_rows, a_scores, b_rows, b_scores) -> bool:
    return bool(np.allclose(a_scores, b_scores, rtol=1e-5, atol=1e-5)
                and all(r1 == r2 or abs(s1 - s2) <= 1e-5 * max(1.0, abs(s1))
                        for r1, r2, s1, s2 in zip(a_rows, b_rows, a_scores, b_scores, strict=True)))


def run(n: int, n_queries: int, wd: Path) -> dict:
    from threadpoolctl import threadpool_limits

    centres, W = model()
    X = draw(centres, n, np.random.default_rng(1))
    Q = draw(centres, n_queries, np.random.default_rng(10**9))
    items = Items(np.arange(n, dtype=np.int64), np.zeros(n, np.int64), [f"{i}.jpg" for i in range(n)], ["g"] * n)
    idx = write_index(wd / "idx", X, items, W, normalize=True, info={}, factory="Flat")
    _, export_s = timed(lambda: export_index(idx, str(wd / "gallery.db"), "bench"))
    s = Searcher(read_index(idx))
    g = MilvusGallery(str(wd / "gallery.db"), "bench")
    serving_threads(1)
    blas = threadpool_limits(1, "blas")
    out = {"n": n, "d": X.shape[1], "queries": n_queries, "k": K, "export_s": export_s, "strategies": {}}
    for name, params, mode in STRATEGIES:
        qm = g.strategy_metric(name, params, mode)
        s.search(Q[:1], name, params, mode, K), g.search_metric(Q[:1], qm, K)  # warm: caches, first gRPC call
        t_f = t_m = 0.0
        agree = 0
        for q in Q[:, None]:
            t0 = time.perf_counter()
            f = s.search(q, name, params, mode, K)
            t1 = time.perf_counter()
            m = g.search_metric(q, qm, K)
            t_f, t_m = t_f + t1 - t0, t_m + time.perf_counter() - t1
            agree += same_up_to_ties(f.rows[0], f.scores[0], m.rows[0], m.scores[0])
        out["strategies"][label((name, params, mode))] = {
            "faiss_ms": t_f / n_queries * 1e3, "milvus_ms": t_m / n_queries * 1e3, "ratio": t_m / t_f,
            "topk_agreement": agree / n_queries}
    blas.restore_original_limits()
    g.close()
    return out


def markdown(r: dict) -> str:
    md = [f"N = {r['n']:,}, d = {r['d']}, {r['queries']} single queries, k = {r['k']}; FAISS Flat in RAM "
          f"(1 thread) vs Milvus Lite (FLAT, metric IP, embedded server over gRPC); export took "
          f"{r['export_s']:.0f} s.", "",
          "| strategy | FAISS Flat ms/query | Milvus Lite ms/query | ratio Milvus/FAISS | top-10 equal (up to ties) |",
          "|---|---|---|---|---|"]
    md += [f"| {lb} | {v['faiss_ms']:.2f} | {v['milvus_ms']:.2f} | {v['ratio']:.1f} | {v['topk_agreement']:.1%} |"
           for lb, v in r["strategies"].items()]
    return "\n".join(md) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100_000, help="gallery rows (default: %(default)s)")
    ap.add_argument("--queries", type=int, default=200, help="single queries per strategy (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/milvus", help="results folder (default: %(default)s)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="milvus_bench_") as wd:
        r = run(args.n, args.queries, Path(wd))
    write_json(Path(args.out) / "results.json", r)
    write_text(Path(args.out) / "results.md", markdown(r))
    print(markdown(r))


if __name__ == "__main__":
    main()
