"""Zhong, Zheng, Cao, Li, "Re-ranking Person Re-identification with k-reciprocal Encoding",
CVPR 2017, as its official code computes it (python-version/re_ranking_ranklist.py), whole:
every probe's universe U = gallery ∪ {p} as one dense distance matrix.  O(|U|²) per probe: the
reference the incremental engine (sets.py, engine.py) is tested against, for small galleries.
The equations and names are listed in docs/reranking.md ("k-reciprocal encoding")."""
from __future__ import annotations

import numpy as np

from ...space import MetricSpace


def half(k1: int) -> int:
    """The code's ½k1: int(np.around(k1 / 2)) (rounds half to even)."""
    return int(np.around(k1 / 2.0))



def final_distance(pools: np.ndarray, d_j: np.ndarray, d_orig: np.ndarray, lam: float) -> np.ndarray:
    """d* = (1 − λ) d_J + λ d (Eq. 12), inf where the pool has no row."""
    return np.where(pools >= 0, (1.0 - lam) * d_j + lam * d_orig, np.inf)


def reciprocal_set(rank: np.ndarray, i: int, k: int) -> np.ndarray:
    """R(i, k) (Eq. 3): the y among i's k + 1 nearest (i itself counted) that hold i among theirs."""
    forward = rank[i, : k + 1]
    return forward[np.flatnonzero((rank[forward, : k + 1] == i).any(1))]


def expanded_set(rank: np.ndarray, i: int, k1: int) -> np.ndarray:
    """R*(i, k1) (Eq. 6): R(i, k1) with every R(c, ½k1), c ∈ R(i, k1), that shares more than ⅔ of
    its members with R(i, k1)."""
    r = reciprocal_set(rank, i, k1)
    out = [r]
    for c in r:
        rc = reciprocal_set(rank, int(c), half(k1))
        if len(np.intersect1d(rc, r)) > 2.0 / 3.0 * len(rc):
            out.append(rc)
    return np.unique(np.concatenate(out))


def universe(space: MetricSpace, probe: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """d(x, y) = s(x, x) − s(x, y) over U = [probe, gallery `rows`], each row divided by its
    maximum (a row without a positive distance: left unscaled)."""
    U = np.vstack([space.key(probe[None]), space.gallery_vectors(rows)]).astype(np.float32)
    S = space.transform(U).astype(np.float64) @ U.astype(np.float64).T
    D = np.diag(S)[:, None] - S
    top = D.max(1, keepdims=True)
    return D / np.where(top > 0, top, 1.0)


def universe_distances(space: MetricSpace, probe: np.ndarray, own: int) -> tuple[np.ndarray, np.ndarray]:
    """`universe` over the probe and every gallery row but `own`; and those rows."""
    keep = np.flatnonzero(np.arange(space.n) != own)
    return universe(space, probe, keep), keep


def dense(space: MetricSpace, queries: np.ndarray, self_ids: np.ndarray, k1: int, k2: int,
          lam: float) -> np.ndarray:
    """d*(p, g) for each probe and every gallery row (n_q × n; inf at a probe's own row)."""
    out = np.full((len(queries), space.n), np.inf)
    for b, (q, own) in enumerate(zip(queries, self_ids, strict=True)):
        D, keep = universe_distances(space, q, int(own))
        rank = np.argsort(D, axis=1, kind="stable")
        V = np.zeros_like(D)                                     # Eq. 7 on R*(x, k1)
        for i in range(len(D)):
            r = expanded_set(rank, i, k1)
            w = np.exp(-D[i, r])
            V[i, r] = w / w.sum()
        if k2 > 1:                                               # §4.4: mean over N(x, k2)
            V = V[rank[:, :k2]].mean(1)
        t_min = np.minimum(V[0][None, :], V).sum(1)             # Eq. 10 with Σ max = 2 − Σ min
        d_j = 1.0 - t_min / (2.0 - t_min)
        out[b, keep] = final_distance(keep, d_j[1:], D[0, 1:], lam)
    return out
