"""Issue-4 ablation on kanji (frozen efficientnet_lite0 features), 3 seeds each.

  python bench/reg_ablation.py [--seeds 0,1,2] [--out bench/results/regularizers]

For every (base loss, regularizer) pair the regularizer weight is chosen from a
small grid by *validation* MAP@R on the first seed; the other seeds then run
with that weight.  Test metrics (MAP@R, R@1, NMI) and the embedding
diagnostics (uniformity, spectral decay ρ) are mean ± std over the seeds.
Plain bases reuse bench/train_bench.py's runs (same folders, same configs).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.atomic import write_json, write_text  # noqa: E402
from core.logs import setup_logging  # noqa: E402
from training.config import TrainConfig  # noqa: E402
from training.trainer import train_or_reuse  # noqa: E402

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
            "nir-raw": ("nir", ("nir.input=raw",))}


def diagnostics_of(run_dir: str) -> dict:
    """Test embeddings of the selected checkpoint → diagnostics (same for every row)."""
    from evaluation.diagnostics import embedding_diagnostics
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


def run(loss, reg, weight, seed, runs) -> tuple[dict, str]:
    if reg is None:
        out = f"{runs}/{loss}-s{seed}"
        cfg = TrainConfig(out=out, seed=seed, loss=loss, progress=False)
    else:
        out = f"{runs}/{loss}+{reg}-w{weight}-s{seed}"
        name, params = VARIANTS.get(reg, (reg, ()))
        cfg = TrainConfig(out=out, seed=seed, loss=loss, regularizer=(name,), reg_weight=(weight,),
                          reg_param=params, progress=False)
    m, _ = train_or_reuse(cfg)
    return m, out


def fmt(v, scale=100.0, digits=2):
    v = np.array(v, dtype=float) * scale
    return f"{v.mean():.{digits}f} ± {v.std():.{digits}f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--runs", default="runs/bench")
    ap.add_argument("--out", default="bench/results/regularizers")
    ap.add_argument("--only", help="run just this regularizer's rows (no report); to split the work")
    args = ap.parse_args()
    setup_logging()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    plan = [p for p in PLAN if args.only is None or p[1] == args.only]
    for loss, reg, grid in plan:
        chosen, tuning = None, []
        if reg is not None:
            for w in grid:
                m, _ = run(loss, reg, w, seeds[0], args.runs)
                tuning.append({"weight": w, "val_map@r": m["val"]["map@r"]})
            chosen = max(tuning, key=lambda t: t["val_map@r"])["weight"]
        vals = {k: [] for k in KEYS}
        for s in seeds:
            m, out = run(loss, reg, chosen, s, args.runs)
            d = diagnostics_of(out)
            for k in ("map@r", "recall@1", "nmi"):
                vals[k].append(m["test"][k])
            vals["uniformity"].append(d["uniformity"])
            vals["spectral_decay"].append(d["spectral_decay"])
        rows.append({"base": loss, "regularizer": reg or "—", "weight": chosen, "tuning_on_val": tuning,
                     **{k: vals[k] for k in KEYS}})
        print(rows[-1]["base"], rows[-1]["regularizer"], chosen, fmt(vals["map@r"]), flush=True)
    if args.only:
        return
    write_json(Path(args.out) / "results.json", {"seeds": seeds, "rows": rows})
    lines = ["| base | regularizer | weight (val-chosen) | MAP@R | R@1 | NMI | uniformity | ρ |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['base']} | {r['regularizer']} | {r['weight'] if r['weight'] is not None else '—'} | "
                     f"{fmt(r['map@r'])} | {fmt(r['recall@1'])} | {fmt(r['nmi'])} | "
                     f"{fmt(r['uniformity'], 1, 3)} | {fmt(r['spectral_decay'], 1, 3)} |")
    md = "\n".join(lines) + "\n"
    write_text(Path(args.out) / "results.md", md)
    print(md)


if __name__ == "__main__":
    main()
