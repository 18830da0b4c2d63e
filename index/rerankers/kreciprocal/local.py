"""k-reciprocal encoding over each query's own pool (`sets=pool`): the paper's algorithm, as
paper.py computes it, with the universe U = {p} ∪ the plain search's top `pool` candidates
instead of {p} ∪ the gallery.  R, R*, V, the local expansion over N(·, k2) and d_J are all taken
within U, and each distance is scaled by its row's maximum within U.  A query reads only its
pool's vectors (the rows it touches), so this runs on a gallery read by row (Milvus) at any size;
with a pool of the whole gallery it is the paper's computation exactly.  Its cost in MAP@R
against the whole-gallery sets: docs/fidelity.md.

Per query one dense |U| × |U| pass, vectorised: the reciprocal sets as a boolean matrix
A ∧ Aᵀ (A[i, j]: j among i's k + 1 nearest), the ⅔ test of Eq. 6 as one product of the
½k1-reciprocal and k1-reciprocal matrices."""
from __future__ import annotations

import numpy as np

from core.errors import UserError

from ...space import MetricSpace
from .paper import half, universe

# the largest pool ranked this way: |U|² doubles, (k2 + 4) of them, a query at a time
MAX_POOL = 4096


def _reciprocal(rank: np.ndarray, k: int) -> np.ndarray:
    """R(i, k) for every i of U as a boolean matrix: j among i's k + 1 nearest and i among j's."""
    A = np.zeros(rank.shape, dtype=bool)
    np.put_along_axis(A, rank[:, : k + 1], True, 1)
    return A & A.T


def probe_distance(D: np.ndarray, k1: int, k2: int, lam: float) -> np.ndarray:
    """d*(p, y) for every y of U after the probe (row 0), from U's scaled distances `D`."""
    rank = np.argsort(D, axis=1, kind="stable")
    R, H = _reciprocal(rank, k1), _reciprocal(rank, half(k1))
    Rf, Hf = R.astype(np.float32), H.astype(np.float32)
    # Eq. 6: c ∈ R(i, k1) adds R(c, ½k1) when more than ⅔ of it lies in R(i, k1); counts are exact in float32
    shared = (Hf @ Rf.T).T                                    # [i, c] = |R(c, ½k1) ∩ R(i, k1)|
    take = R & (shared > (2.0 / 3.0) * Hf.sum(1)[None, :])
    star = R | ((take.astype(np.float32) @ Hf) > 0)
    W = np.where(star, np.exp(-D), 0.0)                      # Eq. 7
    total = W.sum(1, keepdims=True)
    V = W / np.where(total > 0, total, 1.0)                  # an empty R* (indefinite M′): a zero row
    if k2 > 1:                                               # §4.4: the mean over N(x, k2)
        mean = V[rank[:, 0]]
        for j in range(1, k2):
            mean += V[rank[:, j]]
        V = mean / k2
    t_min = np.minimum(V[0][None, :], V).sum(1)              # Eq. 10 with Σ max = 2 − Σ min
    d_j = 1.0 - t_min / (2.0 - t_min)
    return (1.0 - lam) * d_j[1:] + lam * D[0, 1:]


def check_pool(pool: int) -> None:
    if pool > MAX_POOL:
        raise UserError(f"kreciprocal: sets=pool ranks each query's pool as one dense matrix: give pool ≤ "
                        f"{MAX_POOL:,} (got {pool:,})")


def rank_pools(space: MetricSpace, queries: np.ndarray, pools: np.ndarray, k1: int, k2: int,
               lam: float) -> np.ndarray:
    """d* of each query's pool (n_q × width, −1: no row; inf there)."""
    out = np.full(pools.shape, np.inf)
    for b, (q, rows) in enumerate(zip(queries, pools, strict=True)):
        ok = np.flatnonzero(rows >= 0)
        if len(ok):
            out[b, ok] = probe_distance(universe(space, q, rows[ok]), k1, k2, lam)
    return out
