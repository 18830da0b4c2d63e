"""`ivf-build`, `export`: the galleries the other backends search, an on-disk IVF index and a
Milvus collection, written from an index directory (or, for the IVF, bare features)."""
from __future__ import annotations

import json

from core.errors import UserError
from core.flags import add_shared_args

from ..backends.flags import milvus_args, milvus_token
from ..refinements import shared_params
from .flags import key_values_from, strategy_param_args


# ---------------------------------------------------------------- ivf-build
def ivf_build_parser(sub) -> None:
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
    v.add_argument("--train-seed", type=int, default=0,
                   help="seed of the training sample (default: %(default)s)")
    g = v.add_argument_group("cosine lists (cosine mode searches a strategy's own lists, over Lx/‖Lx‖ for M′ = LᵀL)")
    g.add_argument("--cosine-for", default="trained,identity", metavar="STRATEGY[,STRATEGY...]",
                   help="build the cosine lists of these strategies (each with the parameter flags below that it "
                        "takes) beside the lists; the default is the app's two default searches; none: skip "
                        "(default: %(default)s)")
    g.add_argument("--ivf", help="only add --cosine-for's cosine lists to this existing on-disk IVF directory "
                                 "(default: none; build the IVF too)")
    strategy_param_args(g)
    v.set_defaults(func=cmd_ivf_build)


def cmd_ivf_build(args) -> int:
    from ..backends.ondisk import MANIFEST, build_cosine_lists, build_for_index, build_ondisk_ivf
    from ..refinements import REFINEMENTS

    kw = {"nlist": args.nlist or None, "codec": args.codec, "shard_rows": args.shard_rows,
          "train_size": args.train_size or None, "seed": args.train_seed}
    names = [] if args.cosine_for.strip() == "none" else [s.strip() for s in args.cosine_for.split(",") if s.strip()]
    for name in names:
        REFINEMENTS.get(name)   # an unknown name is refused before anything is built
    cosine = [(name, cosine_params(args, name, names)) for name in names]
    if args.ivf:
        if args.index or args.features or not cosine:
            raise UserError("--ivf DIR adds cosine lists to an existing on-disk IVF: give --cosine-for STRATEGY "
                            "and neither --index nor --features")
        built = [_cosine_summary(build_cosine_lists(args.ivf, s, p, shard_rows=args.shard_rows, seed=args.train_seed))
                 for s, p in cosine]
        print(json.dumps(built, indent=2))
        return 0
    if bool(args.index) == bool(args.features):
        raise UserError("give one of --index IDX (an index directory), --features F.npy, or --ivf DIR with "
                        "--cosine-for STRATEGY")
    if args.index:
        out = build_for_index(args.index, args.out, cosine_for=(), **kw)   # cosine lists below
    else:
        from core.arrays import load_npy

        if not args.out:
            raise UserError("--features needs --out (the on-disk index directory to write)")
        W = load_npy(args.neck, "neck W") if args.neck else None
        out = build_ondisk_ivf(args.features, args.out, W=W, normalize=args.normalized, **kw)
    man = json.loads((out / MANIFEST).read_text())
    summary = ({k: man[k] for k in ("count", "dim", "nlist", "codec", "shards", "normalize")}
               | {"bytes_on_disk": sum(f["bytes"] for f in man["files"].values()), "ivf": str(out)})
    if cosine:
        summary["cosine"] = [_cosine_summary(build_cosine_lists(out, s, p, shard_rows=args.shard_rows,
                                                                seed=args.train_seed)) for s, p in cosine]
    print(json.dumps(summary, indent=2))
    return 0


def cosine_params(args, name: str, names: list[str]) -> dict:
    """Strategy `name`'s values of the parameter flags; a flag that no strategy in `names` takes is
    refused (ignoring it would build the lists of another M′ than the one asked for)."""
    given = {sp.name: getattr(args, sp.name) for sp in shared_params() if getattr(args, sp.name) is not None}
    for sp in shared_params():
        if sp.name in given and not any(n in sp.defaults for n in names):
            raise UserError(f"--cosine-for {','.join(names) or 'none'} takes no {sp.flag}; "
                            f"{', '.join(sp.defaults)} {'do' if len(sp.defaults) > 1 else 'does'}")
    takes = {sp.name for sp in shared_params() if name in sp.defaults}
    return {k: v for k, v in given.items() if k in takes}


def _cosine_summary(lists) -> dict:
    from ..backends.ondisk import COSINE_MANIFEST

    man = json.loads((lists / COSINE_MANIFEST).read_text())
    return ({k: man[k] for k in ("strategy", "params", "rank", "nlist", "codec", "build_s")}
            | {"bytes_on_disk": sum(f["bytes"] for f in man["files"].values()), "lists": str(lists)})


# ---------------------------------------------------------------- export
def export_parser(sub) -> None:
    x = sub.add_parser("export", help="copy an index directory's features and metadata into a vector database")
    x.add_argument("--to", choices=("milvus",), required=True, help="target database (a collection with metric IP)")
    x.add_argument("--index", required=True, help="index directory to export")
    milvus_args(x)
    x.add_argument("--index-type", choices=("FLAT", "IVF_FLAT", "HNSW"), default="FLAT",
                   help="Milvus index on the vectors; other than FLAT, search re-ranks candidates exactly "
                        "(default: %(default)s)")
    x.add_argument("--index-param", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help="the Milvus index's build parameters, each unset one at its default: HNSW M=16, "
                        "efConstruction=100; IVF_FLAT nlist = a power of two near √N (default: none given)")
    x.add_argument("--overwrite", action="store_true", help="replace a collection of that name")
    add_shared_args(x, "progress")
    x.set_defaults(func=cmd_export)


def _index_params(values: list[str], index_type: str) -> dict:
    """--index-param's KEY=VALUE pairs as whole numbers, refused in one line otherwise."""
    out = {}
    for key, text in key_values_from(values, "--index-param").items():
        if index_type == "FLAT":
            raise UserError("--index-param: a FLAT index takes no build parameters")
        try:
            out[key] = int(text)
        except ValueError:
            raise UserError(f"--index-param {key} wants a whole number, got {text!r}") from None
        if out[key] < 1:
            raise UserError(f"--index-param {key} must be ≥ 1, got {out[key]}")
    return out


def cmd_export(args) -> int:
    from ..backends.milvus_store import export_index

    if not (args.uri and args.collection):
        raise UserError("export --to milvus needs --uri and --collection")
    params = _index_params(args.index_param, args.index_type)
    n = export_index(args.index, args.uri, args.collection, token=milvus_token(args), overwrite=args.overwrite,
                     index_type=args.index_type, index_params=params, progress=args.progress)
    print(json.dumps({"exported": n, "to": args.to, "uri": args.uri, "collection": args.collection,
                      "metric_type": "IP", "index_type": args.index_type}))
    return 0
