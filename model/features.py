"""Embedding a data set, and the on-disk feature cache (used by training, index and demo).

Trunk features are computed once per (backbone, weights, data, split, transform)
and kept on disk.  The key hashes everything that decides the features: backbone
name and a hash of its exact parameter values, the data set's identity (kanji:
its content checksum; others: every file's path, size and mtime), the split's
file list and labels, and the full transform (size, resize, normalisation,
augmentation).  A stale cache therefore can never be picked up: any change gives
a new key.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from tqdm import tqdm

from core.atomic import atomic_dir
from core.errors import UserError
from data import DataConfig, load_data
from data.loader import make_loader

from .device import autocast, resolve_device
from .preprocess import TransformSpec, transform_for

if TYPE_CHECKING:
    from data.splits import DatasetSplits, Subset

    from .network import EmbeddingModel

log = logging.getLogger(__name__)
CACHE_VERSION = 1


@torch.inference_mode()
def extract(fn, loader, desc: str = "embed", progress: bool = True, device: torch.device | None = None,
            precision: str = "fp32"):
    """Run `fn` over every batch (on `device`, the one `fn`'s parameters live on).  Returns
    (features float32 N×d, labels, kept indices, skipped).

    `skipped` lists (index, message) of unreadable images; they are absent from
    the outputs, and the count is logged.
    """
    device = device or torch.device("cpu")
    feats, labels, idx, skipped = [], [], [], []
    for images, y, i, bad in tqdm(loader, desc=desc, unit="batch", disable=not progress):
        skipped.extend(bad)
        for _, msg in bad:
            log.warning("skipped: %s", msg)
        if images is None:
            continue
        with autocast(device, precision):
            out = fn(images.to(device, non_blocking=True))
        feats.append(out.float().cpu().numpy())
        labels.append(y.numpy())
        idx.append(i.numpy())
    if skipped:
        log.warning("%d unreadable image(s) skipped in %s", len(skipped), desc)
    if not feats:
        return np.zeros((0, 0), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64), skipped
    return (np.concatenate(feats).astype(np.float32), np.concatenate(labels).astype(np.int64),
            np.concatenate(idx).astype(np.int64), skipped)


def embed_subset(fn, subset, spec: TransformSpec, dcfg: DataConfig, desc: str, progress: bool = True,
                 device: torch.device | None = None, precision: str = "fp32", loader=None):
    """(features, labels, kept indices, skipped) of a Subset's images under `fn` (on `device`);
    `loader`: one of `subset_loader`'s to reuse (e.g. every epoch's validation), else a new one."""
    device = device or torch.device("cpu")
    if len(subset) == 0:
        raise UserError(f"the {subset.name} split has no images (under {subset.root})")
    loader = loader or subset_loader(subset, spec, dcfg, device)
    out = extract(fn, loader, desc=desc, progress=progress, device=device, precision=precision)
    if len(out[2]) == 0:
        raise UserError(f"no readable images in {subset.root} ({subset.name} split: all {len(subset)} "
                        f"failed to load, e.g. {out[3][0][1]})")
    return out


def subset_loader(subset, spec: TransformSpec, dcfg: DataConfig, device: torch.device, persistent: bool = False):
    """The loader that embeds a subset's images (`spec`, --eval-batch-size, --workers); `persistent`
    keeps its worker processes for the next pass."""
    return make_loader(subset, spec.build(), batch_size=dcfg.eval_batch_size, workers=dcfg.workers,
                       pin_memory=device.type == "cuda", persistent=persistent)


def subset_identity(splits, subset) -> str:
    h = hashlib.sha256()
    h.update(splits.name.encode())
    h.update(str(splits.info.get("checksum", "")).encode())
    kanji = "checksum" in splits.info  # content-addressed already
    for p, y in zip(subset.paths, subset.labels, strict=True):
        h.update(f"{p}\t{y}\n".encode())
        if not kanji:
            try:
                st = os.stat(subset.root / p)
                h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
            except OSError:
                h.update(b"missing")
    return h.hexdigest()


def cache_key(backbone, splits, subset, spec, prefix: int | None = None) -> str:
    """Feature-cache key; with `prefix`, the key of the first `prefix` stages' output maps."""
    d = {"v": CACHE_VERSION, "backbone": backbone.name, "weights": backbone.fingerprint(prefix),
         "data": subset_identity(splits, subset), "split": subset.name, "transform": spec.describe()}
    if prefix is not None:
        d["prefix_stages"] = prefix
        if backbone.prefix_dtype != torch.float16:  # float16, the default, leaves the keys as they are
            d["prefix_dtype"] = str(backbone.prefix_dtype)
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:20]


def cached_features(backbone, splits, subset, spec, embed_fn, cache_dir="cache/features",
                    progress: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features N×d float32, labels, kept indices into subset); computed on a miss."""
    key = cache_key(backbone, splits, subset, spec)
    d = Path(cache_dir) / f"{backbone.name}-{splits.name}-{subset.name}-{key}"
    if (d / "meta.json").is_file():
        log.info("feature cache hit: %s", d)
        return (np.load(d / "features.npy", allow_pickle=False),
                np.load(d / "labels.npy", allow_pickle=False),
                np.load(d / "index.npy", allow_pickle=False))
    feats, labels, idx, skipped = embed_fn(subset, spec)
    with atomic_dir(d) as tmp:
        np.save(tmp / "features.npy", feats)
        np.save(tmp / "labels.npy", labels)
        np.save(tmp / "index.npy", idx)
        (tmp / "meta.json").write_text(json.dumps({
            "backbone": backbone.name, "split": subset.name, "n": int(len(labels)),
            "dim": int(feats.shape[1]) if feats.ndim == 2 else 0, "skipped": [m for _, m in skipped],
            "transform": spec.describe(), "key": key}, indent=2))
    return feats, labels, idx


def _rows_to_memmap(path: Path, loader, rows, n_max: int, desc: str, progress: bool):
    """Each readable image's row into one .npy file at `path`, written as a memory map with room for
    `n_max` rows (unreadable images leave unused rows at its end).  `rows(images)` turns a batch into
    (rows, extra): a row array, and per-image values kept beside it (or None).
    Returns (labels, kept indices, extras, {index: message} of the unreadable images), or None when
    no image could be read."""
    out = None
    labels, kept, extras, skipped, n = [], [], [], {}, 0
    for images, y, i, bad in tqdm(loader, desc=desc, unit="batch", disable=not progress):
        for j, msg in bad:
            log.warning("skipped: %s", msg)
            skipped[int(j)] = msg
        if images is None:
            continue
        r, extra = rows(images)
        if out is None:
            out = np.lib.format.open_memmap(path, mode="w+", dtype=r.dtype, shape=(n_max, *r.shape[1:]))
        out[n: n + len(r)] = r
        n += len(r)
        labels.append(y.numpy())
        kept.append(i.numpy())
        if extra is not None:
            extras.append(extra)
    if out is None:
        return None
    out.flush()
    del out
    return (np.concatenate(labels).astype(np.int64), np.concatenate(kept).astype(np.int64),
            np.concatenate(extras) if extras else None, skipped)


@dataclass
class PrefixCache:
    """Output maps of a backbone's frozen prefix for one subset, in its `prefix_dtype` (float16 for
    the convolutional backbones, float32 for timm's), memory-mapped."""
    maps: np.ndarray        # N × C × H × W (a ViT's: N × tokens × C) (np.memmap): rows of the kept images
    labels: np.ndarray
    kept: np.ndarray        # indices into the subset
    path: Path


def _prefix_dir(backbone, n_stages: int, splits, subset, spec: TransformSpec, cache_dir: str) -> Path:
    if not 0 < n_stages < len(backbone.stages()):
        raise UserError(f"a cached prefix needs 1 … {len(backbone.stages()) - 1} stages, got {n_stages}")
    key = cache_key(backbone, splits, subset, spec, prefix=n_stages)
    return Path(cache_dir) / f"{backbone.name}-prefix{n_stages}-{splits.name}-{subset.name}-{key}"


def _finish_prefix(d: Path, tmp: Path, backbone, n_stages: int, subset, spec: TransformSpec, labels, kept) -> None:
    """A prefix cache's labels, kept indices and meta.json, beside its maps in `tmp` (written into `d`)."""
    np.save(tmp / "labels.npy", labels)
    np.save(tmp / "index.npy", kept)
    (tmp / "meta.json").write_text(json.dumps({
        "backbone": backbone.name, "prefix_stages": n_stages, "split": subset.name, "n": len(labels),
        "transform": spec.describe(), "key": d.name.rsplit("-", 1)[-1]}, indent=2))


@torch.inference_mode()
def cached_prefix(backbone, n_stages: int, splits, subset, spec: TransformSpec, dcfg: DataConfig,
                  cache_dir: str, progress: bool = True, device: torch.device | None = None) -> PrefixCache:
    """The first `n_stages` stages' outputs for every image of `subset`, computed once (the prefix is
    frozen and sees no augmentation, so its output is a pure function of the image) and stored
    as .npy in the backbone's `prefix_dtype`, memory-mapped on read so RAM stays bounded by the batch."""
    d = _prefix_dir(backbone, n_stages, splits, subset, spec, cache_dir)
    if not (d / "meta.json").is_file():
        device = device or torch.device("cpu")
        # a move inside inference mode would make the parameters inference tensors, which the tail
        # that trains next cannot set to require gradients (on CUDA, where the move copies)
        with torch.inference_mode(False):
            backbone.eval().to(device)
        loader = make_loader(subset, spec.build(), batch_size=dcfg.eval_batch_size, workers=dcfg.workers)

        def rows(images):
            return backbone.run_stages(images.to(device), 0, n_stages).to("cpu", backbone.prefix_dtype).numpy(), None

        with atomic_dir(d) as tmp:
            out = _rows_to_memmap(tmp / "maps.npy", loader, rows, len(subset), f"prefix {subset.name}", progress)
            if out is None:
                raise UserError(f"no readable images in {subset.root} ({subset.name} split)")
            labels, kept, _, _ = out
            _finish_prefix(d, tmp, backbone, n_stages, subset, spec, labels, kept)
    else:
        log.info("prefix cache hit: %s", d)
    labels = np.load(d / "labels.npy", allow_pickle=False)
    maps = np.load(d / "maps.npy", mmap_mode="r", allow_pickle=False)[: len(labels)]
    return PrefixCache(maps, labels, np.load(d / "index.npy", allow_pickle=False), d)


@dataclass
class ImageCache:
    """One subset's images, decoded once: uint8 pixels, memory-mapped, one row per readable image."""
    pixels: np.ndarray      # N × S × S × 3 uint8 (np.memmap, copy-on-write: torch reads it without a copy)
    sizes: np.ndarray       # N × 2: each original image's (width, height)
    labels: np.ndarray
    kept: np.ndarray        # indices into the subset
    skipped: dict           # index into the subset → why that image could not be read
    path: Path


def pixel_geometry(spec: TransformSpec) -> dict:
    """What decides a decoded-image cache's pixels.  A training spec (`augment`): the whole image
    squashed to the square input size, the crop being cut from it per step (model/augment.py); an
    evaluation spec: its geometry (normalisation is applied on read, so it is not part of it)."""
    if spec.augment:
        return {"image_size": spec.image_size, "fit": "whole image squashed"}
    return {k: v for k, v in spec.describe().items() if k not in ("mean", "std")}


class _Pixels:
    """PIL image → (uint8 H × W × 3 pixels, its original (width, height))."""

    def __init__(self, spec: TransformSpec):
        from torchvision.transforms import v2 as T

        s = spec.image_size
        self.tf = T.Compose([T.ToImage(), T.Resize((s, s), antialias=True)]) if spec.augment else spec.build_pixels()

    def __call__(self, img):
        return self.tf(img).permute(1, 2, 0).contiguous(), torch.tensor(img.size, dtype=torch.int32)


def image_cache_bytes(n_images: int, size: int) -> int:
    return n_images * size * size * 3


def cached_images(splits, subset, spec: TransformSpec, dcfg: DataConfig, cache_dir: str,
                  progress: bool = True) -> ImageCache:
    """Every image of `subset` decoded once at the input size and kept as uint8 (`pixel_geometry`):
    keyed like the feature cache (the data's identity, the split, the geometry), written atomically,
    memory-mapped on read, and reused by every later epoch and run."""
    geometry = pixel_geometry(spec)
    identity = {"v": CACHE_VERSION, "kind": "pixels", "data": subset_identity(splits, subset), "split": subset.name,
                "geometry": geometry}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]
    d = Path(cache_dir) / f"pixels{spec.image_size}-{splits.name}-{subset.name}-{key}"
    if not (d / "meta.json").is_file():
        if len(subset) == 0:
            raise UserError(f"the {subset.name} split has no images (under {subset.root})")
        loader = make_loader(subset, _Pixels(spec), batch_size=dcfg.eval_batch_size, workers=dcfg.workers)

        def rows(images):
            pixels, sizes = images
            return pixels.numpy(), sizes.numpy()

        with atomic_dir(d) as tmp:
            out = _rows_to_memmap(tmp / "pixels.npy", loader, rows, len(subset), f"decode {subset.name}", progress)
            if out is None:
                raise UserError(f"no readable images in {subset.root} ({subset.name} split: all {len(subset)} "
                                "failed to load)")
            labels, kept, sizes, skipped = out
            np.save(tmp / "labels.npy", labels)
            np.save(tmp / "index.npy", kept)
            np.save(tmp / "sizes.npy", sizes.astype(np.int32))
            (tmp / "meta.json").write_text(json.dumps({
                "split": subset.name, "n": len(labels), "geometry": geometry, "key": key,
                "skipped": {str(k): v for k, v in skipped.items()}}, indent=2))
    else:
        log.info("decoded-image cache hit: %s", d)
    meta = json.loads((d / "meta.json").read_text())
    labels = np.load(d / "labels.npy", allow_pickle=False)
    pixels = np.load(d / "pixels.npy", mmap_mode="c", allow_pickle=False)[: len(labels)]
    return ImageCache(pixels, np.load(d / "sizes.npy", allow_pickle=False), labels,
                      np.load(d / "index.npy", allow_pickle=False), {int(k): v for k, v in meta["skipped"].items()}, d)


def backbone_features(backbone, splits, subset, spec: TransformSpec, dcfg: DataConfig,
                      cache_dir: str | None, progress: bool = True, device: torch.device | None = None,
                      prefix_stages: int | None = None):
    """Frozen backbone features of a subset: through the cache when `cache_dir`, else computed
    (on `device`; features come back on the CPU, float32, whatever the device).  `prefix_stages`:
    a pass that computes the features also stores the first that many stages' output maps in the
    prefix cache (what `cached_prefix` would compute, bit for bit), so that a trained tail over the
    same images does not run the prefix again."""
    device = device or torch.device("cpu")
    backbone.eval().to(device)

    def embed(sub, sp):
        if prefix_stages and cache_dir:
            d = _prefix_dir(backbone, prefix_stages, splits, sub, sp, cache_dir)
            if not (d / "meta.json").is_file():
                return _features_and_prefix(backbone, prefix_stages, d, sub, sp, dcfg, progress, device)
        return embed_subset(backbone, sub, sp, dcfg, f"features {sub.name}", progress, device=device)

    if cache_dir:
        return cached_features(backbone, splits, subset, spec, embed, cache_dir, progress)
    feats, labels, kept, skipped = embed(subset, spec)
    if skipped:
        log.warning("%d unreadable images left out", len(skipped))
    return feats, labels, kept


def _features_and_prefix(backbone, n_stages: int, d: Path, subset, spec: TransformSpec, dcfg: DataConfig,
                         progress: bool, device: torch.device):
    """embed_subset's result for the whole backbone, with the prefix's maps written into the prefix
    cache `d` on the way (the same loader and batches as cached_prefix: the same bits)."""
    with atomic_dir(d) as tmp:
        rows: dict = {"out": None, "n": 0}

        def fn(images):
            h = backbone.run_stages(images, 0, n_stages)
            r = h.to("cpu", backbone.prefix_dtype).numpy()
            if rows["out"] is None:
                rows["out"] = np.lib.format.open_memmap(tmp / "maps.npy", mode="w+", dtype=r.dtype,
                                                        shape=(len(subset), *r.shape[1:]))
            rows["out"][rows["n"]: rows["n"] + len(r)] = r
            rows["n"] += len(r)
            return backbone.run_stages(h, n_stages)

        loader = make_loader(subset, spec.build(), batch_size=dcfg.eval_batch_size, workers=dcfg.workers)
        out = embed_subset(fn, subset, spec, dcfg, f"features {subset.name}", progress, device=device, loader=loader)
        rows["out"].flush()
        del rows["out"]
        _finish_prefix(d, tmp, backbone, n_stages, subset, spec, out[1], out[2])
    return out


@dataclass
class SplitFeatures:
    model: EmbeddingModel
    ck: dict
    data: DataConfig        # the data configuration used: the checkpoint's, with any overrides
    splits: DatasetSplits
    subset: Subset
    spec: TransformSpec
    feats: np.ndarray       # trunk features φ (after any trunk flow head)
    labels: np.ndarray
    kept: np.ndarray        # indices into subset of the images that could be read


def embed_split(checkpoint, data: dict | DataConfig | None, split: str, cache_dir: str | None,
                progress: bool = True, use_gallery: bool = True, device: str = "cpu",
                shard: tuple[int, int] | None = None) -> SplitFeatures:
    """Embed a data-set split's images with a checkpoint's trunk (through the feature cache).

    The data configuration is the checkpoint's own; `data` holds the settings given to override
    it (None values and a 0 image size mean "not given").

    For a query/gallery split (In-Shop 'test'), `use_gallery` picks the gallery; otherwise the
    query = gallery protocol is required.  `shard` (i, n) embeds only the i-th of n contiguous
    blocks of the split's images; `kept` are then positions in the whole split (global ids).
    """
    from .checkpoint import data_config_for, load_model

    model, ck = load_model(checkpoint)
    dcfg = data_config_for(ck, data, f"checkpoint {checkpoint}")
    splits = load_data(dcfg, progress=progress)
    spec = transform_for(model.backbone, dcfg)
    query, gallery = splits.eval_pair(split)
    if gallery is not None and not use_gallery:
        raise UserError("strategy evaluation uses the query = gallery protocol; this split is query/gallery")
    sub = gallery if gallery is not None else query
    part, rows = sub, np.arange(len(sub))
    if shard is not None:
        rows = np.array_split(rows, shard[1])[shard[0]]
        part = dataclasses.replace(sub, paths=[sub.paths[r] for r in rows], labels=[sub.labels[r] for r in rows])
    dev = resolve_device(device)
    feats, labels, kept = backbone_features(model.backbone, splits, part, spec, dcfg, cache_dir, progress, dev)
    kept = rows[kept]
    model.backbone.to("cpu")  # the neck and flows run on the CPU features
    return SplitFeatures(model, ck, dcfg, splits, sub, spec, model.trunk_of_backbone(feats), labels, kept)
