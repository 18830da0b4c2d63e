"""`python -m training <command>`: prepare data, train, evaluate, list the registries."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.atomic import write_json
from core.cli import command_parser
from core.config import add_config_args, config_from_args, parse_with_config_file
from core.errors import UserError
from core.logs import setup_logging
from core.params import param
from core.registry import Registry
from data import DataConfig, load_data
from data.config import resolve
from data.registry import DATASETS
from evaluation.evaluator import DEFAULT_KS
from model.backbones import BACKBONES
from model.device import DEVICE_HELP, resolve_device

from .config import TrainConfig, as_in_train
from .losses import LOSSES
from .regularizers import REGULARIZERS

log = logging.getLogger("training")

SPEC_KEYS = ("map@r", "r_precision", "precision@1", "nmi", "f1", "n_classes", "n_queries", "n_skipped_queries")
REGISTRIES: dict[str, Registry[Any]] = {"backbones": BACKBONES, "datasets": DATASETS, "losses": LOSSES,
                                        "regularizers": REGULARIZERS}
CHOICES = {"dataset": DATASETS, "backbone": BACKBONES, "loss": LOSSES, "regularizer": REGULARIZERS}
# data settings that change what a checkpoint's evaluation measures (not where the data lies or how fast)
RESULT_DATA_FIELDS = ("dataset", "num_classes", "image_size", "resize_mode", "data_seed", "val_fraction",
                      "kanji_fonts")


@dataclass
class CommandOptions:
    """Settings of `evaluate` with the same meaning and help as on `train` (and the device to embed on)."""
    cache_dir: str = as_in_train("cache_dir")
    threads: int = as_in_train("threads")
    progress: bool = as_in_train("progress")
    device: str = param("auto", DEVICE_HELP)


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
    for k in ("n_skipped_images", "image_size", "resize_mode"):
        if k in res:
            out[k] = res[k]
    return out


def summary_line(name: str, res: dict) -> str:
    """'test (956 classes, 4,780 queries): MAP@R 0.1234 · R@1 0.5678 · RP 0.2345'."""
    return (f"{name} ({res['n_classes']:,} classes, {res['n_queries']:,} queries): MAP@R {res['map@r']:.4f} · "
            f"R@1 {res['recall@1']:.4f} · RP {res['r_precision']:.4f}")


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count for this command only (0: leave torch's default)."""
    import torch

    saved = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


# ---------------------------------------------------------------- prepare
def cmd_prepare(args, argv) -> int:
    cfg = config_from_args(DataConfig, args)
    t0 = time.time()
    splits = load_data(cfg)
    summary = {"dataset": cfg.dataset, "root": str(splits.root), "splits": splits.split_summary(),
               "seconds": round(time.time() - t0, 2)} | {k: v for k, v in splits.info.items()}
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    return 0


# ---------------------------------------------------------------- evaluate
def _load_pair(emb_path, labels_path, what: str, dim: int | None = None):
    from core.arrays import load_npy

    e = load_npy(emb_path, f"{what}embeddings")
    y = load_npy(labels_path, f"{what}labels")
    if e.ndim != 2 or (dim is not None and e.shape[1] != dim):
        raise UserError(f"{what}embeddings must be a 2-D array (n × {dim or 'd'}), got shape {e.shape}")
    if y.ndim != 1 or len(y) != len(e):
        raise UserError(f"{what}labels must be 1-D with {len(e)} entries, got shape {y.shape}")
    return e, y


def evaluate_arrays(args) -> dict:
    from evaluation import evaluate

    if args.checkpoint or args.backbone:
        raise UserError("give either --embeddings or --checkpoint/--backbone, not both")
    if not args.labels:
        raise UserError("--embeddings needs --labels")
    if bool(args.query_embeddings) != bool(args.query_labels):
        raise UserError("--query-embeddings and --query-labels go together")
    g, gl = _load_pair(args.embeddings, args.labels, "")
    if args.query_embeddings:
        q, ql = _load_pair(args.query_embeddings, args.query_labels, "query ", g.shape[1])
        res = evaluate(q, ql, g, gl, ks=args.ks, normalize=not args.no_normalize)
    else:
        ql = gl
        res = evaluate(g, gl, ks=args.ks, normalize=not args.no_normalize)
    return res | {"n_classes": len(np.unique(ql))}


def checkpoint_data(args, argv, ck) -> DataConfig:
    """The checkpoint's recorded data settings, with those given on the command line instead;
    a given setting that changes what is measured gets one warning line."""
    from model.checkpoint import recorded_data

    recorded = recorded_data(ck)
    names = [f.name for f in dataclasses.fields(DataConfig)]
    unset = object()
    probe = build_parser({"evaluate": {n: unset for n in names}}).parse_args(argv)
    given = {n: getattr(args, n) for n in names if getattr(probe, n) is not unset}
    for n, v in given.items():
        if n in RESULT_DATA_FIELDS and v != getattr(recorded, n):
            flag = "--" + n.replace("_", "-")
            print(f"warning: {flag} {v} differs from the checkpoint's {getattr(recorded, n)}; the results "
                  "measure the model on other data than it was trained and selected on", file=sys.stderr)
    return dataclasses.replace(recorded, **given)


def evaluate_model(args, argv) -> dict:
    from model.backbones import build_backbone
    from model.checkpoint import load_model

    from .evaluate import evaluate_model_on_split

    if args.checkpoint and args.backbone:
        raise UserError("give either --checkpoint or --backbone, not both")
    device = resolve_device(args.device)
    if args.checkpoint:
        model, ck = load_model(args.checkpoint)
        cfg = checkpoint_data(args, argv, ck)
        trunk = args.features == "trunk"
        backbone = model.backbone
        fn = backbone if trunk else model
    else:
        from model.backbones.registry import sized_for

        cfg = sized_for(config_from_args(DataConfig, args), args.backbone)
        backbone = fn = build_backbone(args.backbone, weights=args.weights)
        trunk = True
    splits = load_data(cfg, progress=args.progress)
    if not args.checkpoint:  # the image size and resize mode `train` would resolve on this data
        cfg = resolve(cfg, splits)
    res = evaluate_model_on_split(fn.eval().to(device), backbone, splits, args.split, cfg, ks=args.ks,
                                  normalize=not args.no_normalize, progress=args.progress,
                                  cache_dir=args.cache_dir if trunk else None, device=device)
    return res | {"image_size": cfg.resolved_image_size(), "resize_mode": cfg.resolved_resize_mode()}


def cmd_evaluate(args, argv) -> int:
    if args.embeddings:
        res = evaluate_arrays(args)
    elif args.checkpoint or args.backbone:
        with torch_threads(args.threads):
            res = evaluate_model(args, argv)
    else:
        raise UserError("nothing to evaluate: give --embeddings, --checkpoint or --backbone")
    out = flat_result(res, args.ks)
    if args.json:
        write_json(args.json, out)
    print(summary_line(args.split if not args.embeddings else "embeddings", res), file=sys.stderr)
    print(json.dumps(out, indent=2))
    return 0


# ---------------------------------------------------------------- train
def cmd_train(args, argv) -> int:
    from .trainer import train

    cfg = config_from_args(TrainConfig, args)
    with torch_threads(cfg.threads):
        metrics = train(cfg)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun rank 0 reports (and writes --json)
        return 0
    t = metrics["test"]
    out = {"selected_epoch": metrics["selected_epoch"], "val_map@r": metrics["val"]["map@r"],
           "test": {k: t[k] for k in ("map@r", "recall@1", "r_precision", "nmi", "f1")}, "run": cfg.out}
    if args.json:
        write_json(args.json, out)
    for name in ("val", "test"):
        print(summary_line(name, metrics[name]), file=sys.stderr)
    print(json.dumps(out, indent=2))
    return 0


# ---------------------------------------------------------------- tune
def cmd_tune(args, argv) -> int:
    from .tune import TuneConfig, show_space, tune

    cfg = config_from_args(TuneConfig, args)
    if args.show_space:
        print(show_space(cfg.space))
        return 0
    with torch_threads(cfg.threads):
        summary = tune(cfg)
    if args.json:
        write_json(args.json, summary)
    best = summary.get("best")
    print(f"{summary['trials']} trials ({summary['complete']} complete, {summary['pruned']} pruned, "
          f"{summary['failed']} failed) in {summary['seconds']:.0f} s; " +
          (f"best: trial {best['trial']}, val MAP@R {best['val_map@r']:.4f}, test {best['test_map@r']:.4f}; "
           f"config {best['config']}" if best else "no trial completed"), file=sys.stderr)
    print(json.dumps({k: v for k, v in summary.items() if k != "space"}, indent=2, default=str))
    return 0


# ---------------------------------------------------------------- list
def cmd_list(args, argv) -> int:
    names = [args.registry] if args.registry else list(REGISTRIES)
    print("\n\n".join(REGISTRIES[n].listing() for n in names))
    return 0


def _append_help(parser, dest: str, text: str) -> None:
    for a in parser._actions:
        if a.dest == dest:
            a.help = f"{a.help}. {text}".replace("%", "%%").replace("%%(default)s", "%(default)s")


def _json_arg(parser, what: str) -> None:
    parser.add_argument("--json", metavar="FILE", help=f"also write {what} to FILE (atomically)")


def build_parser(defaults: dict | None = None) -> argparse.ArgumentParser:
    """`defaults`: {command: {field: value}} from a config file, replacing the field defaults."""
    p, sub, defaults = command_parser("python -m training", __doc__, defaults)

    sp = sub.add_parser("prepare", help="render/verify a data set and print its splits")
    add_config_args(sp, DataConfig, registries=CHOICES)
    sp.set_defaults(func=cmd_prepare)

    se = sub.add_parser("evaluate", help="evaluate embeddings (.npy), a checkpoint or a backbone",
                        description="Retrieval metrics (Recall@K, MAP@R, R-Precision, P@1) and "
                        "k-means NMI/F1.  Embeddings are L2-normalised and compared by cosine "
                        "unless --no-normalize (then Euclidean).  With --checkpoint the data settings "
                        "are the checkpoint's own; data flags given here override them.")
    se.add_argument("--embeddings", help="gallery embeddings, .npy (n × d)")
    se.add_argument("--labels", help="gallery labels, .npy (n)")
    se.add_argument("--query-embeddings", help="separate query embeddings (else query = gallery, "
                    "leaving each query out)")
    se.add_argument("--query-labels", help="labels of --query-embeddings, .npy")
    se.add_argument("--checkpoint", help="a trained checkpoint to evaluate on the data it was trained on")
    se.add_argument("--features", choices=["embedding", "trunk"], default="embedding",
                    help="with --checkpoint: evaluate the neck embeddings or the raw trunk features "
                    "(default: %(default)s)")
    BACKBONES.add_argument(se, "--backbone", default=None,
                           help="a pretrained backbone whose raw trunk features to evaluate")
    se.add_argument("--weights", default=None, help="backbone weights: imagenet | hub (timm:NAME, from the local "
                    "Hugging Face cache) | none | PATH (default: the backbone's own)")
    se.add_argument("--split", default="test", help="split to evaluate (default: %(default)s)")
    se.add_argument("--ks", type=_ks, default=DEFAULT_KS, help="Recall@K values (default: 1,2,4,8)")
    se.add_argument("--no-normalize", action="store_true", help="compare raw vectors by L2 distance")
    _json_arg(se, "the flat metrics object")
    add_config_args(se, DataConfig, defaults=defaults.get("evaluate"), registries=CHOICES)
    add_config_args(se, CommandOptions, defaults=defaults.get("evaluate"))
    se.set_defaults(func=cmd_evaluate)

    st = sub.add_parser("train", help="train an embedding model (frozen-backbone or fine-tuning)",
                        description="Train backbone + neck W with a metric loss; select on validation "
                        "MAP@R; evaluate the selected checkpoint once on test.  The run folder's "
                        "config.toml, passed back with --config, reproduces the run.")
    st.add_argument("--config", metavar="FILE.toml", help="read the settings from this TOML file (a run "
                    "folder's config.toml); flags given on the command line override it")
    _json_arg(st, "the printed summary")
    add_config_args(st, TrainConfig, defaults=defaults.get("train"), registries=CHOICES)
    _append_help(st, "loss_param", f"Keys per loss: {LOSSES.params_help()}")
    _append_help(st, "reg_param", f"Keys per regularizer: {REGULARIZERS.params_help()}")
    _append_help(st, "reg_weight", "Defaults: " + ", ".join(
        f"{e.name} {e.spec.weight}" for e in REGULARIZERS.entries()))
    st.set_defaults(func=cmd_train)

    from .tune import TuneConfig

    su = sub.add_parser("tune", help="choose the training recipe on validation classes (an Optuna study)",
                        description="An Optuna study (TPE sampler, median pruning after each epoch) over the "
                        "trunk, the mode, the loss and its parameters, the regularizer and its weight, the "
                        "learning rate, epochs, batch and embedding size, maximising validation MAP@R on "
                        "class-disjoint validation classes.  Stops at --budget or --trials; run it again to "
                        "continue the study in --out.  Leaves best.pt, best.toml (python -m training train "
                        "--config best.toml reproduces the best trial), trials.md/.csv and plots.")
    su.add_argument("--config", metavar="FILE.toml", help="read the settings from this TOML file (space = "
                    "[\"lr=1e-5..1e-3 log\", ...]); flags given on the command line override it")
    su.add_argument("--show-space", action="store_true", help="print the search space (with --space applied) "
                    "and exit")
    _json_arg(su, "the study's summary")
    add_config_args(su, TuneConfig, defaults=defaults.get("tune"), registries={"dataset": DATASETS})
    su.set_defaults(func=cmd_tune)

    sl = sub.add_parser("list", help="list backbones, data sets, losses and regularizers with their parameters")
    sl.add_argument("registry", nargs="?", choices=list(REGISTRIES), help="only this registry (default: all)")
    sl.set_defaults(func=cmd_list)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from .tune import TuneConfig

    args = parse_with_config_file(build_parser, argv, {"train": TrainConfig, "tune": TuneConfig})
    setup_logging(args.verbose)
    return args.func(args, argv)
