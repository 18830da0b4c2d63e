"""What following the official diffusion code's two details changes: MATLAB pcg's answer when it
has not converged (the iterate of smallest residual, where plain conjugate gradients stop at the
last one) and the order of equal f (gallery index, where ranking them by the plain score is the
other choice).

  python bench/diffusion_official.py [--sizes demo,100000] [--queries 300] [--settings "k=10,alpha=0.9;..."]
      [--threads 1] [--out bench/results/rerank]

`diffusion` at its defaults (the whole graph, k = 50, kq = 10, α = 0.99, γ = 3, 20 iterations,
tol 10⁻⁶) or at `--settings`, on the galleries of bench/rerank_pool.py (the demo: every item a query; N: synthetic,
`--queries` items), each query left out of its own ranking.  Per gallery: how many queries'
solves converged, how many ended on an earlier iterate than the last, how many top-R lists the
last iterate changes (R = the query's class size − 1) and their mean overlap, and MAP@R under
each of the four combinations.  Results: OUT/diffusion_official.md and .json (rows of other
galleries or settings measured before are kept).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import shlex
import sys
import tempfile
from pathlib import Path

import numpy as np

BATCH = 256  # queries per solve at most


def last_iterate(A, b, tol, iterations):
    """Conjugate gradients from 0 returning the last iterate, each column stopping once
    ‖b − Ax‖ ≤ tol ‖b‖ by the recurrence's residual."""
    x = np.zeros_like(b)
    r = b.copy()
    bn = np.linalg.norm(b, axis=0)
    live = bn > 0
    p = r.copy()
    rs = np.einsum("ij,ij->j", r, r)
    for _ in range(iterations):
        if not live.any():
            break
        Ap = A(p)
        a = np.where(live, rs / np.where(live, np.einsum("ij,ij->j", p, Ap), 1.0), 0.0)
        x += a * p
        r -= a * Ap
        rs_new = np.einsum("ij,ij->j", r, r)
        live &= ~(np.sqrt(rs_new) <= tol * bn)
        p = r + np.where(live, rs_new / np.where(rs > 0, rs, 1.0), 0.0) * p
        rs = rs_new
    return x


def solves(space, q, ids, p):
    """f of each query (n × B) under pcg's answer and under the last iterate, and whether pcg's
    converged (its true residual within tol)."""
    import index.rerankers.diffusion as D
    from index.rerankers.registry import candidates

    first = space.search(q, p.kq + 1)
    seeds, _ = candidates(first, ids, p.kq)
    seen = {}
    real = D.conjugate_gradient

    def spy(A, b, tol, iterations):
        seen["A"], seen["b"] = A, b
        return real(A, b, tol, iterations)

    D.conjugate_gradient = spy
    try:
        F = D._diffuse_whole(space, q, seeds, ids, p)
    finally:
        D.conjugate_gradient = real
    A, Y = seen["A"], seen["b"]
    converged = np.linalg.norm(Y - A(F), axis=0) <= p.tol * np.linalg.norm(Y, axis=0)
    return F, last_iterate(A, Y, p.tol, p.iterations), converged


def top(f, s, me, k, by_score):
    """The top k rows by f, equal f by the plain score s then by row, or by row alone."""
    rows = np.arange(len(f))
    keys = (rows, -s, -f) if by_score else (rows, -f)
    order = np.lexsort(keys)
    order = order[order != me]
    return order[:k]


def measure(space, q, ids, labels, setting: str) -> dict:
    from evaluation.evaluator import per_query_metrics
    from index.rerankers import reranker_params
    from index.rerankers.diffusion import BATCH_CELLS

    p = reranker_params("diffusion", [t for t in setting.split(",") if t])
    R = np.bincount(labels)[labels[ids]] - 1
    k = int(R.max())
    lists: dict[tuple[str, str], list[np.ndarray]] = {(s, t): [] for s in ("pcg", "last") for t in ("index", "score")}
    conv: list[np.ndarray] = []
    earlier: list[np.ndarray] = []
    same: list[bool] = []
    overlap: list[float] = []
    unreached_in_top: list[bool] = []
    step = max(1, min(BATCH, BATCH_CELLS // space.n))  # as the re-ranker batches them
    for a in range(0, len(q), step):
        sl = slice(a, a + step)
        F, L, c = solves(space, q[sl], ids[sl], p)
        S = space.score(q[sl]).astype(np.float64)
        conv.append(c)
        earlier.append(np.abs(F - L).max(0) > 1e-12 * np.abs(F).max(0))
        for j in range(F.shape[1]):
            me, r = int(ids[a + j]), int(R[a + j])
            for (solve, ties), got in lists.items():
                got.append(top(F[:, j] if solve == "pcg" else L[:, j], S[j], me, k, ties == "score"))
            new, old = lists[("pcg", "index")][-1][:r], lists[("last", "score")][-1][:r]
            same.append(bool(np.array_equal(new, old)))
            overlap.append(len(np.intersect1d(new, old)) / r)
            unreached_in_top.append(bool((F[new, j] == 0).any()))
    out: dict = {"queries": len(ids), "converged": int(np.concatenate(conv).sum()),
           "earlier_iterate": int(np.concatenate(earlier).sum()), "top_r_identical": int(np.sum(same)),
           "top_r_overlap": float(np.mean(overlap)), "unreached_in_top_r": int(np.sum(unreached_in_top))}
    for (solve, ties), rows in lists.items():
        rows_ = np.stack(rows)
        nbr = labels[rows_]
        out[f"map@r {solve} {ties}"] = float(np.mean(per_query_metrics(nbr, labels[ids], R, ks=(1,))["map@r"]))
    return out


def table(meta, rows) -> str:
    runs = list(dict.fromkeys((r["command"], r["date"]) for r in rows))
    lines = [f"# Diffusion: pcg's answer and the order of equal f ({max(d for _, d in runs)})", "",
             f"{meta['threads']} thread(s); `diffusion` on the whole graph, 20 iterations, tol 10⁻⁶, the other "
             "parameters at their defaults unless the setting says otherwise; trained M′, cosine mode, each query "
             "left out of its own ranking. \"pcg\": the iterate of smallest residual (MATLAB pcg, our default); "
             "\"last\": the last iterate. \"index\": equal f by gallery index (run_test.m's stable sort, our "
             "default); \"score\": by the plain score (`ties=score`). Top R (R = the query's class size − 1): "
             "pcg/index against last/score. Runs: "
             + "; ".join(f"[{i + 1}] `{c}` ({d})" for i, (c, d) in enumerate(runs)) + ".", "",
             "| gallery | setting | queries | converged | pcg ≠ last iterate | top R identical | top-R overlap "
             "| queries with f = 0 in the top R | MAP@R pcg, index (default) | pcg, score | last, index "
             "| last, score | run |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['gallery']} | {r['setting']} | {r['queries']:,} | {r['converged']:,} | "
                     f"{r['earlier_iterate']:,} | "
                     f"{r['top_r_identical']:,} | {r['top_r_overlap']:.4f} | {r['unreached_in_top_r']:,} | "
                     f"{100 * r['map@r pcg index']:.2f} | {100 * r['map@r pcg score']:.2f} | "
                     f"{100 * r['map@r last index']:.2f} | {100 * r['map@r last score']:.2f} | "
                     f"{runs.index((r['command'], r['date'])) + 1} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="demo,100000", help="demo and/or synthetic gallery sizes (default: %(default)s)")
    ap.add_argument("--queries", type=int, default=300,
                    help="queries of a synthetic gallery (the demo: every item) (default: %(default)s)")
    ap.add_argument("--settings", default="",
                    help="diffusion parameters to measure, `;`-separated `key=value,...` lists (default: its defaults)")
    ap.add_argument("--threads", type=int, default=1, help="FAISS and BLAS threads (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/rerank", help="results folder (default: %(default)s)")
    args = ap.parse_args()

    import faiss
    from rerank_pool import demo_split, query_rows, synthetic_split  # a sibling script: bench/ is first on sys.path
    from threadpoolctl import threadpool_limits

    from core.atomic import write_json, write_text
    from index.backends.search import Searcher
    from index.backends.store import in_memory_index
    from index.rerankers import SearcherSpace

    faiss.omp_set_num_threads(args.threads)
    threadpool_limits(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for size in args.sizes.split(","):
            x, y, W = demo_split() if size == "demo" else synthetic_split(int(size))
            space = SearcherSpace(Searcher(in_memory_index(x, y, W)), "trained", None, "cosine",
                                  cache_dir=Path(cache) / size)
            _, ids = query_rows(y, size, args.queries)
            what = (f"demo: kanji test classes, trained tail ({len(y):,} items)" if size == "demo"
                    else f"synthetic ({len(y):,} items)")
            for setting in args.settings.split(";"):
                m = measure(space, space.prepare(x[ids]), ids, y, setting)
                rows.append({"gallery": what, "size": size, "setting": setting or "defaults", **m})
                print(rows[-1], flush=True)
    meta = {"command": "python bench/diffusion_official.py " + shlex.join(sys.argv[1:]),
            "date": _dt.date.today().isoformat(), "threads": args.threads}
    for r in rows:
        r["command"], r["date"] = meta["command"], meta["date"]
    out = Path(args.out)
    if (out / "diffusion_official.json").is_file():  # rows of other galleries or settings measured before are kept
        import json

        done = {(r["size"], r["setting"]) for r in rows}
        old = [r for r in json.loads((out / "diffusion_official.json").read_text())["rows"]
               if (r["size"], r["setting"]) not in done]
        rows = sorted(old + rows, key=lambda r: (r["size"] != "demo", r["size"], r["setting"] != "defaults"))
    write_json(out / "diffusion_official.json", {"meta": meta, "rows": rows})
    write_text(out / "diffusion_official.md", table(meta, rows))
    print(table(meta, rows))


if __name__ == "__main__":
    main()
