"""Training cost of the regularizers: per-step wall time of each regularizer as a ratio to its plain base.

  python bench/reg_cost.py [--steps 30] [--modes frozen,tail,finetune] [--out bench/results/reg_cost]

Measured in one run, interleaved (base, regularized, base, ...) so machine noise
hits both alike; the median step time is compared.  Two settings:
  frozen    the kanji demo setting: a step is neck + loss on cached trunk features
            (so the base step is tiny and any extra network dominates the ratio)
  tail      efficientnet_lite0's last 2 stages trained over the cached frozen prefix (64-px kanji,
            batch 120): the CPU path of the papers' setting
  finetune  efficientnet_lite0 trained end to end on 64-px kanji, batch 32
            (the papers' setting: the backbone dominates the step)
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from common import timed, write_table

from core.atomic import write_json
from training.config import TrainConfig
from training.samplers import epoch_batches
from training.trainer import Run

PAIRS = [("proxy_anchor", "nir", 1.2), ("proxy_anchor", "determinant", 1.5), ("triplet", "cgml", 2.1),
         ("binomial", "cgml", 2.1), ("proxy_anchor", "skewed_mean", None)]


def make_run(mode, loss, reg, batch, tmp):
    cfg = TrainConfig(loss=loss, mode=mode, regularizer=(reg,) if reg else (), batch_size=batch,
                      out=str(tmp / f"{mode}-{loss}-{reg}"), progress=False, epochs=1, device="cpu",
                      train_blocks=2 if mode == "tail" else 0, probe_epochs=0)  # step time only: no probe
    r = Run(cfg)
    r.setup()
    return r


def batch_for(r: Run, mode: str, rng):
    labels = np.asarray(r.source.labels)
    b = epoch_batches(labels, r.cfg.batch_size, r.cfg.m_per_class, r.step.paired, np.random.RandomState(0))[0]
    y = torch.tensor([r.label_map[int(v)] for v in labels[b]])
    if mode != "finetune":  # the batch source's own inputs: cached features or prefix maps
        x, _, _ = next(iter(r.source.batches([b])))
        return x, y
    from data.loader import ImageDataset
    from model.preprocess import transform_for

    ds = ImageDataset(r.splits.train, transform_for(r.backbone, r.dcfg, augment=True).build())
    return torch.stack([ds[int(i)][0] for i in b]), y


def step_time(r: Run, x, y, mode) -> float:
    return timed(lambda: r.step(r.source.encode, x, y, torch.Generator()))[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--finetune-steps", type=int, default=8)
    ap.add_argument("--out", default="bench/results/reg_cost")
    ap.add_argument("--modes", default="frozen,tail,finetune", help="which settings (default: %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for mode, batch, steps in [m for m in (("frozen", 120, args.steps), ("tail", 120, args.steps),
                                               ("finetune", 32, args.finetune_steps))
                                   if m[0] in args.modes.split(",")]:
            for loss, reg, target in PAIRS:
                torch.manual_seed(0)
                rng = np.random.default_rng(0)
                base, regd = make_run(mode, loss, None, batch, tmp), make_run(mode, loss, reg, batch, tmp)
                for r in (base, regd):
                    r.source.start_epoch(0, r.model)
                xb, yb = batch_for(base, mode, rng)
                xr, yr = batch_for(regd, mode, rng)  # CGML: twice the images (two class-aligned batches)
                tb, tr = [], []
                step_time(base, xb, yb, mode), step_time(regd, xr, yr, mode)  # warm-up
                for _ in range(steps):
                    tb.append(step_time(base, xb, yb, mode))
                    tr.append(step_time(regd, xr, yr, mode))
                ratio = float(np.median(tr) / np.median(tb))
                rows.append({"mode": mode, "base": loss, "regularizer": reg, "base_ms": 1e3 * float(np.median(tb)),
                             "reg_ms": 1e3 * float(np.median(tr)), "ratio": ratio, "target": target,
                             "batch_images": int(len(yr))})
                print(rows[-1], flush=True)
    write_json(Path(args.out) / "results.json", rows)
    lines = ["| mode | base | regularizer | base ms/step | regularized ms/step | ratio | target |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        tgt = f"≤ {r['target']}×" if r["target"] else "—"
        lines.append(f"| {r['mode']} | {r['base']} | {r['regularizer']} | {r['base_ms']:.1f} | {r['reg_ms']:.1f} | "
                     f"{r['ratio']:.2f}× | {tgt} |")
    md = "\n".join(lines) + "\n"
    write_table(Path(args.out) / "results.md", md)


if __name__ == "__main__":
    main()
