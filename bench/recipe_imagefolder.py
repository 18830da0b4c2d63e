"""Issue 12 §2b: does the default fine-tuning recipe improve on the pretrained trunk on an
ImageFolder of the new user's shape (about 1,900 classes, 4–7 images each, 64 px)?

  python bench/recipe_imagefolder.py [--classes 1900] [--epochs 4] [--seeds 0] [--loss binomial]
                                     [--data DIR] [--runs DIR] [--out bench/results/recipe_imagefolder]

The user's own data set is not ours to have, so this builds one of the same shape from what
ships offline: 1,900 rendered kanji, each class a random 4–7 of the 23 fonts, written as a
plain ImageFolder (root/<class>/<image>.png) and loaded through `--dataset imagefolder` with
every data default (so the split, resize mode and augmentations are what a user of an
ImageFolder gets).  Rows, on the test classes (half of them, never seen in training):
  raw trunk             efficientnet_lite0's ImageNet features, cosine, no training
  frozen neck           the neck and loss on cached trunk features (the default mode)
  fine-tune, no probe   --mode finetune --probe-epochs 0: the recipe the issue reported
  fine-tune, default    --mode finetune: linear probe first (30 epochs), then the whole trunk
Fine-tuning runs `--epochs` epochs (the issue's 4), the loss is the issue's (Binomial).
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.atomic import atomic_dir, write_json, write_text  # noqa: E402
from core.logs import setup_logging  # noqa: E402
from training.config import TrainConfig  # noqa: E402
from training.trainer import train_or_reuse  # noqa: E402

KEYS = ("map@r", "recall@1")


def build_folder(dst: Path, classes: int, seed: int = 0) -> Path:
    """root/<codepoint>/<font>.png: `classes` kanji, a random 4–7 fonts each (rendered once)."""
    from data.kanji import KanjiConfig, prepare_kanji

    if (dst / "DONE").is_file():
        return dst
    src = prepare_kanji(KanjiConfig(root=str(ROOT / "cache" / "kanji"), num_classes=classes, image_size=64))
    rng = random.Random(seed)
    with atomic_dir(dst) as tmp:
        for d in sorted((src / "images").iterdir()):
            fonts = sorted(d.iterdir())
            (tmp / d.name).mkdir()
            for f in rng.sample(fonts, rng.randint(4, 7)):
                shutil.copyfile(f, tmp / d.name / f.name)
        (tmp / "DONE").write_text("")
    return dst


def raw_trunk(data_root: str, cache_dir: str) -> dict:
    """The demo's raw-trunk baseline (same feature cache), on this folder's test classes."""
    from data import DataConfig, load_data
    from data.config import resolve
    from demo.pipeline import pretrained_baselines

    dcfg = DataConfig(dataset="imagefolder", data_root=data_root)
    splits = load_data(dcfg, progress=False)
    return pretrained_baselines(resolve(dcfg, splits), splits, cache_dir)["efficientnet_lite0 trunk, ImageNet, no training"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--classes", type=int, default=1900, help="classes in the folder (default: %(default)s)")
    ap.add_argument("--epochs", type=int, default=4, help="fine-tuning epochs (default: %(default)s)")
    ap.add_argument("--seeds", default="0", help="training seeds (default: %(default)s)")
    ap.add_argument("--loss", default="binomial", help="metric loss (default: %(default)s)")
    ap.add_argument("--data", default="cache/imagefolder-kanji1900", help="where the folder is built (default: %(default)s)")
    ap.add_argument("--runs", default="runs/bench-recipe-imagefolder", help="run folders, reused when finished "
                                                                             "(default: %(default)s)")
    ap.add_argument("--out", default="bench/results/recipe_imagefolder", help="results folder (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default) (default: %(default)s)")
    args = ap.parse_args()
    setup_logging()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    root = str(build_folder(Path(args.data), args.classes))
    cache = "cache/features"
    rows = [{"model": "raw trunk (ImageNet, cosine)", "epochs": 0, "val": [],
             **{k: [v] for k, v in raw_trunk(root, cache).items() if k in KEYS}, "seconds": [0.0]}]
    base = dict(dataset="imagefolder", data_root=root, loss=args.loss, progress=False, device="cpu", cache_dir=cache)
    for name, key, kw in [("frozen neck", "frozen", dict(epochs=30)),
                          ("fine-tune, no probe (--probe-epochs 0)", "ft-noprobe",
                           dict(mode="finetune", epochs=args.epochs, probe_epochs=0)),
                          ("fine-tune, default (probe 30 epochs, then all stages)", "ft-default",
                           dict(mode="finetune", epochs=args.epochs))]:
        r = {"model": name, "epochs": kw["epochs"], **{k: [] for k in KEYS}, "val": [], "seconds": []}
        for s in [int(v) for v in args.seeds.split(",")]:
            out = f"{args.runs}/{args.loss}-{key}-s{s}"
            m, _ = train_or_reuse(TrainConfig(out=out, seed=s, **base, **kw))
            r["seconds"].append(m["train_seconds"])
            r["val"].append(m["val"]["map@r"])
            for k in KEYS:
                r[k].append(m["test"][k])
            log = [json.loads(x) for x in (Path(out) / "log.jsonl").read_text().splitlines()]
            r.setdefault("val_curve", []).append([round(h["val_map@r"] * 100, 2) for h in log])
            print(key, s, {k: round(r[k][-1] * 100, 2) for k in KEYS}, flush=True)
        rows.append(r)

    def fmt(v):
        v = np.asarray(v) * 100
        return "—" if not len(v) else (f"{v.mean():.2f}" if len(v) == 1 else f"{v.mean():.2f} ± {v.std():.2f}")

    lines = ["| model | epochs | val MAP@R | test MAP@R | test R@1 | val MAP@R per epoch (0: probe) | train s/run |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        curve = "; ".join(", ".join(map(str, c)) for c in r.get("val_curve", [])) if r["model"] != "frozen neck" else ""
        lines.append(f"| {r['model']} | {r['epochs']} | {fmt(r['val'])} | {fmt(r['map@r'])} | {fmt(r['recall@1'])} | "
                     f"{curve} | {np.mean(r['seconds']):.0f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "results.md", "\n".join(lines) + "\n")
    write_json(out / "results.json", rows)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
