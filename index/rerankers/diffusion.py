"""Diffusion on the gallery's kNN graph: Iscen, Tolias, Avrithis, Furon, Chum, "Efficient
Diffusion on Region Manifolds: Recovering Small Objects with Compact CNN Representations",
CVPR 2017, with the offline/online split of its official code (github ahmetius/
diffusion-retrieval: knngraph.m, transition_matrix.m, ymake.m, trunclap.m, dfs.m; global
descriptors, as run_test.m's `feature_type = 'global'`).

Offline (cached): each item's k nearest items (itself among them, as knn_wrap returns it).
Online, per query, on the graph truncated to its top `truncation` first-search candidates
(findtrunc.m + trunclap.m):
  §3.1     A_ij = max(s(x_i, x_j), 0)^γ if x_i, x_j are in each other's k-NN (mutual), else 0;
           A_ii = 0  (knngraph.m)
  Eq. 4    S = D^{-1/2} A D^{-1/2},  D = diag(A 1)  (transition_matrix.m, on the truncated A)
  §3.2     y_i = max(s(q, x_i), 0)^γ for the query's top kq items, 0 elsewhere  (ymake.m)
  Eq. 9    f = (I − αS)^{-1} y, solved by conjugate gradients (dfs.m: pcg, tol, iterations)
and the candidates are ranked by f.  Items outside the truncation keep f = 0, as in the code.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import sparse

from core.params import param

from .neighbours import neighbour_lists, without
from .registry import RERANKERS, candidates


@dataclass
class DiffusionParams:
    k: int = param(50, "neighbours per item in the kNN graph, the item itself counted (run_test.m: 50)",
                   bounds="[2, inf)", size=True)  # the item itself and a neighbour
    kq: int = param(10, "the query's top items seeding the diffusion (run_test.m: 10)", bounds="[1, inf)",
                    size=True)
    alpha: float = param(0.99, "α of (I − αS) f = y", bounds="(0, 1)")
    gamma: float = param(3.0, "power γ of the similarities in the graph and the seed", bounds="(0, inf)")
    truncation: int = param(1000, "the query's first-search candidates the graph is cut to", bounds="[1, inf)",
                            size=True)
    iterations: int = param(20, "conjugate-gradient iterations at most (run_test.m: 20)", bounds="[1, 1000]")
    tol: float = param(1e-6, "conjugate-gradient tolerance on the relative residual (run_test.m: 1e-6)",
                       bounds="(0, inf)")


def conjugate_gradient(A, b: np.ndarray, tol: float, iterations: int) -> np.ndarray:
    """x with A x ≈ b (A symmetric positive definite), from x = 0, stopping once ‖b − Ax‖ ≤ tol ‖b‖
    (MATLAB pcg's criterion, without a preconditioner)."""
    x = np.zeros_like(b)
    r = b.copy()
    bn = float(np.linalg.norm(b))
    if bn == 0.0:
        return x
    p = r.copy()
    rs = float(r @ r)
    for _ in range(iterations):
        Ap = A @ p
        a = rs / float(p @ Ap)
        x += a * p
        r -= a * Ap
        rs_new = float(r @ r)
        if np.sqrt(rs_new) <= tol * bn:
            break
        p = r + (rs_new / rs) * p
        rs = rs_new
    return x


def affinity(sub: np.ndarray, rows: np.ndarray, sims: np.ndarray, gamma: float, place: np.ndarray) -> sparse.csr_matrix:
    """The mutual-kNN affinity A restricted to `sub` (knngraph.m, then A(sub, sub)): `rows`,
    `sims` are the k-NN lists of the items in `sub`, in its order.  `place`: a gallery-sized
    array of −1, left as it was found."""
    T, k = rows.shape
    place[sub] = np.arange(T)
    local = place[rows]  # each neighbour's place in sub, −1 outside
    place[sub] = -1
    r = np.repeat(np.arange(T), k)
    c = local.ravel()
    keep = np.flatnonzero((c >= 0) & (c != r))
    r, c = r[keep], c[keep]
    edge = np.zeros((T, T), dtype=bool)
    edge[r, c] = True
    mutual = edge[c, r]  # i is in the k-NN of its neighbour j as well
    w = np.maximum(sims.ravel()[keep[mutual]].astype(np.float64), 0.0) ** gamma
    return sparse.csr_matrix((w, (r[mutual], c[mutual])), shape=(T, T))


def normalised(A: sparse.csr_matrix) -> sparse.csr_matrix:
    """S = D^{-1/2} A D^{-1/2}; an isolated node's row and column stay 0 (transition_matrix.m)."""
    deg = np.asarray(A.sum(1)).ravel()
    inv = np.where(deg > 0, 1.0 / np.sqrt(np.maximum(deg, 1e-300)), 0.0)
    A = A.tocoo()
    return sparse.csr_matrix((A.data * inv[A.row] * inv[A.col], (A.row, A.col)), shape=A.shape)


@RERANKERS.register("diffusion", DiffusionParams, offline=True, depth="truncation", pool="truncation",
                    grid={"k": (10, 30, 50), "alpha": (0.9, 0.99), "gamma": (1.0, 3.0)})
def diffusion(space, queries, first, k, *, self_ids, params: DiffusionParams):
    """Diffusion on the mutual kNN graph (Iscen et al. CVPR 2017): rank the query's candidates by f = (I − αS)⁻¹y."""
    p = params
    lists, sims = neighbour_lists(space, p.k + 1)  # + 1: a leave-one-out row may drop out
    rows, _ = candidates(first, self_ids, max(p.truncation, k))
    out_r = np.full((len(queries), k), -1, dtype=np.int64)
    out_s = np.full((len(queries), k), -np.inf, dtype=np.float32)
    place = np.full(space.n, -1, dtype=np.int64)
    for b in range(len(queries)):
        sub = rows[b][rows[b] >= 0]
        if not len(sub):
            continue
        own = np.full(len(sub), self_ids[b])
        nr, ns = without(lists[sub], sims[sub], own, min(p.k, space.n))
        S = normalised(affinity(sub, nr, ns, p.gamma, place))
        seed = min(p.kq, len(sub))
        y = np.zeros(len(sub))
        s = space.score(queries[b: b + 1], sub[:seed])[0]  # sub is in first-search order: its top kq
        y[:seed] = np.maximum(s.astype(np.float64), 0.0) ** p.gamma
        A = sparse.identity(len(sub), format="csr") - p.alpha * S
        f = conjugate_gradient(A, y, p.tol, p.iterations)
        order = np.argsort(-f, kind="stable")[:k]
        out_r[b, : len(order)] = sub[order]
        out_s[b, : len(order)] = f[order]
    return space.hits(out_r, out_s)
