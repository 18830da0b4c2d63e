"""Evaluator benchmark: ours vs pytorch-metric-learning's AccuracyCalculator.

60,000 × 128 embeddings with 11,316 classes (SOP-test scale), each run in its
own subprocess so peak RSS is per evaluator.  Reports wall time and peak
memory, and the ratio between the two from this one run (the machine is shared
and noisy; absolute seconds are not comparable across runs).

  python bench/eval_bench.py [--n 60000 --dim 128 --classes 11316] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

from common import timed


def make_data(n: int, dim: int, classes: int, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    # SOP-like: every class has ≥ 2 images, the rest spread at random
    sizes = np.full(classes, 2)
    extra = n - sizes.sum()
    np.add.at(sizes, rng.integers(0, classes, extra), 1)
    labels = np.repeat(np.arange(classes), sizes)
    centers = rng.normal(size=(classes, dim)).astype(np.float32)
    x = centers[labels] + 1.2 * rng.normal(size=(n, dim)).astype(np.float32)
    perm = rng.permutation(n)
    x = x[perm] / np.linalg.norm(x[perm], axis=1, keepdims=True)
    # unit vectors: PML's default k-NN is Euclidean on raw vectors, ours cosine;
    # on unit vectors both give the same ranking, so the metrics must agree
    return x.astype(np.float32), labels[perm]


def child(which: str, n: int, dim: int, classes: int, clustering: bool) -> dict:
    x, y = make_data(n, dim, classes)
    if which == "ours":
        from evaluation import evaluate

        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        res, wall = timed(lambda: evaluate(x, y, ks=(1,), clustering=clustering))
        out = {k: res[k] for k in ("map@r", "r_precision", "precision@1") + (("nmi",) if clustering else ())}
    else:
        import torch
        from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

        include = ["mean_average_precision_at_r", "r_precision", "precision_at_1"] + (["NMI"] if clustering else [])
        calc = AccuracyCalculator(include=tuple(include), k="max_bin_count", device=torch.device("cpu"))
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        res, wall = timed(lambda: calc.get_accuracy(xt, yt, xt, yt, ref_includes_query=True))
        out = {"map@r": res["mean_average_precision_at_r"], "r_precision": res["r_precision"],
               "precision@1": res["precision_at_1"]} | ({"nmi": res["NMI"]} if clustering else {})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"wall_s": wall, "peak_rss_mb": peak / 1024, "rss_before_mb": rss0 / 1024, "metrics": out}


def run_child(which, args, clustering) -> dict:
    cmd = [sys.executable, __file__, "--child", which, "--n", str(args.n), "--dim", str(args.dim),
           "--classes", str(args.classes)] + ([] if clustering else ["--no-clustering"])
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(r.stderr)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=60000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--classes", type=int, default=11316)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--no-clustering", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.n, args.dim, args.classes, not args.no_clustering)))
        return
    results = {}
    for clustering in (False, True):
        tag = "with k-means NMI" if clustering else "retrieval only"
        ours = run_child("ours", args, clustering)
        pml = run_child("pml", args, clustering)
        results[tag] = {"ours": ours, "pml": pml, "speedup": pml["wall_s"] / ours["wall_s"]}
        for k in ("map@r", "r_precision", "precision@1"):
            if abs(ours["metrics"][k] - pml["metrics"][k]) > 1e-4:
                print(f"WARNING: {tag}: {k} differs: ours {ours['metrics'][k]} vs PML {pml['metrics'][k]}")
    print(f"{args.n} × {args.dim} embeddings, {args.classes} classes, {args.threads} threads")
    print("| metrics | ours wall (s) | PML wall (s) | speed-up (PML/ours) | ours peak RSS (MB) | PML peak RSS (MB) |")
    print("|---|---|---|---|---|---|")
    for tag, r in results.items():
        print(f"| {tag} | {r['ours']['wall_s']:.1f} | {r['pml']['wall_s']:.1f} | {r['speedup']:.2f}× | "
              f"{r['ours']['peak_rss_mb']:.0f} | {r['pml']['peak_rss_mb']:.0f} |")
    if args.json:
        from core.atomic import write_json
        write_json(args.json, results | {"config": vars(args)})


if __name__ == "__main__":
    main()
