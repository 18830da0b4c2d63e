"""The strategy × re-ranker matrix's best cell over training seeds (kanji, the demo's trained tail).

  python bench/rerank_seeds.py [--seeds 0,1,2] [--threads 1] [--runs runs/bench-rerank-seeds]
                               [--out bench/results/rerank]

For each seed: the demo's tail recipe (`demo_tail_config`: ProxyAnchor, efficientnet_lite0, last
2 stages over the cached frozen prefix) trained with that seed (seed 0 reuses the demo's own run
when it is there), then on the test classes, query = gallery with the query left out of its own
re-ranking: trained [cosine] and the matrix's best cell, diagonal-psd(r=1, seed=0, psd=clip)
[cosine], each without a re-ranker and with k-reciprocal at its defaults.  MAP@R and R@1 as
mean ± std over seeds, with the change that k-reciprocal and the refinement make.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
from common import pm

from core.atomic import write_json, write_text
from core.flags import apply_threads
from core.logs import setup_logging
from demo.pipeline import demo_tail_config
from index.analysis.rerank_eval import rerank_split
from index.backends.search import Searcher
from index.backends.store import in_memory_index
from index.build import split_features
from index.search_config import SearchConfig
from training.trainer import train_or_reuse

CELLS = [("trained", {}, "trained [cosine]"),
         ("diagonal-psd", {"r": 1.0, "seed": 0, "psd": "clip"}, "diagonal-psd(r=1, clip) [cosine]")]
RERANK = ("none", "kreciprocal")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2", help="training seeds (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="torch, FAISS and BLAS threads (default: %(default)s)")
    ap.add_argument("--runs", default="runs/bench-rerank-seeds", help="run folders for seeds other than the "
                    "demo's own, reused (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/rerank", help="results folder (default: %(default)s)")
    args = ap.parse_args()
    setup_logging()
    apply_threads(args.threads)
    seeds = [int(s) for s in args.seeds.split(",")]
    t0 = time.time()
    res: dict[str, list[dict]] = {}
    for seed in seeds:
        base = demo_tail_config()
        out = base.out if seed == base.seed else str(Path(args.runs) / f"demo-tail-s{seed}")
        cfg = dataclasses.replace(base, seed=seed, out=out, threads=args.threads, progress=False)
        train_or_reuse(cfg)
        f, y, W = split_features(Path(out) / "best.pt", cfg.data_config(), "test", cfg.cache_dir, progress=False)
        searcher = Searcher(in_memory_index(f, y, W, True))
        for strategy, params, label in CELLS:
            for rr in RERANK:
                m = rerank_split(searcher, SearchConfig.of(strategy, params, "cosine", rr), y)
                res.setdefault(f"{label} + {rr}", []).append({"seed": seed, "map@r": m["map@r"],
                                                              "recall@1": m["recall@1"]})
                print(f"[{time.time() - t0:6.0f} s] seed {seed} {label} + {rr}: MAP@R {100 * m['map@r']:.2f}",
                      flush=True)
        write_json(Path(args.out) / "best_cell_seeds.json", {"seeds": seeds, "cells": res})
    cmd = "python " + " ".join(["bench/rerank_seeds.py"] + sys.argv[1:])
    L = [f"`{cmd}`, measured {time.strftime('%Y-%m-%d')}; the demo's tail recipe, seeds "
         f"{', '.join(map(str, seeds))}, kanji test classes, mean ± std.", "",
         "| setting + re-ranker | MAP@R | R@1 | Δ MAP@R against trained [cosine] + none (per seed, mean ± std) |",
         "|---|---|---|---|"]
    ref = np.array([r["map@r"] for r in res[f"{CELLS[0][2]} + none"]])
    for name, rows in res.items():
        mp = np.array([r["map@r"] for r in rows])
        L.append(f"| {name} | {pm(mp)} | {pm([r['recall@1'] for r in rows])} | {pm(mp - ref)} |")
    write_text(Path(args.out) / "best_cell_seeds.md", "\n".join(L) + "\n")
    print("\n".join(L))


if __name__ == "__main__":
    main()
