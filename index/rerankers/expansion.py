"""What αQE and αDBA share (Radenović, Tolias, Chum, TPAMI 2019): a vector replaced by the
normalised sum of itself and its top n neighbours, each weighted by max(s, 0)^α."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.params import param

from ..space import GATHER_CELLS, MetricSpace


@dataclass
class ExpansionParams:
    n: int = param(2, "neighbours summed into the vector (the paper's nQE / nDBA); clipped to the gallery",
                   bounds="[1, inf)", size=True)
    alpha: float = param(3.0, "power α of the similarity weights (0: plain average)", bounds="[0, inf)")


def weighted_sum(space: MetricSpace, base: np.ndarray, rows: np.ndarray, s: np.ndarray, alpha: float) -> np.ndarray:
    """normalise(base + Σ_i max(s_i, 0)^α key(x_i)) over each row's neighbours `rows` (−1: none)
    with their similarities `s`; the neighbours' keys are read a block of columns at a time."""
    w = np.where(rows >= 0, np.maximum(s, 0.0) ** alpha, 0.0).astype(np.float32)
    step = max(1, GATHER_CELLS // max(1, rows.shape[0] * space.dim))
    total = base
    for a in range(0, rows.shape[1], step):
        total = total + np.einsum("qn,qnd->qd", w[:, a: a + step],
                                  space.gallery_vectors(np.maximum(rows[:, a: a + step], 0)))
    return space.normalise(total)
