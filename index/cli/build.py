"""`build`, `merge`, `add`, `remove`: write an index directory and change it (each write atomic,
under the index's lock)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from core.config import add_config_args
from core.errors import UserError
from data import DataConfig

from ..build_config import BuildConfig
from ..threads import batch_threads
from .flags import data_args, given_data


# ---------------------------------------------------------------- build
def build_index_parser(sub, defaults: dict) -> None:
    b = sub.add_parser("build", help="build an index from a data-set split, an image folder, or features")
    b.add_argument("--config", help="TOML file with these settings (flags given here override it); "
                                    "the data-set fields may sit in a [data] table")
    data_fields = tuple(f.name for f in dataclasses.fields(DataConfig))
    add_config_args(b, BuildConfig, skip=data_fields, defaults=defaults.get("build"))
    b.add_argument("--overwrite", action="store_true",
                   help="replace an existing index at --out; anything else there is never replaced "
                        "(default: refuse an existing --out)")
    data_args(b, defaults.get("build"))
    b.set_defaults(func=cmd_build)


def cmd_build(args) -> int:
    from ..backends.shard import distributed_rank
    from ..build import writing_index

    if not args.out:
        raise UserError("give --out (the index directory to write), on the command line or in --config")
    batch_threads(args.threads, one_blas_thread=False, torch=not args.features)
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
    from ..build import build_from_features, build_from_image_folder

    normalize, progress = args.normalize, args.progress
    if args.features:
        if not args.labels:
            raise UserError("--features needs --labels")
        path = build_from_features(args.features, args.labels, args.out, args.neck, normalize, args.factory)
    elif args.image_folder:
        if not args.checkpoint:
            raise UserError("--image-folder needs --checkpoint")
        path = build_from_image_folder(args.checkpoint, args.image_folder, args.out, normalize, args.factory,
                                       args.eval_batch_size, args.workers, given_data(args),
                                       progress=progress, device=args.device)
    elif args.checkpoint:
        path = _build_dataset(args)  # None on a torchrun rank other than 0
    else:
        raise UserError("give --checkpoint (its data set by default, or --image-folder) or --features")
    return path


def _build_dataset(args):
    from ..backends.shard import distributed_build, distributed_rank, parse_shard
    from ..build import build_from_dataset

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


# ---------------------------------------------------------------- merge
def merge_parser(sub) -> None:
    mg = sub.add_parser("merge", help="join shard indexes (`build --shard i/N`) into one index")
    mg.add_argument("shards", nargs="+", help="the shard index directories, in any order")
    mg.add_argument("--out", required=True, help="index directory to write (atomically)")
    mg.add_argument("--factory", help="FAISS factory string (default: Flat up to 1e5 items, else HNSW32)")
    mg.add_argument("--overwrite", action="store_true",
                    help="replace an existing index at --out (never anything else) (default: off)")
    mg.set_defaults(func=cmd_merge)


def cmd_merge(args) -> int:
    from ..backends.shard import merge_shards
    from ..build import writing_index

    with writing_index(args.out, args.overwrite):
        path = merge_shards(args.shards, args.out, args.factory)
    man = json.loads((Path(path) / "manifest.json").read_text())
    print(json.dumps({"count": man["count"], "classes": man["classes"], "shards": len(args.shards),
                      "index": str(path)}, indent=2))
    return 0


# ---------------------------------------------------------------- add, remove
def add_parser(sub) -> None:
    a = sub.add_parser("add", help="add images or feature vectors to an index")
    a.add_argument("--index", required=True, help="index directory to change (rewritten atomically)")
    a.add_argument("--images", nargs="+", help="image files to add")
    a.add_argument("--features", help="feature vectors .npy to add")
    a.add_argument("--labels", help="labels .npy for --features")
    a.add_argument("--label", type=int, default=-1, help="label for all added items (default: %(default)s: unknown)")
    a.add_argument("--checkpoint", help="model to embed images (default: the index's own)")
    a.set_defaults(func=cmd_add)


def cmd_add(args) -> int:
    from ..build import add_features, add_images

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


def remove_parser(sub) -> None:
    r = sub.add_parser("remove", help="remove items by id")
    r.add_argument("--index", required=True, help="index directory to change (rewritten atomically)")
    r.add_argument("--ids", required=True, type=lambda s: [int(v) for v in s.split(",") if v.strip()],
                   help="comma-separated ids")
    r.set_defaults(func=cmd_remove)


def cmd_remove(args) -> int:
    from ..build import remove_ids

    n = remove_ids(args.index, args.ids)
    print(json.dumps({"removed": n}))
    return 0
