"""`python -m index <command>`: build, change, search and evaluate indices under refined metrics."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

import numpy as np

from core.atomic import check_file_target, write_json
from core.cli import command_parser
from core.config import add_config_args, parse_with_config_file
from core.errors import UserError
from core.flags import add_shared_args, apply_threads, at_least
from core.logs import setup_logging
from core.params import convert
from data import DATASETS, DataConfig

from .backends.gallery import Gallery
from .build_config import BuildConfig
from .refinements import GRIDS, MODES, REFINEMENTS, file_params, shared_params
from .rerankers import RERANKERS
from .search_config import NO_RERANK, SearchConfig

log = logging.getLogger("index")


# ---------------------------------------------------------------- strategy flags (search, info, report)
def _strategy_args(p):
    g = p.add_argument_group("metric (refinement strategy; `python -m index list` shows each one's parameters)")
    REFINEMENTS.add_argument(g, "--strategy", default="trained", help="refinement strategy M* ↦ M′")
    # one flag per parameter name over all strategies; unset = the chosen strategy's default
    for sp in shared_params():
        g.add_argument(sp.flag, dest=sp.name, type=_param_type(sp), default=None,
                       help=sp.describe().replace("%", "%%"))
    g.add_argument("--mode", choices=MODES, default="cosine",
                   help="cosine under M′, the standard evaluation the paper follows (for M* the cosine of "
                        "the embeddings; an indefinite M′ has none and falls back to bilinear, with a note: "
                        "the *-psd strategies read it as PSD), or bilinear φ(q)ᵀM′φ(x), our extra view "
                        "(default: %(default)s)")


def _rerank_args(p, prefix: str = ""):
    """--rerank NAME and --rerank-param KEY=VALUE[,KEY=VALUE] (prefix "left-": the report's left side)."""
    side = f" ({prefix.rstrip('-')} side)" if prefix else ""
    g = p.add_argument_group(f"re-ranking{side} (query time, over the strategy's ranking; `python -m index list` "
                             "shows each re-ranker's parameters)")
    RERANKERS.add_argument(g, f"--{prefix}rerank", default="none",
                           help="re-ranker applied to the strategy's search (none: the search itself)")
    g.add_argument(f"--{prefix}rerank-param", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help=("the re-ranker's parameters, each unset one at its default: "
                         + RERANKERS.params_help() + " (default: none given)").replace("%", "%%"))


def rerank_params_from(values: list[str]) -> dict:
    """`k1=20,k2=6` (and repeated flags) → {key: text}: SearchConfig types and checks them."""
    out = {}
    for v in values:
        for item in filter(None, (s.strip() for s in v.split(","))):
            key, eq, val = item.partition("=")
            if not eq or not key.strip():
                raise UserError(f"--rerank-param wants KEY=VALUE, got {item!r}")
            out[key.strip()] = val.strip()
    return out


def _param_type(sp):
    def parse(value: str):
        try:
            return convert(value, sp.type, "value")
        except UserError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = getattr(sp.type, "__name__", "value")
    return parse


def strategy_params_from(args) -> dict:
    """The parameter flags' values; one given that --strategy does not take is refused: ignoring
    it would search another M′ than the one asked for (e.g. --psd on the raw restraint)."""
    given = {sp.name: getattr(args, sp.name) for sp in shared_params()}
    for sp in shared_params():
        if given[sp.name] is not None and args.strategy not in sp.defaults:
            raise UserError(f"strategy {args.strategy} takes no {sp.flag}; {', '.join(sp.defaults)} "
                            f"{'do' if len(sp.defaults) > 1 else 'does'}")
    return given


# ---------------------------------------------------------------- commands
def given_data(args) -> dict:
    """The data settings given on the command line (or in --config); None = the checkpoint's."""
    return {f.name: getattr(args, f.name, None) for f in dataclasses.fields(DataConfig)}


def cmd_build(args) -> int:
    from .backends.shard import distributed_rank
    from .build import writing_index

    if not args.out:
        raise UserError("give --out (the index directory to write), on the command line or in --config")
    apply_threads(args.threads)
    # under torchrun only rank 0 writes --out, so only it takes the lock; every rank checks the guard
    with writing_index(args.out, args.overwrite, lock=distributed_rank()[0] == 0):
        path = _build(args)
    if path is None:  # a torchrun rank other than 0: rank 0 merged and reports
        return 0
    man = json.loads((Path(path) / "manifest.json").read_text())
    data = man.get("data") or {}
    print(json.dumps({k: man[k] for k in ("count", "classes", "trunk_dim", "embed_dim", "factory",
                                           "index_type", "normalize")}
                     | {k: data[k] for k in ("dataset", "image_size", "resize_mode") if k in data}
                     | {"split": man.get("split"), "index": str(path)}, indent=2))
    return 0


def _build(args) -> Path | None:
    from .build import build_from_features, build_from_image_folder

    normalize, progress = args.normalize, args.progress
    if args.features:
        if not args.labels:
            raise UserError("--features needs --labels")
        path = build_from_features(args.features, args.labels, args.out, args.neck, normalize, args.factory)
    elif args.image_folder:
        if not args.checkpoint:
            raise UserError("--image-folder needs --checkpoint")
        path = build_from_image_folder(args.checkpoint, args.image_folder, args.out, normalize, args.factory,
                                       args.eval_batch_size or 64, args.workers or 1, given_data(args),
                                       progress=progress, device=args.device)
    elif args.checkpoint:
        path = _build_dataset(args)  # None on a torchrun rank other than 0
    else:
        raise UserError("give --checkpoint (its data set by default, or --image-folder) or --features")
    return path


def _build_dataset(args):
    from .backends.shard import distributed_build, distributed_rank, parse_shard
    from .build import build_from_dataset

    def build(shard, out):
        return build_from_dataset(args.checkpoint, given_data(args), out, args.split, args.normalize,
                                  args.factory, cache_dir=args.cache_dir or None, progress=args.progress,
                                  device=args.device, shard=shard)

    if args.shard:
        return build(parse_shard(args.shard), args.out)
    if distributed_rank()[1] > 1:
        def prepare():  # render or scan the data set once, before the other ranks read it
            from data import load_data
            from model.checkpoint import data_config_for, read_checkpoint

            load_data(data_config_for(read_checkpoint(args.checkpoint), given_data(args)), args.progress)
        return distributed_build(build, prepare, args.out, args.factory)
    return build(None, args.out)


def cmd_merge(args) -> int:
    from .backends.shard import merge_shards
    from .build import writing_index

    with writing_index(args.out, args.overwrite):
        path = merge_shards(args.shards, args.out, args.factory)
    man = json.loads((Path(path) / "manifest.json").read_text())
    print(json.dumps({"count": man["count"], "classes": man["classes"], "shards": len(args.shards),
                      "index": str(path)}, indent=2))
    return 0


def cmd_add(args) -> int:
    from .build import add_features, add_images

    if args.features:
        from core.arrays import load_npy

        F = load_npy(args.features, "features")
        labels = load_npy(args.labels, "labels") if args.labels else args.label
        ids = add_features(args.index, F, labels, what=f"features file {args.features}")
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


def open_gallery(args) -> Gallery:
    """The gallery `search --backend faiss|ondisk|milvus` reads."""
    if args.backend == "faiss":
        from .backends.search import Searcher
        from .backends.store import read_index

        if not args.index:
            raise UserError("give --index (the index directory to search)")
        return Searcher(read_index(args.index, verify=not args.no_verify))
    if args.backend == "ondisk":
        from .backends.ondisk import OnDiskIVF

        if not (args.ivf or args.index):
            raise UserError("--backend ondisk needs --ivf DIR (or --index IDX, whose IDX/ivf_ondisk is used)")
        return OnDiskIVF(args.ivf or Path(args.index) / "ivf_ondisk", nprobe=args.nprobe or None,
                         rerank_factor=args.rerank_factor)
    from .backends.milvus_store import MilvusGallery

    if not (args.uri and args.collection):
        raise UserError("--backend milvus needs --uri and --collection")
    return MilvusGallery(args.uri, args.collection, _milvus_token(args), nprobe=args.nprobe or None,
                         rerank_factor=args.rerank_factor)


def _queries(args, gallery: Gallery) -> tuple[np.ndarray, list[str], str]:
    """(query trunk features, a name per query, what error messages call them)."""
    if args.features:
        from core.arrays import check_matrix, load_npy

        what = f"query features file {args.features}"
        feats = check_matrix(load_npy(args.features, "query features"), what, allow_1d=True)
        return feats, [f"{args.features}[{i}]" for i in range(len(feats))], what
    if args.image:
        from .embedder import ImageEmbedder  # torch: only image queries need a model

        info = gallery.info
        emb = ImageEmbedder(args.checkpoint or info.get("checkpoint") or "", info, device=args.device)
        return emb.features(args.image), list(args.image), "query features"
    raise UserError("give --image PATH... or --features F.npy")


def cmd_search(args) -> int:
    """One path for every backend: open the gallery, resolve the mode (cosine falls back to
    bilinear for an indefinite M′), embed or load the queries, search through
    `SearchConfig.search` (the strategy's search, then any re-ranker), write the same JSON."""
    from .threads import serving_threads

    if args.json:
        check_file_target(args.json)
    if args.rerank_factor < 1:
        raise UserError(f"--rerank-factor must be ≥ 1, got {args.rerank_factor}")
    serving_threads(args.threads or None)  # BLAS on 1 thread for single queries; FAISS as asked
    given = {k: v for k, v in strategy_params_from(args).items() if v is not None}
    cfg = SearchConfig.of(args.strategy, given, args.mode, args.rerank, rerank_params_from(args.rerank_param),
                          strict=True)  # every setting checked before the index is read
    gallery = open_gallery(args)
    mode, note = gallery.resolve_mode(cfg.strategy, cfg.params, cfg.mode)
    cfg = cfg.with_mode(mode)
    if cfg.rerank != NO_RERANK:
        cfg.space(gallery)  # a backend that cannot re-rank refuses before any query is embedded
    feats, names, what = _queries(args, gallery)
    if note:
        print(f"note: {note}", file=sys.stderr)
    hits = cfg.search(gallery, feats, args.k, what=what)
    payload = {"backend": args.backend, "strategy": args.strategy,
               "params": given, "mode": mode, "rerank": cfg.rerank,
               "rerank_params": cfg.rerank_params if cfg.rerank != NO_RERANK else {}, "k": hits.k,
               "note": note,
               "queries": [{"query": n, "results": r} for n, r in zip(names, hits.results(), strict=True)]}
    if args.json:
        write_json(args.json, payload)
    else:
        print(json.dumps(payload, indent=1, ensure_ascii=False))
    return 0


# ---------------------------------------------------------------- on-disk IVF and Milvus backends
def cmd_ivf_build(args) -> int:
    from .backends.ondisk import MANIFEST, build_for_index, build_ondisk_ivf

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
    from .backends.milvus_store import export_index

    if not (args.uri and args.collection):
        raise UserError("export --to milvus needs --uri and --collection")
    n = export_index(args.index, args.uri, args.collection, token=_milvus_token(args), overwrite=args.overwrite,
                     index_type=args.index_type)
    print(json.dumps({"exported": n, "to": args.to, "uri": args.uri, "collection": args.collection,
                      "metric_type": "IP", "index_type": args.index_type}))
    return 0


def _milvus_token(args) -> str:
    return args.token if args.token is not None else os.environ.get("MILVUS_TOKEN", "")


# ---------------------------------------------------------------- inspection, strategy evaluation, report
def cmd_info(args) -> int:
    from .backends.search import Searcher
    from .backends.store import read_index

    data = read_index(args.index)
    rep = Searcher(data).metric(args.strategy, strategy_params_from(args)).report
    print(json.dumps({"manifest": data.manifest, "metric": {"strategy": args.strategy} | rep}, indent=2))
    return 0


def _narrowing(args) -> dict:
    return {"strategies": args.strategies, "grid_name": args.grid}


def cmd_evaluate(args) -> int:
    from .analysis.strategy_eval import counts_line, run_evaluation, table_markdown
    from .build import split_features

    if args.json:
        check_file_target(args.json)
    apply_threads(args.threads)
    splits = args.splits
    split = next((s for s in splits if s != "val"), "val")
    cache = args.cache_dir or None
    f, y, W = split_features(args.checkpoint, given_data(args), split, cache, args.progress, args.device)
    val = None
    if "val" in splits and split != "val":
        vf, vy, _ = split_features(args.checkpoint, given_data(args), "val", cache, args.progress, args.device)
        val = (vf, vy)
    res = run_evaluation(f, y, W, args.out, val=val, normalize=args.normalize, seeds=args.seeds,
                         progress=args.progress, split=split, rerankers=args.rerankers, **_narrowing(args))
    print(counts_line(res["counts"]))
    print(table_markdown(res["table"]))
    if "rerank" in res:
        from .analysis.rerank_eval import matrix_markdown

        print(matrix_markdown(res["rerank"]))
    print(f"written: {args.out}/strategies.json, table.md{', rerank.md' if 'rerank' in res else ''}, "
          "restraint_sweep.png, principles.png")
    if args.json:
        keys = ("table", "counts", "split", "grid", "strategies")
        write_json(args.json, {k: res[k] for k in keys} | ({"rerank": {k: v for k, v in res["rerank"].items()
                                                                       if k != "runs"}} if "rerank" in res else {}))
    return 0


def cmd_select(args) -> int:
    from .analysis.strategy_eval import counts_line, select_strategy
    from .build import split_features

    if args.json:
        check_file_target(args.json)
    apply_threads(args.threads)
    vf, vy, W = split_features(args.checkpoint, given_data(args), "val", args.cache_dir or None, args.progress,
                               args.device)
    res = select_strategy(vf, vy, W, normalize=args.normalize, seeds=args.seeds, progress=args.progress,
                          **_narrowing(args))
    sel = res["selected"]
    out = {"selected": res["label"], "strategy": sel["strategy"], "params": sel["params"], "mode": sel["mode"],
           "val_map@r": sel["map@r"], "val": counts_line(res["counts"]),
           "principles": {"trace_over_frobenius": sel["M_trace_over_frobenius"],
                          "frobenius_over_trace": sel["M_frobenius_over_trace"]}}
    if args.json:
        write_json(args.json, out | {"all": res["all"]})
    print(json.dumps(out, indent=2))
    return 0


def cmd_report(args) -> int:
    from .analysis.report import write_report
    from .backends.store import read_index
    from .rerankers import RERANKERS
    from .search_config import SearchConfig

    apply_threads(args.threads)
    analysis = Path(args.analysis) if args.analysis else None
    if analysis is not None and not analysis.is_dir():
        raise UserError(f"--analysis folder not found: {analysis}")
    if args.top < 1 or args.k < 1:
        raise UserError("--top and --k must be at least 1")
    # the left side is checked here, not by argparse: a bad value is one `error:` line
    left_mode = args.mode if args.left_mode is None else args.left_mode
    if left_mode not in MODES:
        raise UserError(f"--left-mode must be one of {', '.join(MODES)}, got {left_mode!r}")
    try:
        REFINEMENTS.get(args.left_strategy)
    except UserError as e:
        raise UserError(f"--left-strategy: {e}") from None
    try:  # strict: a parameter the left strategy does not take is refused, with those it takes
        left = SearchConfig.of(args.left_strategy, args.left_param, left_mode, strict=True)
    except UserError as e:
        raise UserError(f"--left-param: {e}") from None
    right = SearchConfig.of(args.strategy, strategy_params_from(args), args.mode)
    # each side's re-ranker, checked here as the left side is: a bad name or parameter is one `error:` line
    sides = []
    for cfg, flag, name, items in ((left, "--left-rerank", args.left_rerank, args.left_rerank_param),
                                   (right, "--rerank", args.rerank, args.rerank_param)):
        try:
            RERANKERS.get(name)
        except UserError as e:
            raise UserError(f"{flag}: {e}") from None
        try:  # strict: a parameter the re-ranker does not take is refused, with those it takes
            typed = dataclasses.asdict(RERANKERS.params(name, items))
        except UserError as e:
            raise UserError(f"{flag}-param: {e}") from None
        sides.append(dataclasses.replace(cfg, rerank=name, rerank_params=typed))
    left, right = sides

    def progress(done: int, total: int, what: str) -> None:
        if sys.stderr.isatty():  # a re-ranked side re-ranks every query: say how far it is
            print(f"\r{what}: {done:,}/{total:,}", end="\n" if done == total else "", file=sys.stderr, flush=True)

    out = write_report(read_index(args.index, verify=not args.no_verify), args.out, left, right, top=args.top,
                       k=args.k, analysis=analysis, progress=progress)
    print(f"written: {out}")
    return 0


def cmd_list(args) -> int:
    print(REFINEMENTS.listing())
    print()
    print(RERANKERS.listing())
    return 0


# ---------------------------------------------------------------- parsers, one per command
INHERITED = "the checkpoint's"


def _data_args(p, defaults: dict | None = None) -> None:
    """The data settings; each defaults to the checkpoint's (what the model was trained on)."""
    g = p.add_argument_group("data (each defaults to the checkpoint's own; a value that changes what the "
                             "model sees prints a warning)")
    add_config_args(g, DataConfig, defaults=defaults, registries={"dataset": DATASETS}, inherit=INHERITED)


def _strategy_list(s: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in s.split(",") if v.strip())
    try:
        for n in names:
            REFINEMENTS.get(n)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return names


def _splits(s: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in s.split(",") if v.strip())
    if not names or len([n for n in names if n != "val"]) > 1:
        raise argparse.ArgumentTypeError(f"--splits wants one evaluated split and optionally val "
                                         f"(e.g. test,val), got {s!r}")
    return names


def _milvus_args(p) -> None:
    p.add_argument("--uri", help="Milvus: a file path ending in .db (Milvus Lite, embedded) or "
                                 "http://host:19530 (a server or cluster)")
    p.add_argument("--collection", help="Milvus collection name")
    p.add_argument("--token", help="Milvus token, 'user:password' or an API key "
                                   "(default: $MILVUS_TOKEN, else none)")


def _build_parser(sub, defaults: dict) -> None:
    b = sub.add_parser("build", help="build an index from a data-set split, an image folder, or features")
    b.add_argument("--config", help="TOML file with these settings (flags given here override it); "
                                    "the data-set fields may sit in a [data] table")
    data_fields = tuple(f.name for f in dataclasses.fields(DataConfig))
    add_config_args(b, BuildConfig, skip=data_fields, defaults=defaults.get("build"))
    b.add_argument("--overwrite", action="store_true",
                   help="replace an existing index at --out; anything else there is never replaced "
                        "(default: refuse an existing --out)")
    _data_args(b, defaults.get("build"))
    b.set_defaults(func=cmd_build)


def _merge_parser(sub) -> None:
    mg = sub.add_parser("merge", help="join shard indexes (`build --shard i/N`) into one index")
    mg.add_argument("shards", nargs="+", help="the shard index directories, in any order")
    mg.add_argument("--out", required=True, help="index directory to write (atomically)")
    mg.add_argument("--factory", help="FAISS factory string (default: Flat up to 1e5 items, else HNSW32)")
    mg.add_argument("--overwrite", action="store_true",
                    help="replace an existing index at --out (never anything else) (default: off)")
    mg.set_defaults(func=cmd_merge)


def _add_parser(sub) -> None:
    a = sub.add_parser("add", help="add images or feature vectors to an index")
    a.add_argument("--index", required=True, help="index directory to change (rewritten atomically)")
    a.add_argument("--images", nargs="+", help="image files to add")
    a.add_argument("--features", help="feature vectors .npy to add")
    a.add_argument("--labels", help="labels .npy for --features")
    a.add_argument("--label", type=int, default=-1, help="label for all added items (default: %(default)s: unknown)")
    a.add_argument("--checkpoint", help="model to embed images (default: the index's own)")
    a.set_defaults(func=cmd_add)


def _remove_parser(sub) -> None:
    r = sub.add_parser("remove", help="remove items by id")
    r.add_argument("--index", required=True, help="index directory to change (rewritten atomically)")
    r.add_argument("--ids", required=True, type=lambda s: [int(v) for v in s.split(",") if v.strip()],
                   help="comma-separated ids")
    r.set_defaults(func=cmd_remove)


def _search_parser(sub) -> None:
    s = sub.add_parser("search", help="search by image file(s) or feature vectors under a refined metric")
    s.add_argument("--index", help="index directory to search (required with --backend faiss)")
    s.add_argument("--image", nargs="+", help="query image file(s)")
    s.add_argument("--features", help="query trunk features .npy (n × d or d)")
    s.add_argument("--checkpoint", help="model to embed query images (default: the index's own)")
    s.add_argument("--k", type=int, default=10,
                   help="results per query, at most the index size (default: %(default)s)")
    add_shared_args(s, "json", "threads", "device")
    s.add_argument("--no-verify", action="store_true", help="skip the checksum verification at load")
    _strategy_args(s)
    _rerank_args(s)
    g = s.add_argument_group("backends other than the index directory's FAISS index")
    g.add_argument("--backend", choices=("faiss", "ondisk", "milvus"), default="faiss",
                   help="faiss: --index's own index in RAM; ondisk: an on-disk IVF (see ivf-build); "
                        "milvus: a collection written by `export --to milvus`, which does not re-rank "
                        "(default: %(default)s)")
    g.add_argument("--ivf", help="ondisk: the on-disk IVF directory (default: INDEX/ivf_ondisk)")
    g.add_argument("--nprobe", type=int, default=0,
                   help="ondisk, and milvus IVF_* collections: inverted lists probed; 0 = 32 (at most nlist) "
                        "for ondisk, Milvus's own for milvus (default: %(default)s)")
    g.add_argument("--rerank-factor", type=int, default=10,
                   help="ondisk, and milvus in cosine mode or on a non-FLAT collection: candidates fetched per "
                        "result for the exact re-rank under M′, × 4 in cosine mode (default: %(default)s)")
    _milvus_args(g)
    s.set_defaults(func=cmd_search)


def _ivf_build_parser(sub) -> None:
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


def _export_parser(sub) -> None:
    x = sub.add_parser("export", help="copy an index directory's features and metadata into a vector database")
    x.add_argument("--to", choices=("milvus",), required=True, help="target database (a collection with metric IP)")
    x.add_argument("--index", required=True, help="index directory to export")
    _milvus_args(x)
    x.add_argument("--index-type", choices=("FLAT", "IVF_FLAT", "HNSW"), default="FLAT",
                   help="Milvus index on the vectors; other than FLAT, search re-ranks candidates exactly "
                        "(default: %(default)s)")
    x.add_argument("--overwrite", action="store_true", help="replace a collection of that name")
    x.set_defaults(func=cmd_export)


def _info_parser(sub) -> None:
    i = sub.add_parser("info", help="show an index's manifest and a strategy's matrix properties")
    i.add_argument("--index", required=True, help="index directory")
    _strategy_args(i)
    i.set_defaults(func=cmd_info)


def _list_parser(sub) -> None:
    ls = sub.add_parser("list", help="list the refinement strategies and the re-rankers with their parameters and "
                                     "defaults")
    ls.set_defaults(func=cmd_list)


def _evaluate_parser(sub) -> None:
    e = sub.add_parser("evaluate", help="evaluate all strategies on a split (JSON, plots, table)")
    _checkpoint_arg(e)
    e.add_argument("--out", required=True, help="folder for strategies.json, table.md and plots")
    e.add_argument("--splits", type=_splits, default=("test", "val"), metavar="SPLIT[,val]",
                   help="the split to evaluate on, and val to add the validation-selected row "
                        "(default: test,val)")
    _sweep_args(e)
    RERANKERS.add_argument(e, "--rerankers", many=True, default=("none",), default_help="none",
                           help="re-rankers (comma-separated) applied to one setting per strategy and mode (the "
                                "one validation chose, else its defaults), each at its defaults: the strategy × "
                                "re-ranker matrix goes to OUT/rerank.md")
    e.set_defaults(func=cmd_evaluate)


def _select_parser(sub) -> None:
    e = sub.add_parser("select", help="pick strategy and parameter by MAP@R on validation classes")
    _checkpoint_arg(e)
    _sweep_args(e)
    e.set_defaults(func=cmd_select)


def _checkpoint_arg(e) -> None:
    e.add_argument("--checkpoint", required=True,
                   help="trained checkpoint whose features are evaluated (its data set, split and "
                        "preprocessing are used unless the data flags below say otherwise)")


def _sweep_args(e) -> None:
    """The flags evaluate and select share: which strategies and settings, and the features."""
    e.add_argument("--strategies", type=_strategy_list, default=None, metavar="NAME,...",
                   help="only these strategies (default: every one that needs no file: "
                        f"{', '.join(n for n in REFINEMENTS.names() if not file_params(n))})")
    e.add_argument("--grid", choices=GRIDS, default="coarse",
                   help="every other value of each strategy's parameter grid, or the whole grid "
                        "(`index list`); full with --seeds 3 is the protocol of docs/refinement.md, about 3× "
                        "the time (default: %(default)s)")
    e.add_argument("--seeds", type=at_least(1, "--seeds"), default=1,
                   help="seeds per random strategy setting, averaged (default: %(default)s)")
    e.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=True,
                   help="L2-normalise φ(x), as indexes do by default (default: %(default)s)")
    add_shared_args(e, "json", "threads", "progress", "cache_dir", "device")
    _data_args(e)


def _report_parser(sub) -> None:
    rp = sub.add_parser("report", help="one self-contained HTML page: two configurations (trained vs a strategy, "
                                       "by default) over every query")
    rp.add_argument("--index", required=True, help="index directory (every item is a query, leave-one-out)")
    rp.add_argument("--out", required=True, help="the HTML file to write (figures and thumbnails inlined)")
    rp.add_argument("--analysis", help="folder written by `python -m index evaluate`: its strategy table and "
                                       "curves go into the report (default: none)")
    rp.add_argument("--top", type=int, default=20,
                    help="improved and worsened queries shown, each (default: %(default)s)")
    rp.add_argument("--k", type=int, default=8, help="results shown per query and configuration, and the k of "
                                                     "Jaccard@k, their top-k overlap (default: %(default)s)")
    rp.add_argument("--no-verify", action="store_true", help="skip the checksum verification at load")
    add_shared_args(rp, "threads")
    g = rp.add_argument_group("left configuration (x; the flags below --strategy set the right one, y)")
    g.add_argument("--left-strategy", default="trained", metavar="NAME",
                   help=f"refinement strategy of the left side, one of {', '.join(REFINEMENTS.names())} "
                        "(default: %(default)s)")
    g.add_argument("--left-param", action="append", default=[], metavar="KEY=VALUE",
                   help="a parameter of --left-strategy, repeated for each (e.g. --left-param r=0.3 --left-param "
                        "seed=1; `python -m index list` shows each strategy's) (default: none: the strategy's own "
                        "defaults)")
    g.add_argument("--left-mode", default=None, metavar="MODE",
                   help=f"mode of the left side, one of {', '.join(MODES)} (default: the right side's --mode, "
                        "cosine unless given, so that a report without left flags compares trained in the same "
                        "mode)")
    from .rerankers import RERANKERS

    rr = ("one of " + "; ".join(f"{e.name}: {e.doc.rstrip('.')}" for e in RERANKERS.entries())).replace("%", "%%")
    rr_params = RERANKERS.params_help().replace("%", "%%")
    g.add_argument("--left-rerank", default="none", metavar="NAME",
                   help=f"query-time re-ranker of the left side over its strategy's search, one of "
                        f"{', '.join(RERANKERS.names())}, as for --rerank (default: %(default)s)")
    g.add_argument("--left-rerank-param", action="append", default=[], metavar="KEY=VALUE",
                   help="a parameter of --left-rerank, repeated for each, as for --rerank-param (default: none: "
                        "the re-ranker's own defaults)")
    _strategy_args(rp)
    r = rp.add_argument_group("right re-ranker (y: over the right side's strategy and mode; every query is "
                              "re-ranked with its own item left out)")
    r.add_argument("--rerank", default="none", metavar="NAME",
                   help=f"query-time re-ranker of the right side, {rr} (default: %(default)s)")
    r.add_argument("--rerank-param", action="append", default=[], metavar="KEY=VALUE",
                   help=f"a parameter of --rerank, repeated for each (e.g. --rerank-param n=3 --rerank-param "
                        f"alpha=1; {rr_params}) (default: none: the re-ranker's own defaults)")
    rp.set_defaults(func=cmd_report)


def build_parser(defaults: dict | None = None) -> argparse.ArgumentParser:
    """`defaults`: {command: values} from a --config file, replacing the field defaults."""
    p, sub, defaults = command_parser("python -m index", __doc__, defaults)
    _build_parser(sub, defaults)
    for add in (_merge_parser, _add_parser, _remove_parser, _search_parser, _ivf_build_parser, _export_parser,
                _info_parser, _list_parser, _evaluate_parser, _select_parser, _report_parser):
        add(sub)
    return p


def main(argv=None) -> int:
    args = parse_with_config_file(build_parser, argv, {"build": BuildConfig})
    setup_logging(args.verbose)
    return args.func(args)
