"""Trunk features computed once per (backbone, weights, data, split, transform) and kept on disk.

The key hashes everything that decides the features: backbone name and a hash
of its exact parameter values, the data set's identity (kanji: its content
checksum; others: every file's path, size and mtime), the split's file list
and labels, and the full transform (size, resize, normalisation, augmentation).
A stale cache therefore can never be picked up: any change gives a new key.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from core.atomic import atomic_dir

log = logging.getLogger(__name__)
CACHE_VERSION = 1


def subset_identity(splits, subset) -> str:
    h = hashlib.sha256()
    h.update(splits.name.encode())
    h.update(str(splits.info.get("checksum", "")).encode())
    kanji = "checksum" in splits.info  # content-addressed already
    for p, y in zip(subset.paths, subset.labels):
        h.update(f"{p}\t{y}\n".encode())
        if not kanji:
            try:
                st = os.stat(subset.root / p)
                h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())
            except OSError:
                h.update(b"missing")
    return h.hexdigest()


def cache_key(backbone, splits, subset, spec) -> str:
    blob = json.dumps({
        "v": CACHE_VERSION, "backbone": backbone.name, "weights": backbone.fingerprint(),
        "data": subset_identity(splits, subset), "split": subset.name,
        "transform": spec.describe(),
    }, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


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
