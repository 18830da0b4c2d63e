"""The gallery the app serves, on any backend, opened as `index search --backend` opens it.

  faiss    the index directory's FAISS index, in RAM (`--index`)
  ondisk   an on-disk IVF (`--ivf`, default INDEX/ivf_ondisk), built from an index directory
  milvus   a collection written by `index export --to milvus` (`--uri`, `--collection`)

`Served` is what the app reads besides the searches: the items' metadata (ids, labels, paths,
class names, the image root), the neck W, the model facts, and the items' trunk features per
row, read only where needed: the index directory's features.npy memory-mapped (faiss, ondisk),
or the collection's vectors fetched by row (`MilvusRows`).  Nothing reads the whole gallery's
features at start-up.  `view` is the same as an `IndexData`, and `metrics` a `Searcher` over it:
M′ per strategy, and the exact scores the why panel ranks by (faiss: the gallery itself).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import UserError
from index.backends.flags import BACKENDS
from index.backends.gallery import Gallery
from index.backends.search import Searcher
from index.backends.store import IndexData, Items, read_index
from index.space import key_hash


class MilvusRows:
    """A Milvus collection's vectors as a read-only N × d array: `rows[i]`, `rows[a:b]`,
    `rows[array]` fetch only those rows (by the `row` field), in the order asked."""

    def __init__(self, gallery, n: int, d: int):
        self.gallery, self.shape, self.dtype = gallery, (n, d), np.dtype(np.float32)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def ndim(self) -> int:
        return 2

    def _fetch(self, rows: np.ndarray) -> np.ndarray:
        return self.gallery.fetch_rows(rows)

    def __getitem__(self, key):
        if isinstance(key, slice):
            return self._fetch(np.arange(*key.indices(self.shape[0]), dtype=np.int64))
        if isinstance(key, (int, np.integer)):
            return self._fetch(np.array([int(key)]))[0]
        rows = np.asarray(key, dtype=np.int64).reshape(-1)
        if ((rows < 0) | (rows >= self.shape[0])).any():
            raise IndexError("row out of range")
        return self._fetch(rows)

    def __array__(self, dtype=None, copy=None):
        raise UserError("the Milvus backend reads its vectors by row, not the whole collection at once")


def milvus_items(gallery) -> Items:
    """Every item's id, label, path and split, in row order (no vectors)."""
    return gallery.items


@dataclass
class Served:
    backend: str
    gallery: Gallery     # every search
    view: IndexData      # metadata, W, model facts, features by row
    metrics: Searcher    # M′ per strategy and exact scores over `view` (the why panel, the maps)
    where: str           # what the page header and exports call it

    @cached_property
    def content(self) -> str:
        """A digest of the gallery's content, computed once: the index directory's checksums (faiss;
        ondisk: the source index's and the IVF's own files), the collection's (milvus)."""
        from index.analysis.compare import data_digest

        g: Any = self.gallery  # the backend's own gallery class
        if self.backend == "milvus":  # its vectors' checksum and its neck: the vectors are read by row
            neck = hashlib.sha256(np.ascontiguousarray(self.view.W, dtype="<f4").tobytes()).hexdigest()
            return key_hash("milvus", g.content_key, neck)
        own = g.manifest.get("files") if self.backend == "ondisk" else None
        return key_hash(self.backend, data_digest(self.view), own)

    @property
    def digest(self) -> str:
        """What the app's results are kept under (app/cache.py): the gallery's `content` and how it
        is searched now (the lists probed, the candidates re-scored per result)."""
        g = self.gallery
        return key_hash(self.content, getattr(g, "nprobe", None), getattr(g, "rerank_factor", None))


def open_served(backend: str = "faiss", index=None, *, ivf=None, nprobe: int | None = None,
                rerank_factor: int = 10, uri=None, collection=None, token: str = "", verify: bool = True,
                image_root=None) -> Served:
    """The gallery `backend` names, with the flags `index search --backend` takes."""
    if backend not in BACKENDS:
        raise UserError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if rerank_factor < 1:
        raise UserError(f"--rerank-factor must be ≥ 1, got {rerank_factor}")
    if backend == "faiss":
        if not index:
            raise UserError("give --index (the index directory to serve)")
        data = read_index(index, verify=verify)
        searcher = Searcher(data, rerank_factor=rerank_factor)
        served = Served("faiss", searcher, data, searcher, str(index))
    elif backend == "ondisk":
        from index.backends.ondisk import OnDiskIVF

        if not (ivf or index):
            raise UserError("--backend ondisk needs --ivf DIR (or --index IDX, whose IDX/ivf_ondisk is used)")
        g: OnDiskIVF = OnDiskIVF(ivf or Path(index) / "ivf_ondisk", nprobe=nprobe or None,
                                 rerank_factor=rerank_factor)
        items, names = g.metadata   # read once: the gallery's own copy serves its searches too
        if items is None:
            raise UserError(f"the on-disk IVF at {g.path} was built from bare features: the app needs its items; "
                            "build it from an index directory (ivf-build --index)")
        meta = g.source_metadata
        man = dict(g.info) | {"normalize": g.normalize, "factory": g.manifest["factory"], "count": len(g)}
        data = IndexData(g.path, man, g.features, items, np.asarray(g.W, dtype=np.float32), g.index, names,
                         meta.get("root", ""))
        served = Served("ondisk", g, data, Searcher(data, rerank_factor=rerank_factor), str(g.path))
    else:
        from index.backends.milvus_store import MilvusGallery

        if not (uri and collection):
            raise UserError("--backend milvus needs --uri and --collection")
        m = MilvusGallery(uri, collection, token, nprobe=nprobe or None, rerank_factor=rerank_factor)
        man = dict(m.info) | {"factory": f"milvus {m.info.get('index_type', '')}".strip(), "count": len(m),
                              "trunk_dim": m.dim}
        # no FAISS index: the metric view's searches are never run (the gallery searches)
        data = IndexData(None, man, MilvusRows(m, len(m), m.dim), milvus_items(m),  # type: ignore[arg-type]
                         np.asarray(m.W, dtype=np.float32), None, dict(m.class_names), "")  # type: ignore[arg-type]
        served = Served("milvus", m, data, Searcher(data, rerank_factor=rerank_factor), f"{uri} · {collection}")
    if image_root is not None:
        served.view.root = str(image_root)
    return served
