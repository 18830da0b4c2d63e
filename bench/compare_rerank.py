"""The Compare tab's whole-set comparison with a re-ranker on one side, on a synthetic index of the demo's size.

  python bench/compare_rerank.py [--n 5750] [--dim 2048] [--classes 1150] [--threads 1,2]
                                 [--out bench/results/compare]

For each thread count and each registered re-ranker at its defaults: a fresh Comparer (nothing
cached) compares trained · cosine against trained · cosine with that re-ranker over every query,
as the Compare tab's whole-set view does (the re-ranker's offline pass included).  The reference,
timed the same way in the same run, is a plain comparison: trained · cosine against identity ·
cosine, neither side re-ranked.  Torch, faiss and BLAS get the thread count; the re-rankers that
batch queries run their batches on faiss's threads.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import timed

from core.atomic import write_json, write_text
from core.flags import apply_threads
from index.analysis.compare import Comparer
from index.backends.store import in_memory_index
from index.rerankers import RERANKERS
from index.search_config import NO_RERANK, SearchConfig
from index.space import CACHE


def synthetic(n: int, dim: int, classes: int, embed: int, seed: int = 0):
    """Clustered unit features (n / classes items per class) and a random neck, as a trained index looks."""
    rng = np.random.default_rng(seed)
    y = np.arange(n) % classes
    X = rng.normal(size=(classes, dim))[y] + 1.2 * rng.normal(size=(n, dim))
    W = rng.normal(size=(embed, dim)) / np.sqrt(dim)
    return in_memory_index(X.astype(np.float32), y, W.astype(np.float32), normalize=True)


def compare_seconds(data, left: SearchConfig, right: SearchConfig) -> tuple[float, float]:
    """(seconds of one whole-set comparison, the right side's mean AP), with nothing cached: an
    empty re-ranking cache folder and the process's metric-space memory emptied."""
    with tempfile.TemporaryDirectory() as d:
        os.environ["XDG_CACHE_HOME"] = d
        CACHE.clear()
        c = Comparer(data)
        cmp, s = timed(lambda: c.compare(left, right))
    return s, float(np.mean(cmp.ap_b))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5750, help="indexed items (default: %(default)s, the demo's)")
    ap.add_argument("--dim", type=int, default=2048, help="trunk feature dimension (default: %(default)s)")
    ap.add_argument("--classes", type=int, default=1150, help="classes (default: %(default)s)")
    ap.add_argument("--embed", type=int, default=128, help="neck output dimension (default: %(default)s)")
    ap.add_argument("--threads", default="1,2", help="thread counts to time (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/compare", help="results folder (default: %(default)s)")
    args = ap.parse_args()
    from threadpoolctl import threadpool_limits

    data = synthetic(args.n, args.dim, args.classes, args.embed)
    base = SearchConfig()
    rows = []
    for t in [int(x) for x in args.threads.split(",")]:
        apply_threads(t)
        with threadpool_limits(limits=t, user_api="blas"):
            plain_s, plain_ap = compare_seconds(data, base, SearchConfig.of("identity"))
            rows.append({"threads": t, "reranker": "none (identity · cosine)", "seconds": plain_s, "map@r": plain_ap})
            print(f"threads {t}: plain {plain_s:.2f} s", flush=True)
            for name in [n for n in RERANKERS.names() if n != NO_RERANK]:
                s, m = compare_seconds(data, base, SearchConfig.of("trained", rerank=name))
                rows.append({"threads": t, "reranker": name, "seconds": s, "map@r": m, "x_plain": s / plain_s})
                print(f"threads {t}: {name} {s:.2f} s ({s / plain_s:.1f}× plain)", flush=True)
    out = Path(args.out)
    write_json(out / "compare_rerank.json", {"n": args.n, "dim": args.dim, "classes": args.classes,
                                             "embed": args.embed, "rows": rows})
    cmd = "python " + " ".join(["bench/compare_rerank.py"] + sys.argv[1:])
    L = ["# The Compare tab's whole-set comparison with a re-ranker", "",
         f"`{cmd}`, measured {time.strftime('%Y-%m-%d')} on 2 CPU cores: a synthetic index of {args.n:,} items, "
         f"d = {args.dim}, {args.classes:,} classes, a random {args.embed}-d neck; trained · cosine against trained "
         "· cosine with the re-ranker (each at its defaults, its offline pass included), on a fresh Comparer; "
         "the reference is trained · cosine against identity · cosine, neither re-ranked.", "",
         "| threads | re-ranker | s | × plain |", "|---|---|---|---|"]
    for r in rows:
        L.append(f"| {r['threads']} | {r['reranker']} | {r['seconds']:.2f} | "
                 f"{r.get('x_plain', 1.0):.1f} |")
    write_text(out / "compare_rerank.md", "\n".join(L) + "\n")
    print("\n".join(L))


if __name__ == "__main__":
    main()
