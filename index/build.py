"""Building and changing index directories (the Python API the CLI and the app use)."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path

import numpy as np

from core.arrays import check_labels, check_matrix, l2_normalize, load_npy
from core.atomic import guard_output
from core.errors import UserError
from core.hashing import sha256_file
from core.locks import exclusive_lock
from data import DataConfig
from model.checkpoint import data_config_for, load_model
from model.device import resolve_device
from model.features import embed_split, embed_subset
from model.preprocess import transform_for

from .backends.store import Items, is_index, read_index, write_index

log = logging.getLogger("index")


@contextlib.contextmanager
def writing_index(out, overwrite: bool = False, lock: bool = True):
    """Hold the index path's lock while an index is built at `out`, and refuse an `out` that
    holds anything but an index, or an index unless `overwrite`.  `lock=False`: the guard only
    (torchrun ranks that never write `out` themselves)."""
    if not lock:
        guard_output(out, is_index, overwrite, "index")
        yield
        return
    with exclusive_lock(out):
        guard_output(out, is_index, overwrite, "index")
        yield


def _model_info(checkpoint, ck, spec) -> dict:
    return {"checkpoint": str(Path(checkpoint).resolve()), "checkpoint_sha256": sha256_file(checkpoint),
            "backbone": ck["backbone"], "transform": spec.describe()}


def build_from_dataset(checkpoint, data: dict | DataConfig | None, out, split: str = "test",
                       normalize: bool = True, factory: str | None = None, cache_dir: str | None = None,
                       progress: bool = True, device: str = "cpu", shard: tuple[int, int] | None = None) -> Path:
    """Index a data-set split (In-Shop 'test' = its gallery) with a checkpoint's backbone.
    The data settings are the checkpoint's; `data` overrides some (see model.features.embed_split).
    `shard` (i, n): only the i-th of n blocks of the split, ids global (`index merge` joins them)."""
    e = embed_split(checkpoint, data, split, cache_dir, progress, device=device, shard=shard)
    sub = e.subset
    # ids are positions in the split: the same whether it is indexed whole or in shards
    items = Items(e.kept.astype(np.int64), e.labels.astype(np.int64),
                  [sub.paths[i] for i in e.kept], [sub.name] * len(e.kept))
    info = _model_info(checkpoint, e.ck, e.spec) | {"dataset": e.data.dataset, "split": sub.name,
                                                    "data": e.data.data_fields()}
    if shard is not None:
        info["shard"] = {"index": shard[0], "count": shard[1], "split_images": len(sub)}
    return write_index(out, e.feats, items, e.model.W.numpy(), normalize=normalize, info=info, factory=factory,
                       class_names=e.splits.class_names, root=str(Path(sub.root).resolve()))


def build_from_image_folder(checkpoint, folder, out, normalize: bool = True, factory: str | None = None,
                            batch_size: int = 128, workers: int | str = "auto", data: dict | None = None,
                            progress: bool = True, device: str = "cpu") -> Path:
    """Index every image under `folder`; sub-folder names become class labels.  The images are
    preprocessed as the checkpoint's (its image size and resize mode), unless `data` overrides them."""
    from data.imagefolder import scan_image_folder
    from data.splits import Subset

    model, ck = load_model(checkpoint)
    bb = model.backbone.eval()
    root, paths, labels, names = scan_image_folder(folder)
    given = {k: v for k, v in (data or {}).items() if k in ("image_size", "resize_mode")} | {"data_root": str(folder)}
    dcfg = dataclasses.replace(data_config_for(ck, given, f"checkpoint {checkpoint}"),
                               eval_batch_size=batch_size, workers=workers)
    dcfg.validate()
    spec = transform_for(bb, dcfg)
    dev = resolve_device(device)
    feats, ys, kept, skipped = embed_subset(bb.to(dev), Subset("gallery", root, paths, labels), spec, dcfg,
                                            "index images", progress, device=dev)
    bb.to("cpu")
    if skipped:
        log.warning("%d unreadable images left out of the index", len(skipped))
    feats = model.trunk_of_backbone(feats)
    items = Items(np.arange(len(kept), dtype=np.int64), ys, [paths[i] for i in kept], ["gallery"] * len(kept))
    return write_index(out, feats, items, model.W.numpy(), normalize=normalize,
                       info=_model_info(checkpoint, ck, spec) | {"dataset": "imagefolder"},
                       factory=factory, class_names=names, root=str(Path(root).resolve()))


def build_from_features(features, labels, out, neck=None, normalize: bool = True,
                        factory: str | None = None) -> Path:
    """Index precomputed trunk features; without a neck W, M* is the identity."""
    F = check_matrix(load_npy(features, "features"), f"features file {features}")
    L = check_labels(load_npy(labels, "labels"), f"labels file {labels}", len(F))
    W = check_matrix(load_npy(neck, "neck W"), f"neck W file {neck}") if neck else np.eye(F.shape[1], dtype=np.float32)
    if W.shape[1] != F.shape[1]:
        raise UserError(f"neck W must be k × {F.shape[1]}, got shape {W.shape}")
    items = Items(np.arange(len(F), dtype=np.int64), L, [""] * len(F), ["features"] * len(F))
    return write_index(out, F, items, W, normalize=normalize, factory=factory,
                       info={"checkpoint": None, "checkpoint_sha256": None, "backbone": None,
                             "dataset": "features"})


def _rewrite(data, feats, items, out=None) -> Path:
    man = data.manifest
    info = {k: man[k] for k in ("checkpoint", "checkpoint_sha256", "backbone", "transform", "dataset", "split",
                                "data") if k in man}
    factory = man["factory"]
    # features are already normalised if the index normalises: write_index's normalisation is a no-op
    return write_index(out or data.path, feats, items, data.W, normalize=man["normalize"], info=info,
                       factory=factory, class_names=data.class_names, root=data.root)


def add_features(index_dir, feats: np.ndarray, labels, paths=None, split: str = "added",
                 what: str = "new features") -> list[int]:
    """Append items; returns their new ids.  The directory is rewritten atomically, under the
    index's lock (a concurrent change is refused, not lost).  `labels`: one per row, or one for all."""
    feats = check_matrix(feats, what, allow_1d=True)
    labels = np.asarray(labels)
    labels = check_labels(labels if labels.ndim else np.full(len(feats), labels), f"labels of the {what}",
                          len(feats))
    with exclusive_lock(index_dir):
        return _append(read_index(index_dir), feats, labels, paths, split)


def _append(data, feats, labels, paths, split) -> list[int]:
    if feats.shape[1] != data.dim:
        raise UserError(f"new features are {feats.shape[1]}-d; this index holds {data.dim}-d features")
    start = int(data.items.ids.max()) + 1 if len(data.items) else 0
    ids = np.arange(start, start + len(feats), dtype=np.int64)
    new = Items(ids, labels, list(paths) if paths is not None else [""] * len(feats), [split] * len(feats))
    if data.manifest["normalize"]:
        feats = l2_normalize(feats)
    all_feats = np.concatenate([np.asarray(data.features), feats])
    _rewrite(data, all_feats, data.items.concat(new))
    return ids.tolist()


def add_images(index_dir, images, labels, checkpoint=None) -> list[int]:
    from .embedder import ImageEmbedder

    data = read_index(index_dir)
    emb = ImageEmbedder(checkpoint or data.manifest.get("checkpoint") or "", data.manifest)
    paths = [str(Path(p).resolve()) for p in images]
    return add_features(index_dir, emb.features(paths), labels, paths)


def remove_ids(index_dir, ids) -> int:
    """Remove items by id, under the index's lock; returns how many."""
    with exclusive_lock(index_dir):
        return _remove(read_index(index_dir), ids)


def _remove(data, ids) -> int:
    ids = np.asarray(list(ids), dtype=np.int64)
    unknown = sorted(set(ids.tolist()) - set(data.items.ids.tolist()))
    if unknown:
        raise UserError(f"ids not in the index: {unknown[:10]}")
    keep = ~np.isin(data.items.ids, ids)
    if not keep.any():
        raise UserError("removing every item would leave an empty index")
    _rewrite(data, np.asarray(data.features)[keep], data.items.subset(keep))
    return int((~keep).sum())


def split_features(checkpoint, data: dict | DataConfig | None, split: str,
                   cache_dir: str | None = "cache/features", progress: bool = True, device: str = "cpu"):
    """(trunk features, labels, W) of a data-set split under a checkpoint (query = gallery);
    data settings as in build_from_dataset."""
    e = embed_split(checkpoint, data, split, cache_dir, progress, use_gallery=False, device=device)
    return e.feats, e.labels, e.model.W.numpy()
