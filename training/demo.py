"""The demo pipeline behind `make demo`: each step reuses what a previous run made."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from core.atomic import write_json

from .config import DataConfig, load_data

log = logging.getLogger("training.demo")


def _row(name: str, res: dict) -> str:
    return (f"| {name} | {res['map@r']*100:.2f} | {res['recall@1']*100:.2f} | "
            f"{res['r_precision']*100:.2f} | {res['nmi']*100:.2f} |")


def run_demo(args) -> int:
    from model.backbones import build_backbone

    from .embed import backbone_fn, evaluate_model_on_split

    t0 = time.time()
    out = Path(args.out)
    cfg = DataConfig(dataset="kanji", num_classes=args.num_classes)
    splits = load_data(cfg)
    log.info("kanji: %s", splits.split_summary())
    ks = (1, 2, 4, 8)
    results = {}
    torch.manual_seed(0)
    for name, bb_name, weights in [("efficientnet_lite0 trunk (ImageNet, no training)", "efficientnet_lite0", "imagenet"),
                                   ("small_cnn, random init (floor)", "small_cnn", "none")]:
        bb = build_backbone(bb_name, weights=weights)
        results[name] = evaluate_model_on_split(backbone_fn(bb), bb, splits, "test", cfg, ks=ks)
    write_json(out / "eval_pretrained.json", results)
    print("\nkanji test classes (query = gallery, leave-one-out)")
    print("| model | MAP@R | R@1 | RP | NMI |\n|---|---|---|---|---|")
    for name, res in results.items():
        print(_row(name, res))
    print(f"\ndemo pipeline took {time.time() - t0:.1f} s; results in {out}/")
    return 0
