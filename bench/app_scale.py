"""The app on a 10⁶-item on-disk IVF: the gallery this bench serves, then the load bench on it.

  python bench/app_scale.py prep [--n 1000000] [--workdir /tmp/app_scale] [--threads 1]
  python bench/app_scale.py measure [--workdir /tmp/app_scale] [--sample 100] [--out bench/results/app_scale.json]
  python bench/app_load.py --backend ondisk --index WORKDIR/index --ivf WORKDIR/ivf ...

`prep` trains a tiny model (small CNN, 12 kanji classes, one epoch, as the tests' fixture),
indexes its test split (real images: the load bench's queries), and writes an index directory
of N items: those, then synthetic distractors (d = 128 trunk features: unit vectors around
1,000 class centres, labels 1000…1999, no image: an empty relative_path).  The index's
FAISS file is an exact Flat (written, never loaded: the app serves the on-disk IVF built over
the same features.npy next, `build_for_index`).  Nothing is downloaded.
`measure` opens the service on that IVF in this process (the app's work without Gradio and its
imports) and times each of its operations once: start-up, an item query's two panels with
their APs, the why panel, the Compare tab on a sample, the maps; RSS after each.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

CLASSES, FIRST_LABEL = 1000, 1000


def prep(args) -> dict:
    from core.flags import apply_threads

    apply_threads(args.threads)
    from index.backends.ondisk import build_for_index
    from index.backends.store import Items, read_index, write_index
    from index.build import build_from_dataset
    from training.config import TrainConfig
    from training.trainer import train

    w = Path(args.workdir)
    w.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    cfg = TrainConfig(dataset="kanji", data_root=str(w / "kanji"), num_classes=12, image_size=32,
                      kanji_fonts=("ipag", "ipam", "seto", "ukai"), backbone="small_cnn", weights="none",
                      embed_dim=32, epochs=1, batch_size=8, m_per_class=4, out=str(w / "run"),
                      cache_dir=str(w / "cache"), progress=False)
    if not (Path(cfg.out) / "best.pt").exists():
        train(cfg)
    small = w / "small_index"
    if not (small / "manifest.json").exists():
        build_from_dataset(Path(cfg.out) / "best.pt", cfg.data_config(), small, progress=False)
    data = read_index(small)
    real = np.asarray(data.features, dtype=np.float32)
    n_syn = args.n - len(real)
    rng = np.random.default_rng(0)
    d = real.shape[1]
    centres = rng.standard_normal((CLASSES, d)).astype(np.float32)
    feats = np.empty((args.n, d), dtype=np.float32)
    feats[: len(real)] = real
    labels = np.empty(n_syn, dtype=np.int64)
    for s in range(0, n_syn, 262_144):
        m = min(262_144, n_syn - s)
        c = rng.integers(0, CLASSES, m)
        x = centres[c] + 1.5 * rng.standard_normal((m, d)).astype(np.float32)
        feats[len(real) + s: len(real) + s + m] = x / np.linalg.norm(x, axis=1, keepdims=True)
        labels[s: s + m] = FIRST_LABEL + c
    ids = np.concatenate([data.items.ids, 10_000_000 + np.arange(n_syn, dtype=np.int64)])
    items = Items(ids, np.concatenate([data.items.labels, labels]), data.items.paths + [""] * n_syn,
                  data.items.splits + ["distractor"] * n_syn)
    info = {k: v for k, v in data.manifest.items() if k in ("checkpoint", "checkpoint_sha256", "backbone",
                                                             "transform", "dataset", "split", "data")}
    names = dict(data.class_names) | {FIRST_LABEL + c: f"distractor {c}" for c in range(CLASSES)}
    big = w / "index"
    write_index(big, feats, items, data.W, normalize=True, info=info, factory="Flat", class_names=names,
                root=data.root)
    del feats
    t1 = time.perf_counter()
    # cosine mode searches each strategy's own cosine lists: those of every cosine strategy that
    # app_load.py and `measure` serve (shrink and spectral at 0.5, as app_load sends them)
    build_for_index(big, w / "ivf", cosine_for=(("trained", {}), ("identity", {}), ("shrink", {"alpha": 0.5}),
                                                ("spectral", {"p": 0.5})))
    out = {"n": args.n, "real_items": len(real), "dim": d, "index": str(big), "ivf": str(w / "ivf"),
           "prep_s": round(t1 - t0, 1), "ivf_build_s": round(time.perf_counter() - t1, 1)}
    (w / "prep.json").write_text(json.dumps(out, indent=1))
    print(out)
    return out


def rss_mb() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = round(int(line.split()[1]) / 1024, 1)
    return out


def measure(args) -> dict:
    from core.flags import apply_threads

    apply_threads(args.threads)
    from app.backend import open_served
    from app.service import RetrievalService, SearchConfig
    from index.threads import serving_threads

    serving_threads(args.threads)
    w = Path(args.workdir)
    steps: dict = {"before": {"s": 0.0, "rss_mb": rss_mb()}}

    def step(name, fn):
        t = time.perf_counter()
        out = fn()
        steps[name] = {"s": round(time.perf_counter() - t, 3), "rss_mb": rss_mb()}
        return out

    svc = step("start (open the IVF, read the items, load the model)",
               lambda: RetrievalService(served=open_served("ondisk", ivf=w / "ivf"), compare_sample=args.sample))
    real = [int(i) for i, p in zip(svc.data.items.ids, svc.data.items.paths, strict=True) if p]
    distractor = int(svc.data.items.ids[-1])
    right = SearchConfig("spectral", {"p": 0.5}, "cosine")
    for name, item in (("a real item", real[3]), ("a distractor (R ≈ 1,000)", distractor)):
        q = svc.query_from_item(item)
        pair = step(f"both panels with their AP, {name}", lambda q=q: svc.compare(q, right, 12))
        target = pair[1].results[2]["id"]
        step(f"why, {name}", lambda q=q, t=target: svc.why(q, t, right))
    cmp = step(f"Compare on a sample of {args.sample} queries", lambda: svc.comparison(right, seed=0))
    step("Compare again (both sides cached)", lambda: svc.comparison(right, seed=0))
    step("gallery map (10,000 items)", lambda: svc.gallery_map())
    step("2-D maps, PCA, both sides", lambda: [svc.map_html(c, "PCA", "m") for c in (SearchConfig(), right)])
    out = {"n": len(svc.data.items), "threads": args.threads, "loadavg_1_5_15": list(os.getloadavg()),
           "compare_summary": cmp.summary_text(), "steps": steps,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, ensure_ascii=False))
    print(json.dumps(out, indent=1, ensure_ascii=False))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prep", help="write the index directory and its on-disk IVF")
    p.add_argument("--n", type=int, default=1_000_000, help="gallery items (default: %(default)s)")
    p.add_argument("--workdir", default="/tmp/app_scale", help="where (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch and FAISS threads (default: %(default)s)")
    m = sub.add_parser("measure", help="time the service's operations on the prepared gallery")
    m.add_argument("--workdir", default="/tmp/app_scale", help="prep's folder (default: %(default)s)")
    m.add_argument("--sample", type=int, default=100, help="Compare's sample size (default: %(default)s)")
    m.add_argument("--threads", type=int, default=1, help="torch and FAISS threads (default: %(default)s)")
    m.add_argument("--out", default="bench/results/app_scale.json", help="(default: %(default)s)")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    (prep if args.cmd == "prep" else measure)(args)


if __name__ == "__main__":
    main()
