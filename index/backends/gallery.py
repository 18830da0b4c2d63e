"""The one interface of every search backend, `Gallery`, and what the backends share.

A gallery holds trunk features φ(x) and searches them under any refined M′:
  search.Searcher              the index directory's FAISS index, in RAM
  ondisk.OnDiskIVF             an IVF index whose inverted lists live on disk
  milvus_store.MilvusGallery   a Milvus collection
Each answers `search` with `Hits` (index/space/hits.py; re-exported here with its columns
HIT_FIELDS), and gives the `MetricSpace` a re-ranker runs in over its gallery's vectors (in RAM
or memory-mapped; Milvus's from its source index directory or copied from the collection), so
`SearchConfig.search` and `index search` read all three through this interface alone.

Shared below the interface: each strategy's M′ with its operator, built once per (neck W,
strategy, parameters) in the process's memory cache (`refined_metric`, read by every backend);
the exact re-scoring of candidates (`rescore`, `exact_top`); and `NeckGallery`, the Gallery calls
of the backends that keep only the neck W beside φ(x) (on-disk IVF, Milvus).
"""
from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from core.arrays import check_matrix, check_rankable, l2_normalize
from core.errors import UserError

from ..metric import QueryMetric, matrix_report, resolve_mode, symmetrized
from ..operator import MetricOperator
from ..refinements import file_params, operator_kind, refine, strategy_key, strategy_params
from ..space import CACHE, GATHER_CELLS, HIT_FIELDS, Hits, MetricSpace, key_hash  # noqa: F401  (HIT_FIELDS: the hits' columns, named here too)


@runtime_checkable
class Gallery(Protocol):
    """A searchable gallery of trunk features φ(x); every strategy's M′ is searched exactly
    (approximate backends re-rank their candidates exactly)."""

    @property
    def dim(self) -> int:
        """d: the trunk features' (and so the queries') dimension."""

    @property
    def info(self) -> dict:
        """The facts of the model its features came from (checkpoint, backbone, transform, …),
        with which query images are embedded; {} when it has none."""

    def __len__(self) -> int:
        """The number of items."""

    def resolve_mode(self, strategy: str, params: dict | None, mode: str) -> tuple[str, str]:
        """(mode to search with, note): cosine falls back to bilinear, with a note, for an
        indefinite M′ (metric.resolve_mode)."""

    def search(self, queries: np.ndarray, strategy: str = "trained", params: dict | None = None,
               mode: str = "bilinear", k: int = 10, what: str = "query features") -> Hits:
        """The top min(k, len) items per query (n × d trunk features, or one d-vector) under the
        strategy's M′, best first.  Cosine under an indefinite M′ is refused: resolve the mode
        first.  `what` names the queries in error messages."""

    def prepare_queries(self, feats: np.ndarray, what: str = "query features") -> np.ndarray:
        """Queries as `search` takes them: float32 rows, L2-normalised where the stored features
        are; refused when not numeric, of another dimension, not finite or all zeros."""

    def metric_space(self, strategy: str, params: dict | None, mode: str, by_row: bool = False) -> MetricSpace:
        """The gallery under one strategy and mode (its mode resolved) as a re-ranker reads it:
        exact scores and every item's vector.  `by_row`: for a re-ranker that reads only the rows
        a query touches, a backend that keeps its gallery in an engine (Milvus) gives a space read
        by row, holding no N-sized array (the others give their one space).  A backend whose
        vectors are out of reach refuses with a UserError naming it."""


# ---------------------------------------------------------------- shared by the backends
def prepare_queries(feats: np.ndarray, dim: int, normalize: bool, what: str = "query features") -> np.ndarray:
    """Queries as float32 rows, as the stored features were (L2-normalised if they were);
    refused when not numeric, not 1-D or 2-D, empty, of another dimension, not finite, all
    zeros or too large to rank by."""
    feats = check_matrix(feats, what, allow_1d=True)
    if feats.shape[1] != dim:
        raise UserError(f"{what} have dimension {feats.shape[1]}; this index holds {dim}-d features")
    check_rankable(feats, what)
    return l2_normalize(feats) if normalize else feats


def exact_top(qt: np.ndarray, rows: np.ndarray, X: np.ndarray, norms: np.ndarray | None, k: int):
    """One query's exact top-k among candidate `rows` (their features X): (rows, scores), padded
    with −1 and −inf.  Cosine (`norms`: the rows' ‖x‖_M′): an item of zero norm scores −inf.  Equal
    scores keep the candidates' order."""
    s = X @ qt
    if norms is not None:
        s = np.where(norms > 0, s / np.maximum(norms, 1e-30), -np.inf)
    top = np.argsort(-s, kind="stable")[:k]
    out_r = np.full(k, -1, dtype=np.int64)
    out_s = np.full(k, -np.inf, dtype=np.float32)
    out_r[: len(top)], out_s[: len(top)] = rows[top], s[top]
    return out_r, out_s


def rescore(qt: np.ndarray, cand: np.ndarray, read: Callable[[np.ndarray], np.ndarray], k: int,
            norms: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Each query's exact top-k among its candidates: (rows, scores), n × k, padded with −1 and
    −inf.  `qt`: the transformed queries (n × d); `cand`: their candidate rows (n × kc, −1 where
    none); `read(rows)`: the features of sorted unique rows (one read per block of queries, front
    to back, at most GATHER_CELLS floats); `norms(rows, X)`: their ‖x‖_M′ (cosine), None in
    bilinear mode.  Each query's candidates are scored in row order, so equal scores rank by row."""
    n, kc = cand.shape
    R = np.full((n, k), -1, dtype=np.int64)
    S = np.full((n, k), -np.inf, dtype=np.float32)
    block = max(1, GATHER_CELLS // max(1, kc * qt.shape[1]))
    for b in range(0, n, block):
        c = cand[b: b + block]
        uniq = np.unique(c[c >= 0])
        X = np.asarray(read(uniq), dtype=np.float32)
        nx = None if norms is None else norms(uniq, X)
        for i, ci in enumerate(c):
            pos = np.searchsorted(uniq, np.sort(ci[ci >= 0]))
            R[b + i], S[b + i] = exact_top(qt[b + i], uniq[pos], X[pos], None if nx is None else nx[pos], k)
    return R, S


# ---------------------------------------------------------------- M′ of a strategy, built once
@dataclass(eq=False)  # identity semantics: fields hold numpy arrays
class RefinedMetric:
    """A strategy's M′ (exactly symmetric, float64) and its cheapest exact operator; `key`: the
    digest of what made it (the neck's values, the strategy, its parameters and files)."""
    name: str
    params: object
    M: np.ndarray
    op: MetricOperator
    key: str = ""
    _report: dict | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def report(self) -> dict:
        """`matrix_report(M′)`, computed once (no eigvalsh where the operator has M′'s eigenvalues)."""
        with self._lock:  # the first callers wait for one computation (an eigvalsh where needed)
            if self._report is None:
                self._report = matrix_report(self.M, self.op.eigenvalues)
            return self._report


def neck_digest(W: np.ndarray) -> str:
    """The identity of a neck W's values, and so of M* = WᵀW: a hash of W (as float64) and its shape."""
    W64 = np.ascontiguousarray(W, dtype=np.float64)
    h = hashlib.sha256(repr(W64.shape).encode())
    h.update(W64.data.cast("B"))
    return h.hexdigest()


def _files_read(strategy: str, p) -> list:
    """(path, size, mtime) of each file a strategy's parameters name (custom's matrix): a replaced
    file makes another M′."""
    out = []
    for name in file_params(strategy):
        path = str(getattr(p, name) or "")
        try:
            st = os.stat(path)
            out.append([path, st.st_size, st.st_mtime_ns])
        except OSError:
            out.append([path, None, None])  # refine refuses it, naming the file
    return out


def refined_metric(W: np.ndarray, strategy: str, params=None, neck: str | None = None) -> RefinedMetric:
    """M′ = strategy(M*), M* = WᵀW, with its operator: built once per (W's values, strategy,
    parameters) in the process's memory cache however many threads ask, and shared by every
    backend with that neck.  `params`: a dict or the strategy's parameter object; `neck`:
    `neck_digest(W)`, where the caller holds it.  An entry the cache evicted is built again (the
    same M′)."""
    p = strategy_params(strategy, params) if params is None or isinstance(params, dict) else params
    name, items = strategy_key(strategy, p)
    digest = key_hash(neck or neck_digest(W), name, [list(kv) for kv in items], _files_read(strategy, p))

    def build():
        W64 = np.asarray(W, dtype=np.float64)
        M_star = symmetrized(W64.T @ W64)  # exactly: refine need not average each M′ with M′ᵀ
        M = refine(strategy, M_star, p, symmetric=True)
        rm = RefinedMetric(strategy, p, M, MetricOperator.build(operator_kind(strategy), M, W, M_star), digest)
        return rm, [M, *rm.op.arrays()]  # the arrays: what the entry weighs in the budget
    return CACHE.get_or_build(("refined-metric", digest), build)[0]


def strategy_metric(W: np.ndarray, strategy: str, params: dict | None, mode: str = "bilinear",
                    neck: str | None = None) -> QueryMetric:
    """A refinement strategy's M′ from the neck W (M* = WᵀW), with its cheapest exact operator,
    prepared for querying in `mode` (cosine: refused for an indefinite M′): `refined_metric`'s,
    the one `search.Searcher.metric` gives."""
    rm = refined_metric(W, strategy, params, neck)
    return QueryMetric.of(rm.M, mode, rm.op.apply, lambda: rm.report)


class NeckGallery:
    """The Gallery calls of a backend that keeps the neck W beside φ(x) (on-disk IVF, Milvus):
    each search reads the strategy's M′ from `refined_metric` (built once), and `search` is the
    backend's `search_metric` under it.  A subclass sets W, neck (`neck_digest(W)`), nprobe (None:
    its default), rerank_factor and a `_space_lock`, and has dim, normalize, __len__, `_in_memory`
    and search_metric(queries, metric, k, nprobe=None, rerank_factor=None, what=…)."""
    W: np.ndarray
    neck: str
    rerank_factor: int = 10
    _space_lock: threading.Lock  # set by the subclass, with `_searcher = None`
    _searcher = None

    # what the subclass provides
    @property
    def dim(self) -> int:
        raise NotImplementedError

    @property
    def normalize(self) -> bool:
        """Whether the stored features are L2-normalised (queries then are too)."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def search_metric(self, feats: np.ndarray, metric: QueryMetric, k: int = 10, nprobe: int | None = None,
                      rerank_factor: int | None = None, what: str = "query features") -> Hits:
        raise NotImplementedError

    def _in_memory(self):
        """This gallery as an `index.backends.search.Searcher` over its vectors, for re-rankers."""
        raise NotImplementedError

    def metric_space(self, strategy: str, params: dict | None, mode: str, by_row: bool = False) -> MetricSpace:
        """The space re-rankers run in, over `_in_memory()`: made once, whoever asks first, and kept
        on this object (a view over its handles; a change of candidate settings drops it).
        `by_row`: the same space (a backend with an engine of its own overrides this)."""
        with self._space_lock:
            if self._searcher is None:
                self._searcher = self._in_memory()
            searcher = self._searcher
        return searcher.metric_space(strategy, params, mode)

    def prepare_queries(self, feats: np.ndarray, what: str = "query features") -> np.ndarray:
        return prepare_queries(feats, self.dim, self.normalize, what)

    def strategy_metric(self, strategy: str, params: dict | None = None, mode: str = "bilinear") -> QueryMetric:
        return strategy_metric(self.W, strategy, params, mode, self.neck)

    def metric(self, M: np.ndarray, mode: str = "bilinear", apply=None) -> QueryMetric:
        """Any symmetric d × d M′ (not only a strategy's), for `search_metric`."""
        return QueryMetric.build(M, mode, self.dim, apply)

    def resolve_mode(self, strategy: str, params: dict | None, mode: str) -> tuple[str, str]:
        return resolve_mode(mode, lambda: refined_metric(self.W, strategy, params, self.neck).report["psd"])

    def search(self, queries: np.ndarray, strategy: str = "trained", params: dict | None = None,
               mode: str = "bilinear", k: int = 10, what: str = "query features") -> Hits:
        if k < 1:
            raise UserError(f"k must be ≥ 1, got {k}")
        return self.search_metric(queries, self.strategy_metric(strategy, params, mode), min(k, len(self)),
                                  what=what)
