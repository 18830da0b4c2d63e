"""The one thing a re-ranker sees: a `MetricSpace`, a gallery searched under one strategy's M′
in one mode, and `SearcherSpace`, that space over the in-memory `Searcher`.

Every score is s(v, x) = t(v) · key(x):
  bilinear  t(v) = M′v               key(x) = φ(x)               s = vᵀM′φ(x)
  cosine    t(v) = M′v / ‖v‖_M′      key(x) = φ(x) / ‖φ(x)‖_M′   s = cosine under M′
so a re-ranker that averages vectors (query expansion, database-side augmentation) averages
keys, the vectors the similarity is an inner product of; in cosine mode these are M′-unit, as
the papers' L2-normalised descriptors are unit under M′ = I.  A key is also a valid query:
s(key(x), ·) = s(x, ·) (t is scale-invariant in cosine mode).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from core.arrays import l2_normalize
from core.errors import UserError

from ..backends.gallery import Hits
from ..refinements import strategy_key
from .cache import OfflineStore, cache_root, check_outside, fingerprint, key_hash

GATHER_CELLS = 1 << 24  # keys gathered at once by a per-query score (queries × rows × d float32: 64 MB)


@runtime_checkable
class MetricSpace(Protocol):
    """A gallery under one (strategy, params, mode).  Rows (positions 0…n−1) name its items;
    −1 is "no item" wherever rows are passed or returned."""

    @property
    def n(self) -> int:
        """The number of gallery items."""

    @property
    def dim(self) -> int:
        """d: the dimension of queries and keys."""

    @property
    def mode(self) -> str:
        """"bilinear" or "cosine"."""

    @property
    def cache_key(self) -> str:
        """A hash of (index content fingerprint, strategy key with its parameters, mode): the
        offline caches of this space are stored under it."""

    @property
    def store(self) -> OfflineStore:
        """This space's offline cache (outside the index folder)."""

    def prepare(self, queries: np.ndarray) -> np.ndarray:
        """Query features as the plain search takes them (validated, float32, L2-normalised
        where the index is)."""

    def key(self, v: np.ndarray) -> np.ndarray:
        """Rows v ↦ key(v) (bilinear: v; cosine: v/‖v‖_M′)."""

    def normalise(self, v: np.ndarray) -> np.ndarray:
        """The normalisation the mode gives a vector: cosine v/‖v‖_M′; bilinear as the index
        treats its features (L2 where it normalises them, else none)."""

    def transform(self, v: np.ndarray) -> np.ndarray:
        """Rows v ↦ t(v), so that s(v, x) = t(v) · key(x)."""

    def gallery_vectors(self, rows: np.ndarray) -> np.ndarray:
        """key(φ(x)) of the given rows, float32: usable as queries and summable as keys."""

    def search(self, v: np.ndarray, k: int, exclude: np.ndarray | None = None) -> Hits:
        """The top min(k, n) rows per query v under s, best first; `exclude[i]` (a row, −1 none)
        is left out of query i's list."""

    def score(self, v: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """Exact s(v, x): rows None → every item (n_q × n); 1-D → those for every query;
        2-D (n_q × m) → per query (−inf where a row is −1)."""

    def hits(self, rows: np.ndarray, scores: np.ndarray) -> Hits:
        """A `Hits` with the gallery's item metadata."""


def as_rows(self_ids, n_queries: int, n: int) -> np.ndarray:
    """self_ids as an int64 array of one gallery row per query (−1: the query is not an item)."""
    if self_ids is None:
        return np.full(n_queries, -1, dtype=np.int64)
    a = np.atleast_1d(np.asarray(self_ids, dtype=np.int64))
    if a.shape != (n_queries,):
        raise UserError(f"self_ids must give one row per query ({n_queries}), got shape {a.shape}")
    if ((a < -1) | (a >= n)).any():
        raise UserError(f"self_ids must be gallery rows in [0, {n}) or −1")
    return a


def drop_rows(rows: np.ndarray, scores: np.ndarray, exclude: np.ndarray, k: int):
    """Each query's list without its excluded row, order kept, cut to k (padded −1 / −inf)."""
    mask = (rows == exclude[:, None]) | (rows < 0)
    rows = np.where(mask, -1, rows)
    scores = np.where(mask, -np.inf, scores).astype(np.float32)
    order = np.argsort(mask, axis=1, kind="stable")[:, :k]  # kept entries first, in their order
    out_r, out_s = np.take_along_axis(rows, order, 1), np.take_along_axis(scores, order, 1)
    if out_r.shape[1] < k:
        pad = k - out_r.shape[1]
        out_r = np.pad(out_r, ((0, 0), (0, pad)), constant_values=-1)
        out_s = np.pad(out_s, ((0, 0), (0, pad)), constant_values=-np.inf)
    return out_r, out_s


class SearcherSpace:
    """A `MetricSpace` over `Searcher` (index/backends/search.py) under one strategy and mode.
    Exact (Flat) indexes are searched through the same FAISS call as `Searcher.search`; an
    approximate one through `Searcher.search` itself (candidates re-ranked exactly).
    `cache_dir`: the re-ranking cache root (default `cache.cache_root()`)."""

    def __init__(self, searcher, strategy: str = "trained", params: dict | None = None, mode: str = "bilinear",
                 *, cache_dir: str | Path | None = None):
        self.searcher = searcher
        self.strategy, self.params = strategy, dict(params or {})
        self._mode = mode
        # raises UserError for cosine under an indefinite M′ (resolve the mode first, as for search)
        self._t, self._index, self._norms = searcher.query_view(strategy, self.params, mode)
        self._apply = searcher.metric(strategy, self.params).op.apply
        self._cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._keys: np.ndarray | None = None
        self._inv: np.ndarray | None = None
        self._store: OfflineStore | None = None
        self._cache_key: str | None = None

    # ------------------------------------------------------------ identity
    @property
    def n(self) -> int:
        return len(self.searcher)

    @property
    def dim(self) -> int:
        return self.searcher.dim

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def cache_key(self) -> str:
        if self._cache_key is None:
            self._cache_key = key_hash(fingerprint(self.searcher.data), self._strategy_key(), self._mode)
        return self._cache_key

    def _strategy_key(self) -> list:
        name, items = strategy_key(self.strategy, self.params)
        return [name, [[k, v] for k, v in items]]

    @property
    def store(self) -> OfflineStore:
        if self._store is None:
            root = self._cache_dir or cache_root()
            check_outside(root, self.searcher.data.path)
            describe = {"index": str(self.searcher.data.path), "strategy": self._strategy_key(),
                        "mode": self._mode, "n": self.n, "fingerprint": fingerprint(self.searcher.data)}
            self._store = OfflineStore(root, self.cache_key, json.loads(json.dumps(describe, default=repr)))
        return self._store

    # ------------------------------------------------------------ vectors
    def prepare(self, queries: np.ndarray) -> np.ndarray:
        return self.searcher.prepare_queries(queries)

    def _m_norms(self, v: np.ndarray) -> np.ndarray:
        v = np.asarray(v, dtype=np.float32)
        return np.sqrt(np.maximum(np.einsum("ij,ij->i", self._apply(v).astype(np.float64), v.astype(np.float64)), 0))

    def key(self, v: np.ndarray) -> np.ndarray:
        v = np.asarray(v, dtype=np.float32)
        if self._mode == "bilinear":
            return v
        return (v / np.maximum(self._m_norms(v), 1e-30)[:, None]).astype(np.float32)

    def normalise(self, v: np.ndarray) -> np.ndarray:
        if self._mode == "cosine":
            return self.key(v)
        v = np.asarray(v, dtype=np.float32)
        return l2_normalize(v) if self.searcher.normalize else v

    def transform(self, v: np.ndarray) -> np.ndarray:
        return self._t(np.ascontiguousarray(v, dtype=np.float32))

    def _inverse_norms(self) -> np.ndarray:
        if self._inv is None:  # as Searcher's cosine index: an item of zero M′-norm scores 0
            nrm = self._norms
            self._inv = np.where(nrm > 0, 1.0 / np.maximum(nrm, 1e-30), 0.0).astype(np.float32)
        return self._inv

    def gallery_vectors(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        if self._keys is not None:
            return self._keys[rows]
        x = np.asarray(self.searcher.data.features[rows], dtype=np.float32)
        if self._mode == "cosine":
            x = x * self._inverse_norms()[rows][..., None]
        return np.ascontiguousarray(x, dtype=np.float32)

    @property
    def keys(self) -> np.ndarray:
        """Every item's key, in RAM (n × d float32): what full scans and offline passes read."""
        if self._keys is None:
            x = np.ascontiguousarray(self.searcher.data.features, dtype=np.float32)
            if self._mode == "cosine":
                x = x * self._inverse_norms()[:, None]
            self._keys = x
        return self._keys

    # ------------------------------------------------------------ search and scores
    def search(self, v: np.ndarray, k: int, exclude: np.ndarray | None = None) -> Hits:
        v = np.ascontiguousarray(v, dtype=np.float32)
        n_q = len(v)
        k = max(1, min(int(k), self.n))
        ex = as_rows(exclude, n_q, self.n)
        kk = min(k + int((ex >= 0).any()), self.n)
        if self.searcher.exact:
            scores, rows = self._index.search(self.transform(v), kk)
        else:
            h = self.searcher.search(v, self.strategy, self.params, self._mode, kk)
            scores, rows = h.scores, h.rows
        rows, scores = rows.astype(np.int64), scores.astype(np.float32)
        if (ex >= 0).any():
            rows, scores = drop_rows(rows, scores, ex, k)
        return self.hits(rows, scores)

    def score(self, v: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        t = self.transform(v)
        if rows is None:
            return t @ self.keys.T
        rows = np.asarray(rows, dtype=np.int64)
        if rows.ndim == 1:
            return t @ self.gallery_vectors(rows).T
        s = np.empty(rows.shape, dtype=np.float32)
        step = max(1, GATHER_CELLS // max(1, rows.shape[0] * self.dim))  # keys gathered a block of columns at a time
        for a in range(0, rows.shape[1], step):
            s[:, a: a + step] = np.einsum("qd,qmd->qm", t, self.gallery_vectors(np.maximum(rows[:, a: a + step], 0)))
        return np.where(rows >= 0, s, -np.inf).astype(np.float32)

    def hits(self, rows: np.ndarray, scores: np.ndarray) -> Hits:
        return Hits(np.asarray(rows, dtype=np.int64), np.asarray(scores, dtype=np.float32), self.searcher.data.items,
                    class_names=self.searcher.data.class_names)
