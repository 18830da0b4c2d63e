"""`SearcherSpace`: the `MetricSpace` over an in-memory `Searcher` (index/backends/search.py),
read through its public calls alone, with its keys, norms and artefacts in the layer's cache."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from core.arrays import l2_normalize
from core.memory import CACHE, memory_budget

from ..refinements import strategy_key
from .hits import Hits
from .pages import SCAN_CELLS, read_rows
from .protocol import as_rows, drop_rows
from .store import OfflineStore, build_in_blocks, cache_root, check_outside, fingerprint, key_hash, prune, read_blocks

GATHER_CELLS = 1 << 24  # keys gathered at once, by a score or a weighted sum (queries × rows × d float32: 64 MB)
KEYS_SHARE = 2          # every key is kept in RAM only while the keys take at most 1/2 of the memory budget
ITEM_BLOCK = 2048       # gallery items searched at once by `item_neighbours`


class SearcherSpace:
    """A `MetricSpace` over `Searcher` (index/backends/search.py) under one strategy and mode.
    Exact (Flat) indexes are searched through the same FAISS call as `Searcher.search`; an
    approximate one through `Searcher.search` itself (candidates re-ranked exactly).
    `cache_dir`: the re-ranking cache root (default `store.cache_root()`)."""

    def __init__(self, searcher, strategy: str = "trained", params: dict | None = None, mode: str = "bilinear",
                 *, cache_dir: str | Path | None = None):
        self.searcher = searcher
        self.strategy, self.params = strategy, dict(params or {})
        self._mode = mode
        # raises UserError for cosine under an indefinite M′ (resolve the mode first, as for search)
        searcher.query_view(strategy, self.params, mode)
        self._apply = searcher.metric(strategy, self.params).op.apply
        self._cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._store: OfflineStore | None = None
        self._cache_key: str | None = None

    # The query view (transform, index, M′-norms) is asked of the searcher at each use, from the
    # memory cache: a space kept for later (`gallery_space` keeps a few) holds no norm-scaled copy
    # of the gallery that the budget has let go.
    def _view(self):
        """(transform, index, M′-norms)."""
        return self.searcher.query_view(self.strategy, self.params, self._mode)

    # ------------------------------------------------------------ identity
    holds_gallery = True  # its features are in RAM or memory-mapped

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
        return self._view()[0](np.ascontiguousarray(v, dtype=np.float32))

    def _inverse_norms(self) -> np.ndarray:
        def build():  # as Searcher's cosine index: an item of zero M′-norm scores 0
            nrm = self._view()[2]
            return np.where(nrm > 0, 1.0 / np.maximum(nrm, 1e-30), 0.0).astype(np.float32)
        return self.artefact("inverse-norms", None, build, disk=False)

    def gallery_vectors(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        keys = self._held("keys", None)
        if keys is not None:
            return keys[rows]
        x = np.asarray(self.searcher.data.features[rows], dtype=np.float32)
        if self._mode == "cosine":
            x = x * self._inverse_norms()[rows][..., None]
        return np.ascontiguousarray(x, dtype=np.float32)

    def keys_fit(self) -> bool:
        """Whether every key may be kept in RAM: they take at most 1/KEYS_SHARE of the memory budget."""
        return self.n * self.dim * 4 <= memory_budget() // KEYS_SHARE

    def _key_rows(self, start: int, stop: int) -> np.ndarray:
        """Keys of rows start:stop read from the features (a memory map's pages released after)."""
        x = read_rows(self.searcher.data.features, start, stop)
        if self._mode == "cosine":
            x *= self._inverse_norms()[start:stop, None]
        return x

    @property
    def keys(self) -> np.ndarray:
        """Every item's key, in RAM (n × d float32), kept in the memory cache.  Full-gallery scores
        read it only where it is held or `keys_fit()`; otherwise they stream the features."""
        def build():
            x = np.ascontiguousarray(self.searcher.data.features, dtype=np.float32)
            if self._mode == "cosine":
                x = x * self._inverse_norms()[:, None]
            return x
        return self.artefact("keys", None, build, disk=False)

    # ------------------------------------------------------------ state
    def digest(self, name: str, params: dict | None = None, inputs: tuple[str, ...] = ()) -> str:
        return key_hash(self.cache_key, name, params or {}, list(inputs))

    def _memory_key(self, digest: str) -> tuple:
        # the folder too: a space given another cache folder keeps its own state
        return (str(self._cache_dir or ""), digest)

    def artefact(self, name: str, params: dict | None, build: Callable[[], Any], *, inputs: tuple[str, ...] = (),
                 disk: bool = True, max_bytes: int | None = None, reserve: int = 0) -> Any:
        digest = self.digest(name, params, inputs)

        def make():
            if disk:
                got = self.store.load(name, digest)
                if got is not None:
                    return got
            value = build()
            if disk:
                self.store.save(name, digest, value)
            return value
        return CACHE.get_or_build(self._memory_key(digest), make, max_bytes=max_bytes, reserve=reserve)

    def artefact_in_blocks(self, name: str, params: dict | None, columns: dict[str, tuple[int, str]],
                           fill: Callable[[int, int], dict[str, np.ndarray]], *, inputs: tuple[str, ...] = (),
                           block: int = 2048, progress: bool = False, searched: str = "") -> dict[str, np.ndarray]:
        digest = self.digest(name, params, inputs)

        def make():
            store = self.store
            final = store.blocks(name, digest)
            got = read_blocks(final, self.n, columns)
            if got is None:
                got = build_in_blocks(store.part(name, digest), final, self.n, columns, fill, block=block,
                                      progress=f"{name} ({self.n:,} items)" if progress else None)
                prune(final.parent.parent, keep=final)
            return got
        return CACHE.get_or_build(self._memory_key(digest), make)

    def _held(self, name: str, params: dict | None) -> Any:
        return CACHE.peek(self._memory_key(self.digest(name, params)))

    def held(self, name: str, params: dict | None = None) -> bool:
        return self._held(name, params) is not None

    def factor(self) -> np.ndarray | None:
        from ..metric import psd_factor

        def build():  # metric.psd_factor, the one factor of M′ (None: indefinite)
            F = psd_factor(self.searcher.metric(self.strategy, self.params).M)
            if F is None:
                return {"F": np.zeros((0, 0), np.float32), "psd": np.array(False)}
            return {"F": F, "psd": np.array(True)}
        got = self.artefact("factor", None, build, disk=False)
        return got["F"] if bool(got["psd"]) else None

    # ------------------------------------------------------------ search and scores
    def search(self, v: np.ndarray, k: int, exclude: np.ndarray | None = None) -> Hits:
        v = np.ascontiguousarray(v, dtype=np.float32)
        n_q = len(v)
        k = max(1, min(int(k), self.n))
        ex = as_rows(exclude, n_q, self.n)
        kk = min(k + int((ex >= 0).any()), self.n)
        if self.searcher.exact:
            scores, rows = self._view()[1].search(self.transform(v), kk)
        else:
            h = self.searcher.search(v, self.strategy, self.params, self._mode, kk)
            scores, rows = h.scores, h.rows
        rows, scores = rows.astype(np.int64), scores.astype(np.float32)
        if (ex >= 0).any():
            rows, scores = drop_rows(rows, scores, ex, k)
        return self.hits(rows, scores)

    def item_neighbours(self, rows: np.ndarray, L: int) -> tuple[np.ndarray, np.ndarray]:
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        L = max(1, min(int(L), self.n))
        out_r = np.empty((len(rows), L), dtype=np.int32)
        out_s = np.empty((len(rows), L), dtype=np.float32)
        for a in range(0, len(rows), ITEM_BLOCK):
            h = self.search(self.gallery_vectors(rows[a: a + ITEM_BLOCK]), L)
            out_r[a: a + ITEM_BLOCK], out_s[a: a + ITEM_BLOCK] = h.rows, h.scores
        return out_r, out_s

    def score(self, v: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        t = self.transform(v)
        if rows is None:
            return self._score_all(t)
        rows = np.asarray(rows, dtype=np.int64)
        if rows.ndim == 1:
            return t @ self.gallery_vectors(rows).T
        s = self._scores_in_place(t, rows)
        if s is not None:
            return s
        s = np.empty(rows.shape, dtype=np.float32)
        step = max(1, GATHER_CELLS // max(1, rows.shape[0] * self.dim))  # keys gathered a block of columns at a time
        for a in range(0, rows.shape[1], step):
            s[:, a: a + step] = np.einsum("qd,qmd->qm", t, self.gallery_vectors(np.maximum(rows[:, a: a + step], 0)))
        return np.where(rows >= 0, s, -np.inf).astype(np.float32)

    def _scores_in_place(self, t: np.ndarray, rows: np.ndarray) -> np.ndarray | None:
        """t[i] · key(rows[i, j]) (−inf where rows < 0) by FAISS, reading each feature where it
        lies instead of a gathered copy, in FAISS's threads (the lists pass of a 10⁶-item gallery
        re-scores 10⁸ pairs), the cosine scale applied after: the same products whether or not
        the keys are held.  None where the features are not one float32 matrix."""
        X = self.searcher.data.features
        if not (rows.ndim == 2 and t.dtype == np.float32 and type(X) in (np.ndarray, np.memmap)
                and X.dtype == np.float32 and X.ndim == 2 and X.flags.c_contiguous
                and X.shape[1] == t.shape[1] == self.dim and rows.shape[0] == len(t)):
            return None
        t = np.ascontiguousarray(t)
        ids = np.ascontiguousarray(rows, dtype=np.int64)
        if ids.size and ids.max() >= len(X):  # FAISS would read past the features
            raise IndexError(f"row {int(ids.max())} of a gallery of {len(X)}")
        s = np.empty(rows.shape, dtype=np.float32)
        if s.size:
            by_idx = faiss.fvec_inner_products_by_idx  # type: ignore[attr-defined]  # SWIG-only: not in the stubs
            by_idx(faiss.swig_ptr(s), faiss.swig_ptr(t), faiss.swig_ptr(X), faiss.swig_ptr(ids),
                   t.shape[1], len(t), ids.shape[1])
        if self._mode == "cosine":
            s *= self._inverse_norms()[np.maximum(ids, 0)]
            s[ids < 0] = -np.inf  # an item of zero norm would turn −inf · 0 into NaN
        return s

    def score_blocks(self, v: np.ndarray, width: int | None = None):
        return self._blocks(self.transform(v), width)

    def _blocks(self, t: np.ndarray, width: int | None = None):
        """(start, stop, t @ keys[start:stop]ᵀ) for consecutive blocks covering the gallery: from
        the held keys or, where they would not fit (`keys_fit`), read block by block from the
        features, holding none (the same blocks either way, so the same products, bit for bit)."""
        keys = self._held("keys", None)
        if keys is None and self.keys_fit():
            keys = self.keys
        step = max(1, width or SCAN_CELLS // max(1, self.dim))
        for a in range(0, self.n, step):
            b = min(a + step, self.n)
            yield a, b, t @ (keys[a:b] if keys is not None else self._key_rows(a, b)).T

    def _score_all(self, t: np.ndarray) -> np.ndarray:
        """t @ keysᵀ (n_q × n), a block of SCAN_CELLS keys at a time."""
        out = np.empty((len(t), self.n), dtype=np.result_type(t.dtype, np.float32))
        for a, b, s in self._blocks(t):
            out[:, a:b] = s
        return out

    def hits(self, rows: np.ndarray, scores: np.ndarray) -> Hits:
        return Hits(np.asarray(rows, dtype=np.int64), np.asarray(scores, dtype=np.float32), self.searcher.data.items,
                    class_names=self.searcher.data.class_names)
