"""Training results: kanji test MAP@R / R@1 / NMI, mean ± std over seeds.

  python bench/train_bench.py [--seeds 0,1,2] [--out bench/results/train]

Rows: the raw efficientnet_lite0 trunk (no training); ProxyAnchor, ProxyNCA,
Multi-Similarity, Triplet and Binomial on frozen efficientnet_lite0 features;
the small CNN trained from scratch with ProxyAnchor (full training).  Every
model is selected on validation classes; test is evaluated once.  Runs are
reused when their folder already holds a finished run of the same config.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
from common import pm, write_table

from core.atomic import write_json
from core.logs import setup_logging
from training.config import TrainConfig
from training.trainer import train_or_reuse

KEYS = ("map@r", "recall@1", "nmi")
# the losses on frozen efficientnet_lite0 features: (row name, TrainConfig settings)
FROZEN_SETUPS = [("ProxyAnchor", dict(loss="proxy_anchor")), ("ProxyNCA", dict(loss="proxy_nca")),
                 ("Multi-Similarity", dict(loss="multi_similarity")), ("Triplet (semi-hard)", dict(loss="triplet")),
                 ("Binomial deviance", dict(loss="binomial"))]


def frozen_model(name: str) -> str:
    """The results row of a FROZEN_SETUPS entry (its "model")."""
    return f"{name} on efficientnet_lite0"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default="bench/results/train")
    ap.add_argument("--runs", default="runs/bench")
    ap.add_argument("--scratch-epochs", type=int, default=30)
    args = ap.parse_args()
    setup_logging()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []

    # raw trunk: deterministic, no seed dependence
    from data import DataConfig, load_data
    from demo.pipeline import pretrained_baselines
    dcfg = DataConfig()
    base = pretrained_baselines(dcfg, load_data(dcfg), "cache/features")
    raw = base["efficientnet_lite0 trunk, ImageNet, no training"]
    rows.append({"model": "raw efficientnet_lite0 trunk", "mode": "no training",
                 **{k: [raw[k]] for k in KEYS}, "seconds": [0.0]})

    for name, kw in FROZEN_SETUPS:
        r = {"model": frozen_model(name), "mode": "frozen-backbone", **{k: [] for k in KEYS},
             "seconds": []}
        for s in seeds:
            cfg = TrainConfig(out=f"{args.runs}/{kw['loss']}-s{s}", seed=s, progress=False, **kw)
            t = time.time()
            m, _ = train_or_reuse(cfg)
            r["seconds"].append(m.get("train_seconds", time.time() - t))
            for k in KEYS:
                r[k].append(m["test"][k])
        rows.append(r)

    r = {"model": "small CNN from scratch, ProxyAnchor", "mode": "full training", **{k: [] for k in KEYS},
         "seconds": []}
    for s in seeds:
        cfg = TrainConfig(out=f"{args.runs}/small_cnn-proxy_anchor-s{s}", seed=s, backbone="small_cnn",
                          weights="none", mode="finetune", lr=1e-3, neck_lr_mult=1.0, epochs=args.scratch_epochs,
                          progress=False)
        m, _ = train_or_reuse(cfg)
        r["seconds"].append(m["train_seconds"])
        for k in KEYS:
            r[k].append(m["test"][k])
    rows.append(r)

    out = Path(args.out)
    write_json(out / "results.json", {"seeds": seeds, "rows": rows})
    lines = ["| model | mode | MAP@R | R@1 | NMI | train s/run |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['mode']} | {pm(r['map@r'])} | {pm(r['recall@1'])} | "
                     f"{pm(r['nmi'])} | {np.mean(r['seconds']):.0f} |")
    md = "\n".join(lines) + "\n"
    write_table(out / "results.md", md)


if __name__ == "__main__":
    main()
