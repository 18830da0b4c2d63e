"""`python -m index <command>`: build, change, search and evaluate indices under refined metrics."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path

import numpy as np

from core.atomic import write_json
from core.config import add_config_args, config_from_args, parse_with_config_file
from core.errors import UserError
from core.logs import setup_logging
from core.registry import convert
from data import DATASETS, DataConfig

from .build_config import BuildConfig
from .refinements import MODES, REFINEMENTS, shared_params

log = logging.getLogger("index")


def _strategy_args(p):
    g = p.add_argument_group("metric (refinement strategy; `python -m index list` shows each one's parameters)")
    REFINEMENTS.add_argument(g, "--strategy", default="trained", help="refinement strategy M* ↦ M′")
    # one flag per parameter name over all strategies; unset = the chosen strategy's default
    for sp in shared_params():
        g.add_argument(sp.flag, dest=sp.name, type=_param_type(sp), default=None,
                       help=sp.describe().replace("%", "%%"))
    g.add_argument("--mode", choices=MODES, default="bilinear",
                   help="bilinear φ(q)ᵀM′φ(x) (any symmetric M′) or cosine under M′ (PSD only) "
                        "(default: %(default)s)")


def _param_type(sp):
    def parse(value: str):
        try:
            return convert(value, sp.type, "value")
        except UserError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = getattr(sp.type, "__name__", "value")
    return parse


def strategy_params_from(args) -> dict:
    return {sp.name: getattr(args, sp.name) for sp in shared_params()}


# ---------------------------------------------------------------- commands
def cmd_build(args) -> int:
    from .build import build_from_dataset, build_from_features, build_from_image_folder

    if not args.out:
        raise UserError("give --out (the index directory to write), on the command line or in --config")
    normalize, progress = args.normalize, args.progress
    if args.features:
        if not args.labels:
            raise UserError("--features needs --labels")
        path = build_from_features(args.features, args.labels, args.out, args.neck, normalize, args.factory)
    elif args.image_folder:
        if not args.checkpoint:
            raise UserError("--image-folder needs --checkpoint")
        path = build_from_image_folder(args.checkpoint, args.image_folder, args.out, normalize, args.factory,
                                       args.eval_batch_size, args.workers, progress=progress)
    elif args.checkpoint:
        dcfg = config_from_args(DataConfig, args)
        path = build_from_dataset(args.checkpoint, dcfg, args.out, args.split, normalize, args.factory,
                                  cache_dir=args.cache_dir or None, progress=progress)
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
    if args.backend != "faiss":  # before the torch import below: feature queries need no model
        return cmd_search_backend(args)
    from .embedder import ImageEmbedder
    from .search import Searcher
    from .store import read_index

    from .threads import serving_threads

    if not args.index:
        raise UserError("give --index (the index directory to search)")
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


# ---------------------------------------------------------------- on-disk IVF and Milvus backends
def cmd_ivf_build(args) -> int:
    from .ondisk import MANIFEST, build_for_index, build_ondisk_ivf

    kw = {"nlist": args.nlist or None, "codec": args.codec, "shard_rows": args.shard_rows,
          "train_size": args.train_size or None, "seed": args.seed}
    if bool(args.index) == bool(args.features):
        raise UserError("give one of --index IDX (an index directory) or --features F.npy")
    if args.index:
        out = build_for_index(args.index, args.out, **kw)
    else:
        from core.arrays import load_npy

        if not args.out:
            raise UserError("--features needs --out (the on-disk index directory to write)")
        W = load_npy(args.neck, "neck W") if args.neck else None
        out = build_ondisk_ivf(args.features, args.out, W=W, normalize=args.normalized, **kw)
    man = json.loads((out / MANIFEST).read_text())
    print(json.dumps({k: man[k] for k in ("count", "dim", "nlist", "codec", "shards", "normalize")}
                     | {"bytes_on_disk": sum(f["bytes"] for f in man["files"].values()), "ivf": str(out)}, indent=2))
    return 0


def cmd_export(args) -> int:
    from .milvus_store import export_index

    if not (args.uri and args.collection):
        raise UserError("export --to milvus needs --uri and --collection")
    n = export_index(args.index, args.uri, args.collection, token=_milvus_token(args), overwrite=args.overwrite,
                     index_type=args.index_type)
    print(json.dumps({"exported": n, "to": args.to, "uri": args.uri, "collection": args.collection,
                      "metric_type": "IP", "index_type": args.index_type}))
    return 0


def _milvus_token(args) -> str:
    return args.token if args.token is not None else os.environ.get("MILVUS_TOKEN", "")


def _open_backend(args):
    """The gallery `search --backend ondisk|milvus` reads."""
    if args.backend == "ondisk":
        from .ondisk import OnDiskIVF

        if not (args.ivf or args.index):
            raise UserError("--backend ondisk needs --ivf DIR (or --index IDX, whose IDX/ivf_ondisk is used)")
        return OnDiskIVF(args.ivf or Path(args.index) / "ivf_ondisk", nprobe=args.nprobe or None)
    from .milvus_store import MilvusGallery

    if not (args.uri and args.collection):
        raise UserError("--backend milvus needs --uri and --collection")
    return MilvusGallery(args.uri, args.collection, _milvus_token(args))


def cmd_search_backend(args) -> int:
    from .threads import serving_threads

    serving_threads(args.threads or None)
    gallery = _open_backend(args)
    if args.image:
        from .embedder import ImageEmbedder

        man = gallery.source_manifest
        feats = ImageEmbedder(args.checkpoint or man.get("checkpoint") or "", man).features(args.image)
        names = list(args.image)
    elif args.features:
        from core.arrays import load_npy

        feats = np.atleast_2d(load_npy(args.features, "query features"))
        names = [f"{args.features}[{i}]" for i in range(len(feats))]
    else:
        raise UserError("give --image PATH... or --features F.npy")
    params = strategy_params_from(args)
    qm = gallery.strategy_metric(args.strategy, params, args.mode)
    if args.rerank_factor < 1:
        raise UserError(f"--rerank-factor must be ≥ 1, got {args.rerank_factor}")
    nprobe = {"nprobe": args.nprobe or None} if args.backend == "milvus" else {}
    res = gallery.search(feats, qm, args.k, rerank_factor=args.rerank_factor, **nprobe)
    payload = {"backend": args.backend, "strategy": args.strategy,
               "params": {k: v for k, v in params.items() if v is not None}, "mode": args.mode, "k": args.k,
               "queries": [{"query": n, "results": r} for n, r in zip(names, gallery.describe(res))]}
    write_json(args.json, payload) if args.json else print(json.dumps(payload, indent=1, ensure_ascii=False))
    return 0


def _milvus_args(p) -> None:
    p.add_argument("--uri", help="Milvus: a file path ending in .db (Milvus Lite, embedded) or "
                                 "http://host:19530 (a server or cluster)")
    p.add_argument("--collection", help="Milvus collection name")
    p.add_argument("--token", help="Milvus token, 'user:password' or an API key "
                                   "(default: $MILVUS_TOKEN, else none)")


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


def cmd_list(args) -> int:
    print(REFINEMENTS.listing())
    return 0


def _data_args(p, defaults: dict | None = None) -> None:
    add_config_args(p, DataConfig, defaults=defaults, registries={"dataset": DATASETS})


def build_parser(defaults: dict | None = None) -> argparse.ArgumentParser:
    """`defaults`: {command: values} from a --config file, replacing the field defaults."""
    defaults = defaults or {}
    p = argparse.ArgumentParser(prog="python -m index", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build an index from a data-set split, an image folder, or features")
    b.add_argument("--config", help="TOML file with these settings (flags given here override it); "
                                    "the data-set fields may sit in a [data] table")
    data_fields = tuple(f.name for f in dataclasses.fields(DataConfig))
    add_config_args(b, BuildConfig, skip=data_fields, defaults=defaults.get("build"))
    _data_args(b, defaults.get("build"))
    b.set_defaults(func=cmd_build)

    a = sub.add_parser("add", help="add images or feature vectors to an index")
    a.add_argument("--index", required=True, help="index directory to change (rewritten atomically)")
    a.add_argument("--images", nargs="+", help="image files to add")
    a.add_argument("--features", help="feature vectors .npy to add")
    a.add_argument("--labels", help="labels .npy for --features")
    a.add_argument("--label", type=int, default=-1, help="label for all added items (default: %(default)s: unknown)")
    a.add_argument("--checkpoint", help="model to embed images (default: the index's own)")
    a.set_defaults(func=cmd_add)

    r = sub.add_parser("remove", help="remove items by id")
    r.add_argument("--index", required=True, help="index directory to change (rewritten atomically)")
    r.add_argument("--ids", required=True, type=lambda s: [int(v) for v in s.split(",") if v.strip()],
                   help="comma-separated ids")
    r.set_defaults(func=cmd_remove)

    s = sub.add_parser("search", help="search by image file(s) or feature vectors under a refined metric")
    s.add_argument("--index", help="index directory to search (required with --backend faiss)")
    s.add_argument("--image", nargs="+", help="query image file(s)")
    s.add_argument("--features", help="query trunk features .npy (n × d or d)")
    s.add_argument("--checkpoint", help="model to embed query images (default: the index's own)")
    s.add_argument("--k", type=int, default=10, help="results per query (default: %(default)s)")
    s.add_argument("--json", help="write results here (default: print them)")
    s.add_argument("--threads", type=int, default=0,
                   help="FAISS threads; 0 = FAISS's own setting; for single queries 1 is often fastest "
                        "(default: %(default)s)")
    s.add_argument("--no-verify", action="store_true", help="skip the checksum verification at load")
    _strategy_args(s)
    g = s.add_argument_group("backends other than the index directory's FAISS index")
    g.add_argument("--backend", choices=("faiss", "ondisk", "milvus"), default="faiss",
                   help="faiss: --index's own index in RAM; ondisk: an on-disk IVF (see ivf-build); "
                        "milvus: a collection written by `export --to milvus` (default: %(default)s)")
    g.add_argument("--ivf", help="ondisk: the on-disk IVF directory (default: INDEX/ivf_ondisk)")
    g.add_argument("--nprobe", type=int, default=0,
                   help="ondisk, and milvus IVF_* collections: inverted lists probed; 0 = 32 (at most nlist) "
                        "for ondisk, Milvus's own for milvus (default: %(default)s)")
    g.add_argument("--rerank-factor", type=int, default=10,
                   help="ondisk, and milvus in cosine mode or on a non-FLAT collection: candidates fetched per "
                        "result for the exact re-rank under M′, × 4 in cosine mode (default: %(default)s)")
    _milvus_args(g)
    s.set_defaults(func=cmd_search)

    v = sub.add_parser("ivf-build", help="build an IVF index whose inverted lists live on disk (larger than RAM), "
                                         "searched with `search --backend ondisk`")
    v.add_argument("--index", help="index directory whose features.npy, neck W and metadata to use")
    v.add_argument("--features", help="or: trunk features .npy (float32 N × d, read in chunks, never loaded whole)")
    v.add_argument("--neck", help="neck W .npy (k × d) for --features (none: identity)")
    v.add_argument("--normalized", action="store_true",
                   help="--features rows are L2-normalised (checked on a sample); queries then are too")
    v.add_argument("--out", help="directory to write (atomically) (default with --index: INDEX/ivf_ondisk)")
    v.add_argument("--nlist", type=int, default=0,
                   help="inverted lists; 0 = a power of two near √N (default: %(default)s)")
    v.add_argument("--codec", default="SQ8", help="FAISS encoding of the lists' codes; candidates are re-ranked "
                                                  "exactly from the features (default: %(default)s)")
    v.add_argument("--shard-rows", type=int, default=1_000_000,
                   help="rows per shard filled in RAM before the on-disk merge (default: %(default)s)")
    v.add_argument("--train-size", type=int, default=0,
                   help="rows sampled to train the quantiser; 0 = 64 × nlist (default: %(default)s)")
    v.add_argument("--seed", type=int, default=0, help="seed of the training sample (default: %(default)s)")
    v.set_defaults(func=cmd_ivf_build)

    x = sub.add_parser("export", help="copy an index directory's features and metadata into a vector database")
    x.add_argument("--to", choices=("milvus",), required=True, help="target database (a collection with metric IP)")
    x.add_argument("--index", required=True, help="index directory to export")
    _milvus_args(x)
    x.add_argument("--index-type", choices=("FLAT", "IVF_FLAT", "HNSW"), default="FLAT",
                   help="Milvus index on the vectors; other than FLAT, search re-ranks candidates exactly "
                        "(default: %(default)s)")
    x.add_argument("--overwrite", action="store_true", help="replace a collection of that name")
    x.set_defaults(func=cmd_export)

    i = sub.add_parser("info", help="show an index's manifest and a strategy's matrix properties")
    i.add_argument("--index", required=True, help="index directory")
    _strategy_args(i)
    i.set_defaults(func=cmd_info)

    ls = sub.add_parser("list", help="list the refinement strategies with their parameters and defaults")
    ls.set_defaults(func=cmd_list)

    for name, func, hlp in (("evaluate", cmd_evaluate, "evaluate all strategies on a split (JSON, plots, table)"),
                            ("select", cmd_select, "pick strategy and parameter by MAP@R on validation classes")):
        e = sub.add_parser(name, help=hlp)
        e.add_argument("--checkpoint", required=True, help="trained checkpoint whose features are evaluated")
        if name == "evaluate":
            e.add_argument("--out", required=True, help="folder for strategies.json, table.md and plots")
            e.add_argument("--split", default="test", help="data-set split to evaluate on (default: %(default)s)")
            e.add_argument("--no-val", action="store_true", help="skip the validation-selected row")
        else:
            e.add_argument("--json", help="write the selection (and all validation rows) here")
        e.add_argument("--seeds", type=int, default=3, help="seeds per random strategy setting (default: %(default)s)")
        e.add_argument("--no-normalize", action="store_true", help="do not L2-normalise φ(x)")
        e.add_argument("--no-progress", action="store_true", help="no progress bars")
        _data_args(e)
        e.add_argument("--cache-dir", default="cache/features",
                       help="trunk-feature cache ('' = off) (default: %(default)s)")
        e.set_defaults(func=func)
    return p


def main(argv=None) -> int:
    args = parse_with_config_file(build_parser, argv, {"build": BuildConfig})
    setup_logging(args.verbose)
    return args.func(args)
