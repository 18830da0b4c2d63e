"""Regularizer ablation on kanji, 3 seeds each: on frozen efficientnet_lite0 features,
and on trained tails, the papers' setting.

  python bench/reg_ablation.py [--seeds 0,1,2] [--out bench/results/regularizers]
  python bench/reg_ablation.py --setting tail [--train-blocks 1] [--epochs 10]
      [--out bench/results/regularizers_tail] [--runs runs/bench-reg-tail]

`--setting tail` trains the last --train-blocks stages of efficientnet_lite0 (over the
cached frozen prefix, BN frozen) plus the neck, with the pairings and weight grids of
the tail plan (each grid holds the paper's value): determinant λ1 = λ2 × ε and NIR with
ProxyAnchor, NIR also with ProxyNCA, CGML with Triplet and Binomial, skewed mean with
ProxyAnchor.  Finished runs are reused, so an interrupted run resumes.

For every (base loss, regularizer) pair the regularizer weight is chosen from a
small grid by *validation* MAP@R on the first seed; the other seeds then run
with that weight.  Test metrics (MAP@R, R@1, NMI) and the embedding
diagnostics (uniformity, spectral decay ρ) are mean ± std over the seeds.
Plain bases reuse bench/train_bench.py's runs (same folders, same configs).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from common import pm, write_table

from core.atomic import write_json
from core.logs import setup_logging
from training.config import TrainConfig
from training.trainer import train_or_reuse

KEYS = ("map@r", "recall@1", "nmi", "uniformity", "spectral_decay")
PLAN = [  # base loss, regularizer (None = plain), weight grid; the slow flows run last
    ("proxy_anchor", None, None),
    ("proxy_anchor", "nir", [0.01, 0.1]),
    ("proxy_anchor", "skewed_mean", [0.1, 1.0]),
    ("proxy_nca", None, None),
    ("proxy_nca", "nir", [0.01, 0.1]),
    ("triplet", None, None),
    ("triplet", "cgml", [0.002, 0.02]),
    ("binomial", None, None),
    ("binomial", "cgml", [0.002, 0.02]),
    ("proxy_anchor", "determinant", [0.001, 0.05]),
    ("proxy_anchor", "determinant+1", [0.05]),   # the paper's eq. 7 "+1" variant (bounded below)
    ("proxy_anchor", "nir-raw", [0.01, 0.1]),    # NIR on the un-normalised embedding
    ("proxy_nca", "nir-raw", [0.01, 0.1]),
]
VARIANTS = {"determinant+1": ("determinant", ("determinant.variant=plus_one",)),
            "nir-raw": ("nir", ("nir.input=raw",)),
            "determinant-e0.2": ("determinant", ("determinant.epsilon=0.2",)),
            "determinant-e0.4": ("determinant", ("determinant.epsilon=0.4",))}
DET = [0.01, 0.05, 0.1, 0.2]  # λ1 = λ2 (lambda_max < 0: the same as the weight)
TAIL_PLAN = [  # the pairing each paper uses; ≥ 4 weights including the paper's
    ("proxy_anchor", None, None),
    ("proxy_anchor", "nir", [0.001, 0.01, 0.05, 0.1]),
    ("proxy_anchor", "skewed_mean", [0.01, 0.1, 0.5, 1.0]),
    ("proxy_nca", None, None),
    ("proxy_nca", "nir", [0.001, 0.01, 0.05, 0.1]),
    ("triplet", None, None),
    ("triplet", "cgml", [0.0005, 0.001, 0.002, 0.005]),
    ("binomial", None, None),
    ("binomial", "cgml", [0.0005, 0.001, 0.002, 0.005]),
    ("proxy_anchor", "determinant", [(e, w) for e in ("determinant-e0.2", "determinant-e0.4") for w in DET]),
]


def diagnostics_of(run_dir: str, tail: bool = False) -> dict:
    """Test embeddings of the selected checkpoint → diagnostics (same for every row)."""
    from evaluation.diagnostics import embedding_diagnostics

    if tail:  # the trained tail's trunk features, through the checkpoint's own data settings
        from index.build import split_features
        from model.checkpoint import load_model

        f, y, _ = split_features(Path(run_dir) / "best.pt", None, "test", "cache/features", False)
        model, _ = load_model(Path(run_dir) / "best.pt")
        return embedding_diagnostics(model.embed_features(torch.from_numpy(f)).detach().numpy(), y)
    from data import DataConfig, load_data
    from model.checkpoint import load_model
    from model.features import backbone_features
    from model.preprocess import transform_for

    model, _ = load_model(Path(run_dir) / "best.pt")
    dcfg = DataConfig()
    splits = load_data(dcfg, progress=False)
    spec = transform_for(model.backbone, dcfg)
    f, y, _ = backbone_features(model.backbone, splits, splits.test, spec, dcfg, "cache/features", False)
    e = model.embed_of_backbone(f)
    return embedding_diagnostics(e, y)


def run(loss, reg, weight, seed, runs, setting: dict | None = None) -> tuple[dict, str]:
    """`weight`: a number, or (variant, number) for grids over a regularizer parameter too."""
    kw = dict(setting or {})
    if isinstance(weight, (tuple, list)):
        reg, weight = weight
    if reg is None:
        out = f"{runs}/{loss}-s{seed}"
        cfg = TrainConfig(out=out, seed=seed, loss=loss, progress=False, **kw)
    else:
        out = f"{runs}/{loss}+{reg}-w{weight}-s{seed}"
        name, params = VARIANTS.get(reg, (reg, ()))
        cfg = TrainConfig(out=out, seed=seed, loss=loss, regularizer=(name,), reg_weight=(weight,),
                          reg_param=params, progress=False, **kw)
    m, _ = train_or_reuse(cfg)
    return m, out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--runs", default="runs/bench")
    ap.add_argument("--out", default="bench/results/regularizers")
    ap.add_argument("--only", help="run just this regularizer's rows (no report); to split the work")
    ap.add_argument("--setting", choices=("frozen", "tail"), default="frozen",
                    help="frozen features or trained tails (default: %(default)s)")
    ap.add_argument("--train-blocks", type=int, default=1, help="tail setting: stages trained (default: %(default)s)")
    ap.add_argument("--epochs", type=int, default=10, help="tail setting: epochs per run (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per run (0 = default) (default: %(default)s)")
    args = ap.parse_args()
    setup_logging()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    tail = args.setting == "tail"
    setting = {"threads": args.threads}
    if tail:
        setting |= {"mode": "tail", "train_blocks": args.train_blocks, "epochs": args.epochs, "device": "cpu"}
        if args.runs == ap.get_default("runs"):
            args.runs = "runs/bench-reg-tail"
        if args.out == ap.get_default("out"):
            args.out = "bench/results/regularizers_tail"
    plan = [p for p in (TAIL_PLAN if tail else PLAN) if args.only is None or p[1] == args.only]
    for loss, reg, grid in plan:
        chosen, tuning = None, []
        if reg is not None:
            for w in grid:
                m, _ = run(loss, reg, w, seeds[0], args.runs, setting)
                tuning.append({"weight": w, "val_map@r": m["val"]["map@r"]})
                print("  tuning", loss, reg, w, f"val {100 * m['val']['map@r']:.2f}", flush=True)
            chosen = max(tuning, key=lambda t: t["val_map@r"])["weight"]
        vals = {k: [] for k in KEYS} | {"seconds": []}
        for s in seeds:
            m, out = run(loss, reg, chosen, s, args.runs, setting)
            vals["seconds"].append(m.get("train_seconds", float("nan")))
            d = diagnostics_of(out, tail)
            for k in ("map@r", "recall@1", "nmi"):
                vals[k].append(m["test"][k])
            vals["uniformity"].append(d["uniformity"])
            vals["spectral_decay"].append(d["spectral_decay"])
        rows.append({"base": loss, "regularizer": reg or "—", "weight": chosen, "tuning_on_val": tuning,
                     **{k: vals[k] for k in (*KEYS, "seconds")}})
        # partial results after every row: a long run that is stopped still leaves them
        write_json(Path(args.out) / "results.json", {"seeds": seeds, "setting": setting, "rows": rows})
        print(rows[-1]["base"], rows[-1]["regularizer"], chosen, pm(vals["map@r"]), flush=True)
    if args.only:
        return
    lines = ["| base | regularizer | weight (val-chosen) | MAP@R | R@1 | NMI | uniformity | ρ | s/run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        w = r["weight"]
        if isinstance(w, (tuple, list)):
            w = f"{w[1]} ({w[0].split('-')[-1].replace('e', 'ε=')})"
        w = "—" if w is None else w
        lines.append(
            f"| {r['base']} | {r['regularizer']} | {w} | "
            f"{pm(r['map@r'])} | {pm(r['recall@1'])} | {pm(r['nmi'])} | "
            f"{pm(r['uniformity'], 1, 3)} | {pm(r['spectral_decay'], 1, 3)} | "
            f"{np.mean(r['seconds']):.0f} |"
        )
    md = "\n".join(lines) + "\n"
    write_table(Path(args.out) / "results.md", md)


if __name__ == "__main__":
    main()
