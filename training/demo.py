"""The demo pipeline behind `make demo`: each step reuses what a previous run made.

1. prepare kanji  2. evaluate the raw pretrained trunk (and the random floor)
3. train ProxyAnchor on frozen efficientnet_lite0 features  4. evaluate it on test
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
    print("\nkanji test classes (query = gallery, leave-one-out)")
    print("| model | MAP@R | R@1 | RP | NMI |\n|---|---|---|---|---|")
    for name, res in results.items():
        print(_row(name, res))
    print(f"\ntrained run: {tcfg.out} ({'reused' if reused else 'trained now'}, "
          f"selected epoch {metrics['selected_epoch']} on validation)")
    print(f"demo pipeline took {time.time() - t0:.1f} s; results in {out}/")
    return 0
