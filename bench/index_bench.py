"""Search performance: search under refined metrics vs raw FAISS, and indexing throughput.

  python bench/index_bench.py [--sizes 10000,100000,1000000] [--dims 128,1280] [--out bench/results/index]

1. Search.  Synthetic unit trunk features (N × d) and a trained-like M* = WᵀW
   (k = 128, or d/2 when d = 128).  For each strategy (bilinear mode) we time
   our `Searcher` against a bare `faiss.IndexFlatIP` over the same vectors,
   single queries (FAISS on 1 thread: fastest for one query on 2 cores) and a
   batch of 256 queries (2 threads), and report the ratio ours / raw from the
   same run.  scikit-learn's brute-force `NearestNeighbors` is the naive
   alternative (same ranking as identity on unit vectors).
2. Indexing throughput (images/s) of `build_from_dataset` (no feature cache)
   vs a bare loop: DataLoader with the same transform → backbone forward.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import faiss
import numpy as np
from common import ROOT, write_table

from core.atomic import write_json
from index.backends.search import Searcher
from index.backends.store import IndexData, Items, make_faiss_index

STRATEGIES = [("trained", {}), ("identity", {}), ("diagonal", {"r": 0.5, "seed": 0}),
              ("random", {"r": 0.5, "seed": 0}), ("shrink", {"alpha": 0.5}), ("spectral", {"p": 0.5})]


def search_bench(N: int, d: int, n_single: int, batch: int, sklearn_max: int, reps: int = 5) -> list[dict]:
    rng = np.random.default_rng(0)
    X = rng.standard_normal((N, d), dtype=np.float32)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    k_emb = 128 if d > 256 else d // 2
    W = rng.standard_normal((k_emb, d)).astype(np.float32) / np.sqrt(d)
    Q = rng.standard_normal((max(n_single, batch), d), dtype=np.float32)
    Q /= np.linalg.norm(Q, axis=1, keepdims=True)
    raw = faiss.IndexFlatIP(d)
    raw.add(X)
    man = {"normalize": True, "factory": "Flat", "count": N, "trunk_dim": d, "embed_dim": k_emb}
    data = IndexData(None, man, X, Items(np.arange(N), np.zeros(N, np.int64), [""] * N, [""] * N), W, raw)
    s = Searcher(data)
    rows = []
    k = 10
    from threadpoolctl import ThreadpoolController

    ctl = ThreadpoolController()
    for threads, label, nq in ((1, "single query", n_single), (2, f"batch of {batch}", batch)):
        faiss.omp_set_num_threads(threads)
        # numpy BLAS on 1 thread, as `index search` and the app serve (index/threads.py): its
        # spinning workers would otherwise compete with FAISS's threads for the 2 cores
        blas = ctl.limit(limits=1, user_api="blas")
        if nq == n_single:
            def raw_fn():
                for i in range(nq):
                    raw.search(Q[i: i + 1], k)
        else:
            def raw_fn():
                raw.search(Q[:nq], k)
        for name, params in STRATEGIES:
            s.metric(name, params)  # refine once; the per-query cost is what we time
            if nq == n_single:
                def ours_fn():
                    for i in range(nq):
                        s.search(Q[i: i + 1], name, params, "bilinear", k)
            else:
                def ours_fn():
                    s.search(Q[:nq], name, params, "bilinear", k)
            raw_fn(), ours_fn()  # warm-up
            tr, to = [], []
            for _ in range(reps):  # interleaved, so background load hits both alike
                t = time.perf_counter()
                raw_fn()
                tr.append(time.perf_counter() - t)
                t = time.perf_counter()
                ours_fn()
                to.append(time.perf_counter() - t)
            raw_t, ours = float(np.median(tr)) / nq, float(np.median(to)) / nq
            rows.append({"N": N, "d": d, "queries": label, "strategy": name, "raw_ms": raw_t * 1e3,
                         "ours_ms": ours * 1e3, "ratio": ours / raw_t, "operator": s.metric(name, params).op.kind})
        if N <= sklearn_max:
            from sklearn.neighbors import NearestNeighbors

            nn = NearestNeighbors(n_neighbors=k, algorithm="brute", metric="euclidean", n_jobs=threads).fit(X)
            if nq == n_single:
                def sk_fn():
                    for i in range(nq):
                        nn.kneighbors(Q[i: i + 1])
            else:
                def sk_fn():
                    nn.kneighbors(Q[:nq])
            t = time.perf_counter()
            raw_fn()
            r1 = time.perf_counter() - t
            t = time.perf_counter()
            sk_fn()
            sk = time.perf_counter() - t
            rows.append({"N": N, "d": d, "queries": label, "strategy": "sklearn brute (identity)",
                         "raw_ms": r1 / nq * 1e3, "ours_ms": sk / nq * 1e3, "ratio": sk / r1, "operator": "-"})
        blas.restore_original_limits()
    return rows


def ann_recall_bench(N: int = 100_000, d: int = 128, nq: int = 200, k: int = 10) -> list[dict]:
    """Recall@k of approximate indexes (candidates + exact re-rank under M′) against exact Flat."""
    rng = np.random.default_rng(1)
    # clustered data (like real embeddings), unit norm
    centers = rng.standard_normal((1000, d)).astype(np.float32)
    X = centers[rng.integers(0, 1000, N)] + 0.5 * rng.standard_normal((N, d), dtype=np.float32)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    Q = X[rng.choice(N, nq, replace=False)] + 0.05 * rng.standard_normal((nq, d), dtype=np.float32)
    W = rng.standard_normal((d // 2, d)).astype(np.float32) / np.sqrt(d)
    man = {"normalize": True, "count": N, "trunk_dim": d, "embed_dim": d // 2}
    items = Items(np.arange(N), np.zeros(N, np.int64), [""] * N, [""] * N)
    exact = Searcher(IndexData(None, man | {"factory": "Flat"}, X, items, W, make_faiss_index(X, "Flat")))
    rows = []
    faiss.omp_set_num_threads(2)
    for factory in ("HNSW32", "IVF1024,Flat"):
        t = time.perf_counter()
        ann_index = make_faiss_index(X, factory)
        if hasattr(ann_index, "nprobe"):
            ann_index.nprobe = 32
        build_s = time.perf_counter() - t
        ann = Searcher(IndexData(None, man | {"factory": factory}, X, items, W, ann_index))
        for name, params, mode in (("trained", {}, "bilinear"), ("identity", {}, "bilinear"),
                                   ("diagonal", {"r": 0.5, "seed": 0}, "bilinear"),
                                   ("shrink", {"alpha": 0.5}, "cosine"),
                                   ("trained", {}, "cosine")):
            ref = exact.search(Q, name, params, mode, k).rows
            t = time.perf_counter()
            got = ann.search(Q, name, params, mode, k).rows
            ann_ms = (time.perf_counter() - t) / nq * 1e3
            t = time.perf_counter()
            exact.search(Q, name, params, mode, k)
            exact_ms = (time.perf_counter() - t) / nq * 1e3
            recall = float(np.mean([len(set(a) & set(b)) / k for a, b in zip(got, ref, strict=True)]))
            rows.append({"factory": factory, "N": N, "d": d, "strategy": name, "mode": mode,
                         f"recall@{k}": recall, "ann_ms": ann_ms, "exact_ms": exact_ms, "build_s": build_s})
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


def indexing_bench(images: int) -> dict:
    import torch

    from data import DataConfig, load_data
    from data.loader import make_loader
    from index.build import build_from_dataset
    from model.checkpoint import load_model
    from model.preprocess import transform_for

    ck = ROOT / "runs" / "demo-proxy_anchor" / "best.pt"
    if not ck.is_file():
        return {"skipped": "run `make demo DEMO_ARGS=--no-ui` first (needs the demo checkpoint)"}
    dcfg = DataConfig(eval_batch_size=128, workers=1)
    splits = load_data(dcfg, progress=False)
    sub = splits.test
    model, _ = load_model(ck)
    bb = model.backbone.eval()
    spec = transform_for(bb, dcfg)
    torch.set_num_threads(2)

    def bare():
        loader = make_loader(sub, spec.build(), batch_size=128, workers=1)
        n = 0
        with torch.inference_mode():
            for x, _, _, _ in loader:
                bb(x)
                n += len(x)
        return n

    t = time.perf_counter()
    n = bare()
    t_bare = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        build_from_dataset(ck, dcfg, Path(tmp) / "idx", split="test", cache_dir=None, progress=False)
        t_ours = time.perf_counter() - t
    return {"images": n, "bare_img_per_s": n / t_bare, "ours_img_per_s": n / t_ours,
            "ratio": (n / t_ours) / (n / t_bare), "threads": 2, "workers": 1, "batch": 128}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--dims", default="128,1280")
    ap.add_argument("--single", type=int, default=50, help="single queries timed per setting")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--sklearn-max", type=int, default=100000, help="largest N to time sklearn on")
    ap.add_argument("--out", default="bench/results/index")
    ap.add_argument("--skip-indexing", action="store_true")
    ap.add_argument("--skip-ann", action="store_true")
    ap.add_argument("--reps", type=int, default=5, help="interleaved timing repetitions per setting")
    args = ap.parse_args()
    rows = []
    for d in [int(x) for x in args.dims.split(",")]:
        for N in [int(x) for x in args.sizes.split(",")]:
            print(f"search N={N} d={d} ...", file=sys.stderr, flush=True)
            rows += search_bench(N, d, args.single, args.batch, args.sklearn_max, args.reps)
            write_json(Path(args.out) / "partial.json", rows)  # keep what is done if interrupted
    idx = {"skipped": "--skip-indexing"} if args.skip_indexing else indexing_bench(0)
    ann = [] if args.skip_ann else ann_recall_bench()
    out = Path(args.out)
    write_json(out / "results.json", {"search": rows, "indexing": idx, "ann": ann})
    lines = ["| N | d | queries | strategy | M′q operator | raw FAISS ms/query | ours ms/query | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['N']:,} | {r['d']} | {r['queries']} | {r['strategy']} | {r['operator']} | "
                     f"{r['raw_ms']:.3f} | {r['ours_ms']:.3f} | {r['ratio']:.2f}× |")
    md = "\n".join(lines) + "\n\nIndexing throughput: " + json.dumps(idx) + "\n\n"
    md += ("| approximate index | N | strategy | mode | recall@10 vs exact | ms/query (ANN + re-rank) "
           "| ms/query exact |\n")
    md += "|---|---|---|---|---|---|---|\n"
    for r in ann:
        md += (f"| {r['factory']} | {r['N']:,} | {r['strategy']} | {r['mode']} | {r['recall@10']:.3f} | "
               f"{r['ann_ms']:.3f} | {r['exact_ms']:.3f} |\n")
    write_table(out / "results.md", md)


if __name__ == "__main__":
    main()
