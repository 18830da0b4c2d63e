"""The one interface of every search backend, `Gallery`, and the one result, `Hits`.

A gallery holds trunk features φ(x) and searches them under any refined M′:
  search.Searcher              the index directory's FAISS index, in RAM
  ondisk.OnDiskIVF             an IVF index whose inverted lists live on disk
  milvus_store.MilvusGallery   a Milvus collection
Each answers `search` with `Hits`, and gives the `MetricSpace` a re-ranker runs in over its
gallery's vectors (in RAM or memory-mapped; Milvus's from its source index directory or copied
from the collection), so `SearchConfig.search` and `index search` read all three through this
interface alone.  Below the interface: what the on-disk IVF and Milvus share (they keep
only the neck W, and re-rank candidates exactly under a `metric.QueryMetric`).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from core.arrays import check_matrix, check_rankable, l2_normalize
from core.errors import UserError

from ..metric import QueryMetric, matrix_report, resolve_mode
from ..operator import MetricOperator
from ..refinements import operator_kind, refine, strategy_params
from ..space import HIT_FIELDS, Hits, MetricSpace  # noqa: F401  (HIT_FIELDS: the hits' columns, named here too)


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

    def metric_space(self, strategy: str, params: dict | None, mode: str) -> MetricSpace:
        """The gallery under one strategy and mode (its mode resolved) as a re-ranker reads it:
        exact scores and every item's vector.  A backend whose vectors are out of reach refuses
        with a UserError naming it."""


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
    """One query's exact top-k among candidate `rows` (their features X): (rows, scores), padded."""
    s = X @ qt
    if norms is not None:
        s = np.where(norms > 0, s / np.maximum(norms, 1e-30), -np.inf)
    top = np.argsort(-s, kind="stable")[:k]
    out_r = np.full(k, -1, dtype=np.int64)
    out_s = np.full(k, -np.inf, dtype=np.float32)
    out_r[: len(top)], out_s[: len(top)] = rows[top], s[top]
    return out_r, out_s


def strategy_metric(W: np.ndarray, strategy: str, params: dict | None, mode: str = "bilinear") -> QueryMetric:
    """A refinement strategy's M′ from the neck W (M* = WᵀW), with its cheapest exact operator,
    as search.Searcher.metric makes it."""
    W64 = np.asarray(W, dtype=np.float64)
    M_star = W64.T @ W64
    p = strategy_params(strategy, params)
    M = refine(strategy, M_star, p)
    return QueryMetric.build(M, mode, W64.shape[1], MetricOperator.build(operator_kind(strategy), M, W64, M_star).apply)


class NeckGallery:
    """The Gallery calls of a backend that keeps the neck W beside φ(x) (on-disk IVF, Milvus):
    M′ is made from W per search, and `search` is the backend's `search_metric` under it.
    A subclass sets W, nprobe (None: its default) and rerank_factor, and has dim, normalize,
    __len__, metric_space and search_metric(queries, metric, k, nprobe=None, rerank_factor=None,
    what=…)."""
    W: np.ndarray
    rerank_factor: int = 10

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

    def prepare_queries(self, feats: np.ndarray, what: str = "query features") -> np.ndarray:
        return prepare_queries(feats, self.dim, self.normalize, what)

    def strategy_metric(self, strategy: str, params: dict | None = None, mode: str = "bilinear") -> QueryMetric:
        return strategy_metric(self.W, strategy, params, mode)

    def metric(self, M: np.ndarray, mode: str = "bilinear", apply=None) -> QueryMetric:
        """Any symmetric d × d M′ (not only a strategy's), for `search_metric`."""
        return QueryMetric.build(M, mode, self.dim, apply)

    def resolve_mode(self, strategy: str, params: dict | None, mode: str) -> tuple[str, str]:
        return resolve_mode(mode, lambda: matrix_report(self.strategy_metric(strategy, params).M)["psd"])

    def search(self, queries: np.ndarray, strategy: str = "trained", params: dict | None = None,
               mode: str = "bilinear", k: int = 10, what: str = "query features") -> Hits:
        if k < 1:
            raise UserError(f"k must be ≥ 1, got {k}")
        return self.search_metric(queries, self.strategy_metric(strategy, params, mode), min(k, len(self)),
                                  what=what)
