"""The demo pipeline behind `make demo`: each step reuses what a previous run made.

1. prepare kanji  2. evaluate the raw pretrained trunk (and the random floor)
3. train ProxyAnchor on frozen efficientnet_lite0 features  4. evaluate it on test
5. build the demo index over the test split  6. evaluate the refinement strategies
7. launch the app (unless --no-ui)
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from core.atomic import write_json

from .config import DataConfig, load_data
from .train_config import TrainConfig

log = logging.getLogger("training.demo")
KS = (1, 2, 4, 8)


def demo_train_config(num_classes: int = 500, out: str = "runs/demo-proxy_anchor") -> TrainConfig:
    return TrainConfig(dataset="kanji", num_classes=num_classes, backbone="efficientnet_lite0",
                       loss="proxy_anchor", mode="frozen", out=out, seed=0)


def _row(name: str, res: dict) -> str:
    return (f"| {name} | {res['map@r']*100:.2f} | {res['recall@1']*100:.2f} | "
            f"{res['r_precision']*100:.2f} | {res['nmi']*100:.2f} |")


def pretrained_baselines(cfg: DataConfig, splits, cache_dir: str) -> dict:
    """Raw trunk features (through the same feature cache training uses)."""
    from evaluation import evaluate
    from model.backbones import build_backbone

    from .data.loader import transform_for
    from .embed import embed_subset
    from .feature_cache import cached_features

    out = {}
    for name, bb_name, weights in [("efficientnet_lite0 trunk, ImageNet, no training", "efficientnet_lite0", "imagenet"),
                                   ("small_cnn, random init (floor)", "small_cnn", "none")]:
        torch.manual_seed(0)
        bb = build_backbone(bb_name, weights=weights).eval()
        spec = transform_for(bb, cfg.resolved_image_size(), cfg.dataset)
        f, y, _ = cached_features(bb, splits, splits.test, spec,
                                  lambda sub, sp: embed_subset(bb, sub, sp, cfg, f"features {sub.name}"),
                                  cache_dir)
        out[name] = evaluate(f, y, ks=KS)
    return out


def run_demo(args) -> int:
    from .trainer import train_or_reuse

    t0 = time.time()
    out = Path(args.out)
    tcfg = demo_train_config(args.num_classes)
    splits = load_data(tcfg.data_config())
    log.info("kanji: %s", splits.split_summary())
    results = pretrained_baselines(tcfg.data_config(), splits, tcfg.cache_dir)
    metrics, reused = train_or_reuse(tcfg)
    results["ProxyAnchor on frozen efficientnet_lite0 (trained neck)"] = metrics["test"]
    write_json(out / "eval.json", results)
    index_dir, strategies = build_demo_index(tcfg, out)
    print("\nkanji test classes (query = gallery, leave-one-out)")
    print("| model | MAP@R | R@1 | RP | NMI |\n|---|---|---|---|---|")
    for name, res in results.items():
        print(_row(name, res))
    print(f"\ntrained run: {tcfg.out} ({'reused' if reused else 'trained now'}, "
          f"selected epoch {metrics['selected_epoch']} on validation)")
    print(f"\nrefinement strategies on the test classes ({strategies}/table.md):")
    print((Path(strategies) / "table.md").read_text())
    print(f"demo pipeline took {time.time() - t0:.1f} s; results in {out}/, index in {index_dir}")
    if args.no_ui:
        return 0
    from app.cli import build_parser, launch

    launch(build_parser().parse_args(["--index", str(index_dir), "--analysis", str(strategies)]))
    return 0


def build_demo_index(tcfg: TrainConfig, out: Path) -> tuple[Path, Path]:
    """The demo index (test split) and strategy evaluation, rebuilt only when the model changed."""
    import json

    from index.build import build_from_dataset, split_features
    from index.strategy_eval import run_evaluation
    from model.checkpoint import file_sha256

    ck = Path(tcfg.out) / "best.pt"
    sha = file_sha256(ck)
    index_dir, strat = out / "index", out / "strategies"
    try:
        built = json.loads((index_dir / "manifest.json").read_text())["checkpoint_sha256"] == sha
    except (OSError, ValueError, KeyError):
        built = False
    if built:
        log.info("reusing demo index %s", index_dir)
    else:
        build_from_dataset(ck, tcfg.data_config(), index_dir, split="test", cache_dir=tcfg.cache_dir)
    stamp = strat / "checkpoint.sha256"
    if stamp.is_file() and stamp.read_text().strip() == sha and (strat / "table.md").is_file():
        log.info("reusing strategy evaluation %s", strat)
    else:
        dcfg = tcfg.data_config()
        f, y, W = split_features(ck, dcfg, "test", tcfg.cache_dir)
        vf, vy, _ = split_features(ck, dcfg, "val", tcfg.cache_dir)
        run_evaluation(f, y, W, strat, val=(vf, vy))
        from core.atomic import write_text
        write_text(stamp, sha + "\n")
    return index_dir, strat
