"""α-weighted query expansion (αQE): Radenović, Tolias, Chum, "Fine-tuning CNN Image Retrieval
with No Human Annotation", TPAMI 2019 (§5, query expansion).

The query is replaced by the normalised, similarity-weighted sum of itself and its top n
neighbours, and searched again:

    q′ = normalise(q + Σ_{i ≤ n} max(s(q, x_i), 0)^α · x_i)

α = 0 is plain average query expansion (AQE); larger α trusts the closest neighbours more.
Vectors are the space's keys (cosine mode: M′-unit, as the paper's descriptors are unit).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..space import Hits, MetricSpace
from .expansion import ExpansionParams, weighted_sum
from .registry import RERANKERS, candidates


@dataclass
class AQEParams(ExpansionParams):
    """αQE's parameters (shared with αDBA)."""


def expanded(space: MetricSpace, queries: np.ndarray, rows: np.ndarray, alpha: float) -> np.ndarray:
    """normalise(key(q) + Σ_i max(s(q, x_i), 0)^α key(x_i)) over each query's rows (−1: none)."""
    s = space.score(queries, rows)  # exact s(q, x_i), whatever index gave the candidates
    return weighted_sum(space, space.key(queries), rows, s, alpha)


@RERANKERS.register("aqe", AQEParams, depth="n", by_row=True,
                    grid={"n": (1, 2, 3, 5, 10), "alpha": (0.0, 1.0, 3.0, 5.0)})
def aqe(space: MetricSpace, queries: np.ndarray, first: Hits | None, k: int, *, self_ids: np.ndarray,
        params: AQEParams) -> Hits:
    """α-weighted query expansion (Radenović et al. TPAMI 2019): search again with normalise(q + Σ s(q, xᵢ)^α xᵢ)."""
    assert first is not None  # registered with reads_first
    rows, _ = candidates(first, self_ids, params.n)
    h = space.search(expanded(space, queries, rows, params.alpha), k, exclude=self_ids)
    return h if h.items is not None else space.hits(h.rows, h.scores)  # a long list may come without metadata
