"""`python -m training <command>`: prepare data, train, evaluate, list the registries."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import numpy as np

from core.atomic import write_json
from core.config import add_config_args, config_from_args
from core.errors import UserError
from core.logs import setup_logging
from evaluation.evaluator import DEFAULT_KS

from data import DataConfig, load_data

log = logging.getLogger("training")

SPEC_KEYS = ("map@r", "r_precision", "precision@1", "nmi", "f1", "n_queries", "n_skipped_queries")


def _ks(s: str) -> tuple[int, ...]:
    try:
        ks = tuple(sorted({int(v) for v in s.split(",") if v.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ks wants comma-separated integers, got {s!r}") from None
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError("--ks values must be ≥ 1")
    return ks


def flat_result(res: dict, ks) -> dict:
    out = {f"recall@{k}": res[f"recall@{k}"] for k in ks}
    out |= {k: res[k] for k in SPEC_KEYS if k in res}
    if "n_skipped_images" in res:
        out["n_skipped_images"] = res["n_skipped_images"]
    return out


# ---------------------------------------------------------------- prepare
def cmd_prepare(args) -> int:
    cfg = config_from_args(DataConfig, args)
    t0 = time.time()
    splits = load_data(cfg)
    summary = {"dataset": cfg.dataset, "root": str(splits.root), "splits": splits.split_summary(),
               "seconds": round(time.time() - t0, 2)} | {k: v for k, v in splits.info.items()}
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    return 0


# ---------------------------------------------------------------- evaluate
def cmd_evaluate(args) -> int:
    from evaluation import evaluate

    from core.arrays import load_npy

    ks = args.ks
    if args.embeddings:
        if args.checkpoint or args.backbone:
            raise UserError("give either --embeddings or --checkpoint/--backbone, not both")
        if not args.labels:
            raise UserError("--embeddings needs --labels")
        g = load_npy(args.embeddings, "embeddings")
        gl = load_npy(args.labels, "labels")
        if g.ndim != 2:
            raise UserError(f"embeddings must be a 2-D array (n × d), got shape {g.shape}")
        if gl.ndim != 1 or len(gl) != len(g):
            raise UserError(f"labels must be 1-D with {len(g)} entries, got shape {gl.shape}")
        if bool(args.query_embeddings) != bool(args.query_labels):
            raise UserError("--query-embeddings and --query-labels go together")
        try:
            if args.query_embeddings:
                q = load_npy(args.query_embeddings, "query embeddings")
                ql = load_npy(args.query_labels, "query labels")
                if q.ndim != 2 or q.shape[1] != g.shape[1]:
                    raise UserError(f"query embeddings must be n × {g.shape[1]}, got shape {q.shape}")
                if ql.ndim != 1 or len(ql) != len(q):
                    raise UserError(f"query labels must be 1-D with {len(q)} entries, got {ql.shape}")
                res = evaluate(q, ql, g, gl, ks=ks, normalize=not args.no_normalize)
            else:
                res = evaluate(g, gl, ks=ks, normalize=not args.no_normalize)
        except ValueError as e:
            raise UserError(str(e)) from None
    elif args.checkpoint or args.backbone:
        res = evaluate_model(args)
    else:
        raise UserError("nothing to evaluate: give --embeddings, --checkpoint or --backbone")
    out = flat_result(res, ks)
    if args.json:
        write_json(args.json, out)
    print(json.dumps(out, indent=2))
    return 0


def evaluate_model(args) -> dict:
    from model.backbones import build_backbone
    from model.checkpoint import load_model

    from .evaluate import evaluate_model_on_split

    cfg = config_from_args(DataConfig, args)
    if args.checkpoint:
        model, ck = load_model(args.checkpoint)
        if args.features == "trunk":
            fn = model.backbone.eval()
        else:
            fn = model.eval()
        backbone = model.backbone
    else:
        backbone = build_backbone(args.backbone, weights=args.weights)
        fn = backbone.eval()
    splits = load_data(cfg)
    return evaluate_model_on_split(fn, backbone, splits, args.split, cfg, ks=args.ks,
                                   normalize=not args.no_normalize)


# ---------------------------------------------------------------- train
def cmd_train(args) -> int:
    from .config import TrainConfig
    from .trainer import train

    cfg = config_from_args(TrainConfig, args)
    metrics = train(cfg)
    t = metrics["test"]
    print(json.dumps({"selected_epoch": metrics["selected_epoch"], "val_map@r": metrics["val"]["map@r"],
                      "test": {k: t[k] for k in ("map@r", "recall@1", "r_precision", "nmi", "f1")},
                      "run": cfg.out}, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    sp = sub.add_parser("prepare", help="render/verify a data set and print its splits")
    add_config_args(sp, DataConfig)
    sp.set_defaults(func=cmd_prepare)

    se = sub.add_parser("evaluate", help="evaluate embeddings (.npy), a checkpoint or a backbone",
                        description="Retrieval metrics (Recall@K, MAP@R, R-Precision, P@1) and "
                        "k-means NMI/F1.  Embeddings are L2-normalised and compared by cosine "
                        "unless --no-normalize (then Euclidean).")
    se.add_argument("--embeddings", help="gallery embeddings, .npy (n × d)")
    se.add_argument("--labels", help="gallery labels, .npy (n)")
    se.add_argument("--query-embeddings", help="separate query embeddings (else query = gallery, "
                    "leaving each query out)")
    se.add_argument("--query-labels")
    se.add_argument("--checkpoint", help="a trained checkpoint to evaluate on --dataset")
    se.add_argument("--features", choices=["embedding", "trunk"], default="embedding",
                    help="with --checkpoint: evaluate the neck embeddings or the trunk features")
    se.add_argument("--backbone", help="a pretrained backbone (raw trunk features) to evaluate")
    se.add_argument("--weights", default=None, help="backbone weights: imagenet | none | PATH")
    se.add_argument("--split", default="test", help="split to evaluate (default test)")
    se.add_argument("--ks", type=_ks, default=DEFAULT_KS, help="Recall@K values (default: 1,2,4,8)")
    se.add_argument("--no-normalize", action="store_true", help="compare raw vectors by L2 distance")
    se.add_argument("--json", help="write the flat metrics object here (atomically)")
    add_config_args(se, DataConfig)
    se.set_defaults(func=cmd_evaluate)

    from .config import TrainConfig

    st = sub.add_parser("train", help="train an embedding model (frozen-backbone or fine-tuning)",
                        description="Train backbone + neck W with a metric loss; select on validation "
                        "MAP@R; evaluate the selected checkpoint once on test.")
    add_config_args(st, TrainConfig)
    st.set_defaults(func=cmd_train)

    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    return args.func(args)
