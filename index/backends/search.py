"""Exact search under any refined M′ over one stored inner-product index.

Bilinear mode searches the stored index with M′φ(q): the database is stored
once and switching strategy costs one (structured) d × d product per query.
Cosine mode (PSD M′ only) divides by ‖φ(x)‖_M′; those norms, and the
norm-scaled copy of the database the exact cosine search uses, are kept per
searcher and strategy in the metric-space layer's memory cache (its budget, built
once, dropped with the searcher).  Each strategy's M′ and its operator are
`gallery.refined_metric`'s, built once per neck and strategy in the same cache.
Approximate indexes fetch candidates and re-rank them exactly (`gallery.rescore`).
FAISS reads are thread-safe.  A `gallery.Gallery`, whose re-rankers run in a
`space.SearcherSpace` over it.
"""
from __future__ import annotations

import weakref

import faiss
import numpy as np

from core.errors import UserError

from ..metric import MODES, resolve_mode
from ..refinements import strategy_label
from ..space import CACHE, Hits, MetricSpace, SearcherSpace, read_rows
from .gallery import RefinedMetric, neck_digest, prepare_queries, refined_metric, rescore
from .store import IndexData


class _Owner:
    """A searcher's identity in the layer's cache (a key part that does not keep the searcher alive)."""


class Searcher:
    def __init__(self, data: IndexData, rerank_factor: int = 10):
        self.data = data
        self.normalize = bool(data.manifest["normalize"])
        self.exact = data.manifest["factory"] == "Flat"
        self.rerank_factor = rerank_factor
        # this searcher's cosine state in the layer's cache, dropped with it
        self._owner = _Owner()
        weakref.finalize(self, CACHE.drop_owner, self._owner)
        # the identity of the neck's values: the key of every M′ this searcher reads (refined_metric)
        self._neck = neck_digest(data.W)
        if not self.exact and hasattr(data.faiss_index, "hnsw"):
            data.faiss_index.hnsw.efSearch = max(data.faiss_index.hnsw.efSearch, 128)

    @property
    def dim(self) -> int:
        return self.data.dim

    @property
    def info(self) -> dict:
        """The index manifest (its model facts embed query images)."""
        return self.data.manifest

    def __len__(self) -> int:
        return len(self.data.items)

    # ------------------------------------------------------------ metrics
    def metric(self, strategy: str = "trained", params: dict | None = None) -> RefinedMetric:
        """The strategy's M′ and operator, built once per neck, strategy and parameters."""
        return refined_metric(self.data.W, strategy, params, self._neck)

    def _cosine_parts(self, rm: RefinedMetric):
        if not rm.report["psd"]:
            raise UserError(f"cosine mode needs a positive semi-definite M′; strategy "
                            f"{strategy_label(rm.name, rm.params)} gives an indefinite matrix (min eigenvalue "
                            f"{rm.report['min_eigenvalue']:.3g}). Use --mode bilinear.")

        def build():
            # 65536 rows at a time, a memory map's pages released after each (the norms of rows
            # are computed 8192 at a time either way)
            feats = self.data.features
            norms = np.concatenate([rm.op.m_norms(read_rows(feats, s, s + 65536))
                                    for s in range(0, len(feats), 65536)] or [np.zeros(0)])
            idx = None
            if self.exact:
                inv = np.where(norms > 0, 1.0 / np.maximum(norms, 1e-30), 0.0).astype(np.float32)
                idx = faiss.IndexFlatIP(self.data.dim)
                for s in range(0, len(inv), 65536):
                    idx.add(np.ascontiguousarray(self.data.features[s: s + 65536] * inv[s: s + 65536, None]))
            return {"norms": norms, "index": idx}
        parts = CACHE.get_or_build(self._cosine_key(rm), build)
        return parts["norms"], parts["index"]

    def _cosine_key(self, rm: RefinedMetric) -> tuple:
        return (self._owner, "cosine", rm.key)

    def holds_cosine_parts(self, strategy: str, params: dict | None = None) -> bool:
        """Whether the strategy's cosine norms (and exact cosine index) are built and kept now."""
        return CACHE.peek(self._cosine_key(self.metric(strategy, params))) is not None

    # ------------------------------------------------------------ search
    def prepare_queries(self, feats: np.ndarray, what: str = "query features") -> np.ndarray:
        """Queries as float32 rows; refused when not numeric, not 1-D or 2-D, empty, of another
        dimension, not finite, all zeros or too large to rank by."""
        return prepare_queries(feats, self.data.dim, self.normalize, what)

    def metric_space(self, strategy: str, params: dict | None, mode: str, by_row: bool = False) -> MetricSpace:
        """The `SearcherSpace` re-rankers run in (the features are in RAM or memory-mapped; by row
        or not, the same space)."""
        return SearcherSpace(self, strategy, params, mode)

    def query_view(self, strategy: str = "trained", params: dict | None = None, mode: str = "bilinear"):
        """(transform, index): searching `index` with `transform(φ(q))` by inner product ranks
        exactly by the strategy's similarity (Flat indexes).  Evaluation uses this too."""
        if mode not in MODES:
            raise UserError(f"mode must be one of {MODES}, got {mode!r}")
        rm = self.metric(strategy, params)
        if mode == "bilinear":
            return (lambda q: rm.op.apply(q)), self.data.faiss_index, None
        norms, cos_index = self._cosine_parts(rm)

        def transform(q):
            qt = rm.op.apply(q)
            qn = np.sqrt(np.maximum(np.einsum("ij,ij->i", qt.astype(np.float64), q.astype(np.float64)), 0))
            return (qt / np.maximum(qn, 1e-30)[:, None]).astype(np.float32)

        return transform, cos_index, norms

    def search(self, queries: np.ndarray, strategy: str = "trained", params: dict | None = None,
               mode: str = "bilinear", k: int = 10, what: str = "query features") -> Hits:
        """The top min(k, index size) items per query (k is capped before anything is allocated)."""
        if k < 1:
            raise UserError(f"k must be ≥ 1, got {k}")
        q = self.prepare_queries(queries, what)
        transform, index, norms = self.query_view(strategy, params, mode)
        qt = transform(q)
        k = min(k, self.data.faiss_index.ntotal)
        if self.exact:
            D, rows = index.search(qt, k)
        else:
            D, rows = self._rerank(qt, k, norms)
        return Hits(rows.astype(np.int64), D.astype(np.float32), self.data.items, class_names=self.data.class_names)

    def _rerank(self, qt: np.ndarray, k: int, norms: np.ndarray | None):
        """Approximate candidates from the ANN index, then exact scores under M′."""
        # cosine candidates come from the raw inner product, blind to 1/‖x‖_M′: fetch more
        factor = self.rerank_factor * (4 if norms is not None else 1)
        kc = min(self.data.faiss_index.ntotal, max(k * factor, 64))
        _, cand = self.data.faiss_index.search(qt, kc)
        # sorted rows: sequential reads from the memmap
        rows, D = rescore(qt, cand, lambda r: self.data.features[r], k,
                          None if norms is None else lambda r, _: norms[r])
        return D, rows

    def resolve_mode(self, strategy: str, params: dict | None, mode: str) -> tuple[str, str]:
        """(mode actually used, note): cosine is undefined for an indefinite M′, which is then
        ranked bilinearly, and said so (the CLI, the API and the app do the same)."""
        return resolve_mode(mode, lambda: self.metric(strategy, params).report["psd"])
