"""`python -m index <command>`: build, change, search and evaluate indices under refined metrics."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from core.atomic import write_json
from core.config import add_config_args, config_from_args
from core.errors import UserError
from core.logs import setup_logging
from data import DataConfig

log = logging.getLogger("index")


def _strategy_args(p):
    from .refinements import STRATEGIES

    g = p.add_argument_group("metric (refinement strategy)")
    g.add_argument("--strategy", default="trained", choices=sorted(STRATEGIES),
                   help="; ".join(f"{n}: {s.doc}" for n, s in sorted(STRATEGIES.items())))
    g.add_argument("--r", type=float, help="restraint degree for diagonal/random (default 0.5)")
    g.add_argument("--seed", type=int, help="seed for diagonal/random (default 0)")
    g.add_argument("--alpha", type=float, help="shrink weight α (default 0.5)")
    g.add_argument("--p", type=float, help="spectral power p (default 0.5)")
    g.add_argument("--metric-matrix", help="custom: a symmetric d × d .npy file")
    g.add_argument("--mode", choices=["bilinear", "cosine"], default="bilinear",
                   help="bilinear φ(q)ᵀM′φ(x) (any symmetric M′) or cosine under M′ (PSD only)")


def strategy_params_from(args) -> dict:
    return {"r": args.r, "seed": args.seed, "alpha": args.alpha, "p": args.p, "path": args.metric_matrix}


# ---------------------------------------------------------------- commands
def cmd_build(args) -> int:
    from .build import build_from_dataset, build_from_features, build_from_image_folder

    normalize = not args.no_normalize
    if args.features:
        if not args.labels:
            raise UserError("--features needs --labels")
        path = build_from_features(args.features, args.labels, args.out, args.neck, normalize, args.factory)
    elif args.image_folder:
        if not args.checkpoint:
            raise UserError("--image-folder needs --checkpoint")
        path = build_from_image_folder(args.checkpoint, args.image_folder, args.out, normalize, args.factory,
                                       args.eval_batch_size, args.workers, progress=not args.no_progress)
    elif args.checkpoint:
        dcfg = config_from_args(DataConfig, args)
        path = build_from_dataset(args.checkpoint, dcfg, args.out, args.split, normalize, args.factory,
                                  cache_dir=args.cache_dir or None, progress=not args.no_progress)
    else:
        raise UserError("give --checkpoint (with --dataset or --image-folder) or --features")
    man = json.loads((Path(path) / "manifest.json").read_text())
    print(json.dumps({k: man[k] for k in ("count", "classes", "trunk_dim", "embed_dim", "factory",
                                           "index_type", "normalize")} | {"index": str(path)}, indent=2))
    return 0


def cmd_add(args) -> int:
    from .build import add_features, add_images

    if args.features:
        from core.arrays import load_npy

        F = load_npy(args.features, "features")
        labels = load_npy(args.labels, "labels") if args.labels else args.label
        ids = add_features(args.index, F, labels)
    elif args.images:
        ids = add_images(args.index, args.images, args.label, args.checkpoint)
    else:
        raise UserError("give --images or --features")
    print(json.dumps({"added_ids": ids}))
    return 0


def cmd_remove(args) -> int:
    from .build import remove_ids

    n = remove_ids(args.index, args.ids)
    print(json.dumps({"removed": n}))
    return 0


def cmd_search(args) -> int:
    from .embedder import ImageEmbedder
    from .search import Searcher
    from .store import read_index

    from .threads import serving_threads

    data = read_index(args.index, verify=not args.no_verify)
    serving_threads(args.threads or None)
    s = Searcher(data)
    if args.features:
        from core.arrays import load_npy

        feats = np.atleast_2d(load_npy(args.features, "query features"))
        names = [f"{args.features}[{i}]" for i in range(len(feats))]
    elif args.image:
        emb = ImageEmbedder(args.checkpoint or data.manifest.get("checkpoint") or "", data.manifest)
        feats = emb.features(args.image)
        names = list(args.image)
    else:
        raise UserError("give --image PATH... or --features F.npy")
    res = s.search(feats, args.strategy, strategy_params_from(args), args.mode, args.k)
    out = [{"query": n, "results": r} for n, r in zip(names, s.describe(res))]
    payload = {"strategy": args.strategy, "params": {k: v for k, v in strategy_params_from(args).items()
                                                      if v is not None},
               "mode": args.mode, "k": args.k, "queries": out}
    if args.json:
        write_json(args.json, payload)
    else:
        print(json.dumps(payload, indent=1, ensure_ascii=False))
    return 0


def cmd_info(args) -> int:
    from .search import Searcher
    from .store import read_index

    data = read_index(args.index)
    rep = Searcher(data).metric(args.strategy, strategy_params_from(args)).report
    print(json.dumps({"manifest": data.manifest, "metric": {"strategy": args.strategy} | rep}, indent=2))
    return 0


def cmd_evaluate(args) -> int:
    from .build import split_features
    from .strategy_eval import run_evaluation, table_markdown

    dcfg = config_from_args(DataConfig, args)
    cache = args.cache_dir or None
    f, y, W = split_features(args.checkpoint, dcfg, args.split, cache, not args.no_progress)
    val = None
    if not args.no_val:
        vf, vy, _ = split_features(args.checkpoint, dcfg, "val", cache, not args.no_progress)
        val = (vf, vy)
    res = run_evaluation(f, y, W, args.out, val=val, normalize=not args.no_normalize, seeds=args.seeds,
                         progress=not args.no_progress)
    print(table_markdown(res["table"]))
    print(f"written: {args.out}/strategies.json, table.md, restraint_sweep.png, principles.png")
    return 0


def cmd_select(args) -> int:
    from .build import split_features
    from .strategy_eval import select_strategy

    dcfg = config_from_args(DataConfig, args)
    vf, vy, W = split_features(args.checkpoint, dcfg, "val", args.cache_dir or None, not args.no_progress)
    res = select_strategy(vf, vy, W, normalize=not args.no_normalize, seeds=args.seeds,
                          progress=not args.no_progress)
    sel = res["selected"]
    out = {"selected": res["label"], "strategy": sel["strategy"], "params": sel["params"], "mode": sel["mode"],
           "val_map@r": sel["map@r"],
           "principles": {"trace_over_frobenius": sel["M_trace_over_frobenius"],
                          "frobenius_over_trace": sel["M_frobenius_over_trace"]}}
    if args.json:
        write_json(args.json, out | {"all": res["all"]})
    print(json.dumps(out, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m index", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build an index from a data-set split, an image folder, or features")
    b.add_argument("--out", required=True, help="index directory to write (atomically)")
    b.add_argument("--checkpoint", help="trained checkpoint whose backbone embeds the images")
    b.add_argument("--split", default="test", help="data-set split to index (default test)")
    b.add_argument("--image-folder", help="index every image in this folder (sub-folders = classes)")
    b.add_argument("--features", help="precomputed trunk features .npy (n × d)")
    b.add_argument("--labels", help="labels .npy for --features")
    b.add_argument("--neck", help="neck W .npy (k × d) for --features (default identity)")
    b.add_argument("--no-normalize", action="store_true", help="do not L2-normalise φ(x)")
    b.add_argument("--factory", help="FAISS factory string (default Flat up to 1e5 items, else HNSW32)")
    b.add_argument("--no-progress", action="store_true")
    add_config_args(b, DataConfig)
    b.add_argument("--cache-dir", default="cache/features", help="trunk-feature cache ('' = off)")
    b.set_defaults(func=cmd_build)

    a = sub.add_parser("add", help="add images or feature vectors to an index")
    a.add_argument("--index", required=True)
    a.add_argument("--images", nargs="+", help="image files to add")
    a.add_argument("--features", help="feature vectors .npy to add")
    a.add_argument("--labels", help="labels .npy for --features")
    a.add_argument("--label", type=int, default=-1, help="label for all added items (default -1: unknown)")
    a.add_argument("--checkpoint", help="model to embed images (default: the index's own)")
    a.set_defaults(func=cmd_add)

    r = sub.add_parser("remove", help="remove items by id")
    r.add_argument("--index", required=True)
    r.add_argument("--ids", required=True, type=lambda s: [int(v) for v in s.split(",") if v.strip()],
                   help="comma-separated ids")
    r.set_defaults(func=cmd_remove)

    s = sub.add_parser("search", help="search by image file(s) or feature vectors under a refined metric")
    s.add_argument("--index", required=True)
    s.add_argument("--image", nargs="+", help="query image file(s)")
    s.add_argument("--features", help="query trunk features .npy (n × d or d)")
    s.add_argument("--checkpoint", help="model to embed query images (default: the index's own)")
    s.add_argument("--k", type=int, default=10)
    s.add_argument("--json", help="write results here (else print)")
    s.add_argument("--threads", type=int, default=0, help="FAISS threads (single queries: 1 is often fastest)")
    s.add_argument("--no-verify", action="store_true", help="skip the checksum verification at load")
    _strategy_args(s)
    s.set_defaults(func=cmd_search)

    i = sub.add_parser("info", help="show an index's manifest and a strategy's matrix properties")
    i.add_argument("--index", required=True)
    _strategy_args(i)
    i.set_defaults(func=cmd_info)

    for name, func, hlp in (("evaluate", cmd_evaluate, "evaluate all strategies on a split (JSON, plots, table)"),
                            ("select", cmd_select, "pick strategy and parameter by MAP@R on validation classes")):
        e = sub.add_parser(name, help=hlp)
        e.add_argument("--checkpoint", required=True)
        if name == "evaluate":
            e.add_argument("--out", required=True, help="folder for strategies.json, table.md and plots")
            e.add_argument("--split", default="test")
            e.add_argument("--no-val", action="store_true", help="skip the validation-selected row")
        else:
            e.add_argument("--json", help="write the selection (and all validation rows) here")
        e.add_argument("--seeds", type=int, default=3, help="seeds per random restraint setting")
        e.add_argument("--no-normalize", action="store_true")
        e.add_argument("--no-progress", action="store_true")
        add_config_args(e, DataConfig)
        e.add_argument("--cache-dir", default="cache/features")
        e.set_defaults(func=func)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    return args.func(args)
