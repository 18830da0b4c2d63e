"""The gallery the app serves, on any backend, opened as `index search --backend` opens it.

  faiss    the index directory's FAISS index, in RAM (`--index`)
  ondisk   an on-disk IVF (`--ivf`, default INDEX/ivf_ondisk), built from an index directory
  milvus   a collection written by `index export --to milvus` (`--uri`, `--collection`)

`Served` is what the app reads besides the searches: the items' metadata (ids, labels, paths,
class names, the image root), the neck W, the model facts, and the items' trunk features per
row, read only where needed: the index directory's features.npy memory-mapped (faiss, ondisk),
or the collection's vectors fetched by row (`MilvusRows`).  A collection's items' metadata is
fetched by row too (`MilvusItems`), and its class sizes come from the collection: the app never
reads every item of a collection.  Nothing reads the whole gallery's features at start-up.
`view` is the same as an `IndexData`, and `metrics` a `Searcher` over it: M′ per strategy, and
the exact scores the why panel ranks by (faiss: the gallery itself).
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
from index.backends.store import IndexData, Items, class_sizes_in, read_index
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


BY_ROW = "the Milvus backend reads its items by row, not the whole collection at once"


class MilvusColumn:
    """One column of a collection's items (`ids`, `labels`: int64; `paths`, `splits`: str) as a
    read-only sequence: `col[i]`, `col[a:b]`, `col[int array]` fetch only those rows; a whole
    read (as an array, iterated, compared) is refused, so that no use of the whole gallery's
    metadata goes unnoticed."""

    def __init__(self, items: MilvusItems, name: str):
        self.items, self.name = items, name

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, key):
        n = len(self)
        if isinstance(key, slice):
            return self.items.column(self.name, np.arange(*key.indices(n), dtype=np.int64))
        if isinstance(key, (int, np.integer)):
            row = int(key) + (n if int(key) < 0 else 0)
            if not 0 <= row < n:
                raise IndexError("row out of range")
            return self.items.column(self.name, np.array([row]))[0]
        rows = np.asarray(key)
        if rows.dtype == bool or not np.issubdtype(rows.dtype, np.integer):
            raise UserError(BY_ROW)  # a mask names every row
        if ((rows < 0) | (rows >= n)).any():
            raise IndexError("row out of range")
        out = self.items.column(self.name, rows.reshape(-1))
        return out.reshape(rows.shape) if isinstance(out, np.ndarray) else out

    def __array__(self, dtype=None, copy=None):
        raise UserError(BY_ROW)

    def __iter__(self):
        raise UserError(BY_ROW)

    def __eq__(self, other):
        raise UserError(BY_ROW)

    def __ne__(self, other):
        raise UserError(BY_ROW)

    __hash__ = None  # type: ignore[assignment]


class MilvusItems:
    """A collection's items as `Items` read by row (`MilvusGallery.fetch_items`): `len()`, and the
    columns `ids`, `labels`, `paths`, `splits` (`MilvusColumn`).  `at(rows)`: those rows' `Items`
    in one read."""

    def __init__(self, gallery, n: int):
        self.gallery, self.n = gallery, int(n)
        self.ids, self.labels = MilvusColumn(self, "ids"), MilvusColumn(self, "labels")
        self.paths, self.splits = MilvusColumn(self, "paths"), MilvusColumn(self, "splits")

    def __len__(self) -> int:
        return self.n

    def at(self, rows) -> Items:
        return self.gallery.fetch_items(np.asarray(rows, dtype=np.int64).reshape(-1))

    def column(self, name: str, rows: np.ndarray):
        return getattr(self.at(rows), name)


def items_at(items, rows) -> Items:
    """The `Items` of the given rows, in that order: one read of a collection (`MilvusItems`),
    else a selection of the arrays in memory."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if isinstance(items, MilvusItems):
        return items.at(rows)
    return Items(items.ids[rows], items.labels[rows], [items.paths[r] for r in rows],
                 [items.splits[r] for r in rows])


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
    def by_row(self) -> bool:
        """Whether the items' metadata is read by row (a Milvus collection), never as a whole."""
        return self.backend == "milvus"

    @cached_property
    def _classes(self) -> tuple[np.ndarray, np.ndarray]:
        """(sorted labels, item counts) of an in-memory gallery's items, counted once."""
        return np.unique(np.asarray(self.view.items.labels, dtype=np.int64), return_counts=True)

    def class_sizes(self, labels) -> np.ndarray:
        """How many gallery items have each of `labels` (0 for a label none has): a collection's
        from the collection (`MilvusGallery.class_sizes`), else counted in the labels in memory."""
        labels = np.asarray(labels, dtype=np.int64)
        if self.by_row:
            g: Any = self.gallery
            return g.class_sizes(labels)
        return class_sizes_in(*self._classes, labels)

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
        data = IndexData(None, man, MilvusRows(m, len(m), m.dim), MilvusItems(m, len(m)),  # type: ignore[arg-type]
                         np.asarray(m.W, dtype=np.float32), None, dict(m.class_names), "")  # type: ignore[arg-type]
        served = Served("milvus", m, data, Searcher(data, rerank_factor=rerank_factor), f"{uri} · {collection}")
    if image_root is not None:
        served.view.root = str(image_root)
    return served
