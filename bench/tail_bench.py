"""Trained trunks on kanji, mean ± std over seeds, and the tail/fine-tune cost ratio.

  python bench/tail_bench.py [--seeds 0,1,2] [--out bench/results/tail] [--runs runs/bench-tail]

ProxyAnchor on efficientnet_lite0 (ImageNet), 64-px kanji, selected on validation
classes, tested once.  Rows: the frozen neck; a trained tail of the last N = 1, 2, 3
stages over the cached frozen prefix (BatchNorm statistics frozen: the default for
pretrained weights); full fine-tuning on augmented images.  Epoch counts differ by
row (the CPU budget); each row says its own.  The small CNN from scratch is in
bench/train_bench.py.  The ratio compares the median epoch time (training plus
validation, from each run's log.jsonl) of the N = 2 tail against full fine-tuning,
measured in this one run.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from common import pm, timed, write_table

from core.atomic import write_json
from core.logs import setup_logging
from training.config import TrainConfig
from training.trainer import train_or_reuse

KEYS = ("map@r", "recall@1")
ROWS = [("frozen neck", "frozen", dict(), 30),
        ("trained tail, N = 1 (head conv)", "tail1", dict(train_blocks=1), 30),
        ("trained tail, N = 2 (+ blocks6)", "tail2", dict(train_blocks=2), 20),
        ("trained tail, N = 3 (+ blocks5)", "tail3", dict(train_blocks=3), 10),
        ("full fine-tune, no probe (`--probe-epochs 0`)", "finetune_noprobe", dict(mode="finetune", probe_epochs=0), 3),
        ("full fine-tune (augmented; 30-epoch probe first)", "finetune", dict(mode="finetune"), 3),
        # the same run with each crop cut from its decoded original in the loader (docs/fidelity.md, augmentation)
        ("full fine-tune, crops in the loader (`--image-cache off`)", "finetune_loader",
         dict(mode="finetune", image_cache="off"), 3)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2", help="training seeds (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/tail", help="results folder (default: %(default)s)")
    ap.add_argument("--runs", default="runs/bench-tail",
                    help="run folders, reused when finished (default: %(default)s)")
    ap.add_argument("--rows", default=",".join(r[1] for r in ROWS), help="which rows (default: %(default)s)")
    ap.add_argument("--epoch-ratio", action="store_true",
                    help="only time training epochs of the N = 2 tail and of full fine-tuning, alternating "
                         "(tail, fine-tune, tail, fine-tune) in this one process, and report the ratio")
    args = ap.parse_args()
    setup_logging()
    if args.epoch_ratio:
        return epoch_ratio(Path(args.out))
    seeds = [int(s) for s in args.seeds.split(",")]
    wanted = args.rows.split(",")
    rows, epoch_s = [], {}
    for name, key, kw, epochs in [r for r in ROWS if r[1] in wanted]:
        r = {"model": name, "key": key, "epochs": epochs, **{k: [] for k in KEYS}, "seconds": [], "val": []}
        for s in seeds:
            out = f"{args.runs}/proxy_anchor-{key}-s{s}"
            cfg = TrainConfig(out=out, seed=s, loss="proxy_anchor", epochs=epochs, progress=False, device="cpu", **kw)
            m, _ = train_or_reuse(cfg)
            r["seconds"].append(m["train_seconds"])
            r["val"].append(m["val"]["map@r"])
            for k in KEYS:
                r[k].append(m["test"][k])
            log = [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]
            epoch_s.setdefault(key, []).extend(h["seconds"] for h in log if h["epoch"] > 0)  # 0: the probe
            print(key, s, {k: round(r[k][-1] * 100, 2) for k in KEYS}, flush=True)
        rows.append(r)

    out = Path(args.out)
    lines = ["| model | epochs | val MAP@R | test MAP@R | test R@1 | train s/run |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['epochs']} | {pm(r['val'])} | {pm(r['map@r'])} | {pm(r['recall@1'])} | "
                     f"{np.mean(r['seconds']):.0f} |")
    ratio = None
    if "tail2" in epoch_s and "finetune" in epoch_s:
        t, f = float(np.median(epoch_s["tail2"])), float(np.median(epoch_s["finetune"]))
        ratio = {"tail2_epoch_s": t, "finetune_epoch_s": f, "ratio": t / f}
        lines += ["", f"Median epoch (training + validation): tail N = 2 {t:.1f} s, full fine-tune {f:.1f} s: "
                      f"the tail epoch takes **{t / f:.2f}×** the fine-tune epoch."]
    # a subset of the rows gets its own files: it must not replace the whole table
    stem = "results" if set(wanted) >= {r[1] for r in ROWS} else "results_" + "_".join(wanted)
    write_json(out / f"{stem}.json", {"seeds": seeds, "rows": rows, "epoch_ratio": ratio})
    md = "\n".join(lines) + "\n"
    write_table(out / f"{stem}.md", md)


def epoch_ratio(out: Path) -> None:
    """One training epoch (no validation) of each, twice, alternating so machine load hits both alike."""
    import tempfile

    from training.trainer import Run

    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for key, kw in (("tail2", dict(train_blocks=2)), ("finetune", dict(mode="finetune"))):
            r = Run(TrainConfig(out=f"{tmp}/{key}", loss="proxy_anchor", progress=False, device="cpu", probe_epochs=0,
                                **kw))  # epoch time only: no probe
            r.setup()
            runs[key] = r
        times = {k: [] for k in runs}
        for rep in range(2):
            for k, r in runs.items():
                times[k].append(timed(lambda r=r, rep=rep: r.train_epoch(rep))[1])
                print(k, rep, round(times[k][-1], 1), flush=True)
    t, f = float(np.median(times["tail2"])), float(np.median(times["finetune"]))
    res = {"tail2_epoch_s": times["tail2"], "finetune_epoch_s": times["finetune"], "ratio": t / f}
    write_json(out / "epoch_ratio.json", res)
    md = (f"One training epoch (4,600 images, batch 120, ProxyAnchor), median of 2, alternating: tail N = 2 "
          f"{t:.1f} s, full fine-tune {f:.1f} s: the tail epoch takes **{t / f:.2f}×** the fine-tune epoch "
          f"({f / t:.1f}× faster).\n")
    write_table(out / "epoch_ratio.md", md)


if __name__ == "__main__":
    main()
