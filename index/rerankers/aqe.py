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

from core.errors import UserError
from core.params import param

from .registry import RERANKERS, candidates


@dataclass
class AQEParams:
    n: int = param(2, "neighbours averaged into the query (nQE)")
    alpha: float = param(3.0, "power α of the similarity weights (0: plain average query expansion)")

    def validate(self):
        if self.n < 1:
            raise UserError(f"aqe: n must be ≥ 1, got {self.n}")
        if self.alpha < 0:
            raise UserError(f"aqe: alpha must be ≥ 0, got {self.alpha}")


def expanded(space, queries: np.ndarray, rows: np.ndarray, alpha: float) -> np.ndarray:
    """normalise(key(q) + Σ_i max(s(q, x_i), 0)^α key(x_i)) over each query's rows (−1: none)."""
    s = space.score(queries, rows)  # exact s(q, x_i), whatever index gave the candidates
    w = np.where(rows >= 0, np.maximum(s, 0.0) ** alpha, 0.0).astype(np.float32)
    X = space.gallery_vectors(np.maximum(rows, 0))
    return space.normalise(space.key(queries) + np.einsum("qn,qnd->qd", w, X))


@RERANKERS.register("aqe", AQEParams, depth="n", grid={"n": (1, 2, 3, 5, 10), "alpha": (0.0, 1.0, 3.0, 5.0)})
def aqe(space, queries, first, k, *, self_ids, params: AQEParams):
    """α-weighted query expansion (Radenović et al. TPAMI 2019): search again with normalise(q + Σ s(q, xᵢ)^α xᵢ)."""
    rows, _ = candidates(first, self_ids, params.n)
    return space.search(expanded(space, queries, rows, params.alpha), k, exclude=self_ids)
