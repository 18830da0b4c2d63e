"""EfficientNet-Lite0, Lite1 and Lite2 under the demo's recipe, and the tail's cost on timm trunks.

  python bench/lite_trunks.py [--data kanji,imagefolder] [--backbones efficientnet_lite0,...]
                              [--tail-epochs 6] [--threads 1] [--cache-dir DIR] [--runs DIR]
                              [--out bench/results/lite_trunks] [--cost timm:vit_tiny_patch16_224,...]

Per data set and backbone (ImageNet weights), seed 0, test
classes: the raw trunk (cosine), the frozen neck (ProxyAnchor, 30 epochs) and the demo's trained
tail (the last 2 stages, a 30-epoch probe, then --tail-epochs epochs).  Data: `kanji` is the
demo's (500 classes, 64 px); `imagefolder` is bench/recipe_imagefolder.py's kanji ImageFolder
(1,900 classes, a random 4–7 of the 23 fonts each, 64 px, every ImageFolder default).
`--cost`: randomly initialised trunks (no MAP@R claim) on kanji: bytes per image of the 2-stage
tail's cached prefix and the tail's training images/s over one epoch, beside Lite0's.
Rows are reused from OUT/rows.json when present (delete it to measure again).
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from pathlib import Path

from common import ROOT

from core.atomic import write_json, write_text
from core.logs import setup_logging

KEYS = ("map@r", "recall@1")


def data_kwargs(name: str, kanji_root: str) -> dict:
    if name == "kanji":
        return dict(dataset="kanji", data_root=kanji_root)
    from recipe_imagefolder import build_kanji_folder

    root = build_kanji_folder(Path(kanji_root).parent / "imagefolder-kanji1900", 1900)
    return dict(dataset="imagefolder", data_root=str(root))


def raw_row(backbone: str, dkw: dict, cache_dir: str) -> dict:
    """The raw trunk on test; as the demo does, one pass over every split also stores the features and
    the 2-stage tail's prefix maps, which the frozen and tail runs then read (seconds: that pass)."""
    from data import DataConfig, load_data
    from data.config import resolve
    from evaluation import evaluate
    from model.backbones import build_backbone
    from model.features import backbone_features
    from model.preprocess import transform_for

    cfg = DataConfig(**dkw)
    splits = load_data(cfg, progress=False)
    cfg = resolve(cfg, splits)
    t = time.perf_counter()
    bb = build_backbone(backbone).eval()
    spec = transform_for(bb, cfg)
    n = len(bb.stages()) - 2
    for sub in (splits.train, splits.val):
        backbone_features(bb, splits, sub, spec, cfg, cache_dir, progress=False, prefix_stages=n)
    f, y, _ = backbone_features(bb, splits, splits.test, spec, cfg, cache_dir, progress=False, prefix_stages=n)
    res = evaluate(f, y, ks=(1,))
    return {k: res[k] for k in KEYS} | {"seconds": time.perf_counter() - t, "image_size": cfg.image_size}


def train_row(backbone: str, dkw: dict, mode: str, args) -> dict:
    from training.config import TrainConfig
    from training.trainer import train_or_reuse

    kw = dict(mode="tail", train_blocks=2, epochs=args.tail_epochs) if mode == "tail" else dict(mode="frozen")
    tag = dkw["dataset"]
    cfg = TrainConfig(out=f"{args.runs}/{tag}-{backbone}-{mode}", backbone=backbone, loss="proxy_anchor", seed=0,
                      device="cpu", progress=False, cache_dir=args.cache_dir, threads=args.threads, **dkw, **kw)
    t = time.perf_counter()
    m, _ = train_or_reuse(cfg)
    return {k: m["test"][k] for k in KEYS} | {"seconds": time.perf_counter() - t, "train_seconds": m["train_seconds"],
                                              "val": m["val"]["map@r"], "selected_epoch": m["selected_epoch"]}


def cost_row(backbone: str, kanji_root: str, args) -> dict:
    """Prefix bytes per image and one tail epoch's training images/s (random init for timm trunks)."""
    import tempfile

    from training.config import TrainConfig
    from training.tensorboard import RunBoard
    from training.trainer import Run

    weights = None if backbone.startswith("efficientnet") else "none"
    with tempfile.TemporaryDirectory() as tmp:
        r = Run(TrainConfig(out=f"{tmp}/run", dataset="kanji", data_root=kanji_root, backbone=backbone, weights=weights,
                            loss="proxy_anchor", mode="tail", train_blocks=2, probe_epochs=0, progress=False,
                            device="cpu", cache_dir=args.cache_dir, threads=args.threads))
        r.setup()
        r.board = RunBoard(Path(tmp), enabled=False)
        pc = r.source.cache["train"]
        n = len(pc.labels)
        t = time.perf_counter()
        r.train_epoch(0)
        s = time.perf_counter() - t
        return {"prefix_bytes_per_image": int(pc.maps.nbytes // n), "prefix_shape": list(pc.maps.shape[1:]),
                "prefix_dtype": str(pc.maps.dtype), "images": n, "epoch_seconds": s, "images_per_s": n / s,
                "stages": [name for name, _ in r.backbone.stages()]}


def speed_rows(backbones: list[str], kanji_root: str, rounds: int = 3) -> dict:
    """Forward images/s of each trunk on the same 960 kanji test images (64 px, batches of 120),
    the backbones alternating for `rounds` rounds so that machine load hits each alike; the median."""
    import statistics

    import torch

    from data import DataConfig, load_data
    from data.loader import ImageDataset
    from model.backbones import build_backbone
    from model.preprocess import transform_for

    cfg = DataConfig(dataset="kanji", data_root=kanji_root)
    splits = load_data(cfg, progress=False)
    nets = {b: build_backbone(b).eval() for b in backbones}
    ds = ImageDataset(splits.test, transform_for(nets[backbones[0]], cfg).build())
    x = torch.stack([ds[i][0] for i in range(960)])
    times: dict[str, list[float]] = {b: [] for b in backbones}
    with torch.inference_mode():
        for _ in range(rounds + 1):  # the first round warms up
            for b, bb in nets.items():
                t = time.perf_counter()
                for i in range(0, len(x), 120):
                    bb(x[i: i + 120])
                times[b].append(time.perf_counter() - t)
    return {b: {"images_per_s": len(x) / statistics.median(t[1:]), "seconds": t[1:]} for b, t in times.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="kanji,imagefolder", help="data sets (default: %(default)s)")
    ap.add_argument("--backbones", default="efficientnet_lite0,efficientnet_lite1,efficientnet_lite2",
                    help="backbones (default: %(default)s)")
    ap.add_argument("--rows", default="raw,frozen,tail", help="rows (default: %(default)s)")
    ap.add_argument("--tail-epochs", type=int, default=6,
                    help="the tail's epochs after its probe (default: %(default)s)")
    ap.add_argument("--cost", default="efficientnet_lite0,timm:vit_tiny_patch16_224,timm:convnext_atto",
                    help="backbones whose tail cost to time on kanji ('' for none) (default: %(default)s)")
    ap.add_argument("--speed", action="store_true", help="also time the --backbones' forward pass on 960 kanji "
                                                         "images, alternating (default: off)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    ap.add_argument("--cache-dir", default=str(ROOT / "cache" / "features"),
                    help="feature caches (default: %(default)s)")
    ap.add_argument("--kanji-root", default=str(ROOT / "cache" / "kanji"),
                    help="the rendered kanji (default: %(default)s)")
    ap.add_argument("--runs", default="runs/bench-lite-trunks", help="run folders, reused (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/lite_trunks", help="results folder (default: %(default)s)")
    args = ap.parse_args()
    setup_logging()
    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    rows_path = out / "rows.json"
    import json

    done = json.loads(rows_path.read_text()) if rows_path.is_file() else {}
    command = f"python bench/lite_trunks.py {shlex.join(sys.argv[1:])}"

    def save():
        write_json(rows_path, done)

    for d in [x for x in args.data.split(",") if x]:
        dkw = data_kwargs(d, args.kanji_root)
        for b in [x for x in args.backbones.split(",") if x]:
            for row in [x for x in args.rows.split(",") if x]:
                key = f"{d}/{b}/{row}"
                if key in done:
                    continue
                res = raw_row(b, dkw, args.cache_dir) if row == "raw" else train_row(b, dkw, row, args)
                done[key] = res | {"date": str(datetime.date.today()), "command": command}
                print(key, {k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()}, flush=True)
                save()
    for b in [x for x in args.cost.split(",") if x]:
        key = f"cost/{b}"
        if key not in done:
            done[key] = cost_row(b, args.kanji_root, args) | {"date": str(datetime.date.today()), "command": command}
            print(key, done[key], flush=True)
            save()
    if args.speed:
        for b, r in speed_rows([x for x in args.backbones.split(",") if x], args.kanji_root).items():
            done[f"speed/{b}"] = r | {"date": str(datetime.date.today()), "command": command}
            print(f"speed/{b}", done[f"speed/{b}"], flush=True)
        save()
    write_text(out / "results.md", table(done, args.threads))
    print(table(done, args.threads))


def table(done: dict, threads: int) -> str:
    names = {"raw": "raw trunk (ImageNet, cosine)", "frozen": "frozen neck (30 epochs)",
             "tail": "trained tail (last 2 stages: probe 30, then the tail)"}
    lines = [f"Seed 0, test classes, ProxyAnchor; {os.cpu_count()} CPU cores shared with other jobs, torch threads "
             f"{threads}; s: wall seconds of the row (raw: one pass over every split that also stores the features "
             "and the tail's prefix maps, as the demo does; training rows: the run, reading those caches).", "",
             "Measured by (product installed from this checkout; dates in rows.json):", "",
             *[f"- {d} `{c}`" for d, c in dict.fromkeys((r["date"], r["command"]) for r in done.values())], "",
             "| data | backbone | model | test MAP@R | test R@1 | s |", "|---|---|---|---|---|---|"]
    order = {"kanji": 0, "imagefolder": 1, "raw": 0, "frozen": 1, "tail": 2}
    rows = sorted((k.split("/") for k in done if not k.startswith(("cost/", "speed/"))),
                  key=lambda k: (order.get(k[0], 9), k[1], order[k[2]]))
    for d, b, row in rows:
        r = done[f"{d}/{b}/{row}"]
        lines.append(f"| {d} | {b} | {names[row]} | {r['map@r'] * 100:.2f} | {r['recall@1'] * 100:.2f} | "
                     f"{r['seconds']:.0f} |")
    speed = {k[6:]: v for k, v in done.items() if k.startswith("speed/")}
    if speed:
        ref = next(iter(speed.values()))["images_per_s"]
        lines += ["", "| backbone | trunk forward images/s (kanji, 64 px, batch 120, median of 3 alternating rounds) "
                      "| against the first |", "|---|---|---|"]
        lines += [f"| {b} | {r['images_per_s']:.0f} | {r['images_per_s'] / ref:.2f}× |" for b, r in speed.items()]
    cost = {k[5:]: v for k, v in done.items() if k.startswith("cost/")}
    if cost:
        lines += ["", "| backbone (kanji, 64 px, tail = last 2 stages) | prefix map per image | bytes per image | "
                      "tail training images/s |", "|---|---|---|---|"]
        for b, r in cost.items():
            lines.append(f"| {b} | {r['prefix_dtype']} {'×'.join(map(str, r['prefix_shape']))} | "
                         f"{r['prefix_bytes_per_image']:,} | {r['images_per_s']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
