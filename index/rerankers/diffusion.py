"""Diffusion on the gallery's mutual kNN graph: Iscen, Tolias, Avrithis, Furon, Chum, "Efficient
Diffusion on Region Manifolds", CVPR 2017, as its official code (ahmetius/diffusion-retrieval:
knngraph.m, transition_matrix.m, ymake.m, dfs.m, run_test.m) runs global descriptors: the whole
gallery's graph built offline, f = (I − αS)⁻¹ y solved per query by MATLAB pcg's conjugate
gradients, items ranked by f (equal f by index).  Above WHOLE_UP_TO items the default cuts each
query's graph to its top TOPN (findtrunc.m + trunclap.m, run_test.m's topn for its large sets).
Variants: `truncation` set to a number (that cut at any size) and `ties=score`.  The equations, the leave-one-out graph
and the measurements: docs/reranking.md ("Diffusion on the whole gallery"); docs/fidelity.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import sparse

from core.memory import check_fits
from core.params import param

from ..space import Hits, MetricSpace
from ..threads import in_threads
from .neighbours import neighbour_lists, reverse_index, without
from .registry import AUTO, RERANKERS, WHOLE_GALLERY, candidates

BATCH_CELLS = 1 << 22  # queries × items diffused together on the whole graph (one sparse product per CG
# step; the solver holds about eight such float64 blocks: 256 MB)
# truncated queries per thread task: each is solved alone (side by side in one sparse product,
# their graphs fall out of the cache and run slower)
QUERY_BATCH = 16
EPS = float(np.finfo(np.float64).eps)
MAX_STAG = 3  # pcg's maxstagsteps: steps too small to move x before it stops
# `truncation=auto`: the whole graph costs about 1.3-1.5 CPU-µs per gallery item per query (147 ms at
# 10⁵, 1.29 s at 10⁶ on the distractor benchmark: docs/scale-out.md), past the 1 s a re-ranked search
# may take above about 7 × 10⁵ items; above WHOLE_UP_TO each query's graph is cut to its top TOPN, the
# value run_test.m takes for its 100k-image sets
WHOLE_UP_TO, TOPN = 500_000, 10_000


@dataclass
class DiffusionParams:
    k: int = param(50, "neighbours per item in the kNN graph, the item itself counted (run_test.m: 50); clipped to "
                       "the gallery", bounds="[2, inf)", size=True)  # the item itself and a neighbour
    kq: int = param(10, "the query's top items seeding the diffusion (run_test.m: 10); clipped to the gallery",
                    bounds="[1, inf)", size=True)
    alpha: float = param(0.99, "α of (I − αS) f = y", bounds="(0, 1)")
    gamma: float = param(3.0, "power γ of the similarities in the graph and the seed", bounds="(0, inf)")
    truncation: int = param(AUTO, "the query's first-search candidates the graph is cut to, clipped to the gallery: "
                                  "all diffuses on the whole gallery, as run_test.m does for global descriptors "
                                  "(dotrunc = 0); a number is findtrunc.m's truncation (a variant); auto: all up to "
                                  f"{WHOLE_UP_TO:,} items, {TOPN:,} (run_test.m's topn) above",
                            bounds="[1, inf)", named={"all": WHOLE_GALLERY, "auto": AUTO})
    iterations: int = param(20, "conjugate-gradient iterations at most (run_test.m: 20)", bounds="[1, 1000]")
    tol: float = param(1e-6, "conjugate-gradient tolerance on the relative residual (run_test.m: 1e-6)",
                       bounds="(0, inf)")
    ties: Literal["index", "score"] = param("index", "order of items with equal f (those the diffusion does not "
                                                     "reach: f = 0): index, run_test.m's stable sort | score, by "
                                                     "the plain score (a variant)")


def conjugate_gradient(A, b: np.ndarray, tol: float, iterations: int) -> np.ndarray:
    """MATLAB's `pcg(A, b, tol, iterations)` without a preconditioner (dfs.m), for A symmetric
    positive definite: from x = 0, converged once the true residual ‖b − Ax‖ ≤ tol ‖b‖ (checked
    where the recurrence's residual says so, as pcg checks it); not converged, the iterate of
    smallest residual (x = 0 included, the first of equals), as pcg returns it with flag 1, and
    pcg's stagnation and "more steps" stops.  `A`: a matrix, or a function X ↦ AX; `b`: a vector,
    or a matrix whose columns are solved side by side, each with its own stops and minimum."""
    apply = A if callable(A) else (lambda v: A @ v)
    one = b.ndim == 1
    B = np.asarray(b[:, None] if one else b, dtype=np.float64)
    n, m = B.shape
    tol = min(max(tol, EPS), 1 - EPS)  # pcg's clamps (with a warning there)

    def sq(v):  # the squared norm of each column
        return np.einsum("ij,ij->j", v, v)

    tolb = tol * np.sqrt(sq(B))
    x = np.zeros_like(B)
    r = B.copy()
    p = np.zeros_like(B)
    rr = sq(r)
    normr_act = np.sqrt(rr)
    normrmin = normr_act.copy()
    xmin = x.copy()
    live = normr_act > tolb  # a zero b is solved by x = 0 (tol < 1, so nothing else stops here)
    converged = ~live
    rho = np.ones(m)
    stag = np.zeros(m, dtype=np.int64)
    more = np.zeros(m, dtype=np.int64)
    max_more = min(n // 50, 5, n - iterations)  # pcg's maxmsteps
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for it in range(iterations):
            if not live.any():
                break
            rho1, rho = rho, np.where(live, rr, rho)
            live &= (rho != 0) & np.isfinite(rho)  # pcg's breakdowns (flag 4) stop a column
            if it:
                beta = rho / rho1
                live &= (beta != 0) & np.isfinite(beta)
                p *= np.where(live, beta, 0.0)
                p += r
            else:
                p[:] = r
            p[:, ~live] = 0.0  # a stopped column stays as it is
            q = apply(p)
            pq = np.einsum("ij,ij->j", p, q)
            live &= (pq > 0) & np.isfinite(pq)
            a = np.where(live, rho / np.where(live, pq, 1.0), 0.0)
            live &= np.isfinite(a)
            a = np.where(live, a, 0.0)
            small = np.sqrt(sq(p)) * np.abs(a) < EPS * np.sqrt(sq(x))
            stag = np.where(live, np.where(small, stag + 1, 0), stag)
            x += a * p
            r -= a * q
            rr = sq(r)
            normr = np.sqrt(rr)
            normr_act = np.where(live, normr, normr_act)
            check = live & ((normr <= tolb) | (stag >= MAX_STAG) | (more > 0))
            if check.any():  # the true residual decides, and carries on as r
                r[:, check] = B[:, check] - apply(x)[:, check]
                rr = sq(r)
                normr_act = np.where(check, np.sqrt(rr), normr_act)
                done = check & (normr_act <= tolb)
                converged |= done
                live &= ~done
                fail = check & ~done
                stag = np.where(fail & (stag >= MAX_STAG) & (more == 0), 0, stag)
                more = np.where(fail, more + 1, more)
                live &= ~(fail & (more >= max_more))
            better = live & (normr_act < normrmin)
            normrmin = np.where(better, normr_act, normrmin)
            if better.any():
                xmin[:, better] = x[:, better]
            live &= stag < MAX_STAG
    if not converged.all():  # pcg keeps the minimum unless its true residual is above the last one's
        use = ~converged & (np.sqrt(sq(B - apply(xmin))) <= normr_act)
        x[:, use] = xmin[:, use]
    return x[:, 0] if one else x


def _edges(sub: np.ndarray, rows: np.ndarray, sims: np.ndarray,
           place: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The k-NN edges i → j within `sub`, by row in list order: (edges per row, j, max(s, 0)).
    `place`: see `affinity`; None (a gallery no process holds) looks each neighbour up in `sub`
    sorted instead, holding nothing of the gallery's size."""
    T = len(sub)
    if place is None:
        order = np.argsort(sub, kind="stable")
        at = np.minimum(np.searchsorted(sub, rows, sorter=order), T - 1)
        local = np.where(sub[order[at]] == rows, order[at], -1).astype(np.int32)
    else:
        place[sub] = np.arange(T, dtype=np.int32)
        local = place[rows]  # each neighbour's place in sub, −1 outside (or none: place[-1])
        place[sub] = -1
    keep = (local >= 0) & (local != np.arange(T, dtype=np.int32)[:, None])
    at = np.flatnonzero(keep)
    return keep.sum(1), local.ravel().take(at), np.maximum(sims.ravel().take(at).astype(np.float64), 0.0)


def _mutual(counts: np.ndarray, cols: np.ndarray, w: np.ndarray, size: int, gamma: float) -> sparse.csr_matrix:
    """The edges (`_edges`, rows in order) kept where the reverse edge is one too, each weight to
    the power γ: a CSR of `size` rows, columns unsorted within a row."""
    indptr = np.zeros(size + 1, dtype=np.int32 if len(cols) < 2**31 else np.int64)
    np.cumsum(counts, out=indptr[1: len(counts) + 1])
    indptr[len(counts) + 1:] = indptr[len(counts)]
    # the lists hold distinct items: no duplicates; int32 indices, as scipy keeps them
    E = sparse.csr_matrix((w, cols.astype(indptr.dtype, copy=False), indptr), shape=(size, size))
    # an edge i → j is kept where j → i is one too (i is in the k-NN of its neighbour j as well):
    # the edges times the transposed pattern, linear passes over the sparse entries (unsorted
    # columns: scipy's general element-wise product, which needs no sort)
    pattern = sparse.csr_matrix((np.ones(E.nnz), E.indices, E.indptr), shape=(size, size))
    A = sparse.csr_matrix(E.multiply(pattern.T))
    A.data = power(A.data, gamma)  # the similarities' power, on the mutual edges only
    return A


def affinity(sub: np.ndarray, rows: np.ndarray, sims: np.ndarray, gamma: float,
             place: np.ndarray | None) -> sparse.csr_matrix:
    """The mutual-kNN affinity A restricted to `sub` (knngraph.m, then A(sub, sub)): `rows`,
    `sims` are the k-NN lists of the items in `sub`, in its order, each of distinct items (−1: a
    list that ran out).  `place`: n + 1 int32 entries of −1 for a gallery of n items (a −1 entry
    reads the last), left as it was found.  A's columns are not sorted within a row."""
    return _mutual(*_edges(sub, rows, sims, place), len(sub), gamma)


def power(x: np.ndarray, gamma: float) -> np.ndarray:
    """x^γ (x ≥ 0): an integral γ up to 4 by products, within two ulps of `pow` at a tenth of its time."""
    if gamma in (1.0, 2.0, 3.0, 4.0):
        out = x.copy()
        for _ in range(int(gamma) - 1):
            out *= x
        return out
    return x ** gamma


def normalised(A: sparse.csr_matrix) -> sparse.csr_matrix:
    """S = D^{-1/2} A D^{-1/2}; an isolated node's row and column stay 0 (transition_matrix.m)."""
    deg = np.asarray(A.sum(1)).ravel()
    inv = np.where(deg > 0, 1.0 / np.sqrt(np.maximum(deg, 1e-300)), 0.0)
    row = np.repeat(np.arange(A.shape[0]), np.diff(A.indptr))
    return sparse.csr_matrix((A.data * inv[row] * inv[A.indices], A.indices, A.indptr), shape=A.shape)


def whole_graph(space: MetricSpace, p: DiffusionParams) -> dict[str, np.ndarray]:
    """Offline: the mutual-kNN affinity of the whole gallery (knngraph.m; CSR arrays) and its
    degrees."""
    def compute():
        A = affinity(np.arange(space.n), lists.rows[:, : p.k], lists.sims[:, : p.k], p.gamma,
                     np.full(space.n + 1, -1, dtype=np.int32))
        return {"indptr": A.indptr, "indices": A.indices, "data": A.data, "deg": np.asarray(A.sum(1)).ravel()}
    # the graph's lower bound: a mutual k-NN graph keeps at most k entries per row, each a column and a weight
    size = space.n * (p.k * 12 + 16)
    check_fits(f"diffusion: the gallery's k-NN graph ({space.n:,} items, k = {p.k})", size,
               "give diffusion a truncation")
    # the lists the leave-one-out corrections read too (k + 1: a left-out row may drop out)
    lists = neighbour_lists(space, p.k + 1)
    return space.artefact("diffusion-graph", {"k": p.k, "gamma": p.gamma}, compute, inputs=(lists.digest,),
                          reserve=size)


def _without_item(lists: np.ndarray, sims: np.ndarray, rev, i: int, k: int, gamma: float):
    """The gallery-without-i affinity's change: (gone, r, c, w) with `gone` the rows and columns
    that are rebuilt (i and the items whose k-NN list held i) and (r, c, w) their new entries,
    both directions."""
    ptr, src = rev
    L = src[ptr[i]: ptr[i + 1]]
    L = L[L != i]
    gone = np.concatenate([[i], L])
    if not len(L):
        return gone, np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    nr, ns = without(lists[L], sims[L], np.full(len(L), i), k)  # their lists move up by one entry
    nr = np.where(nr == i, -1, nr)  # a list no longer than k keeps i at its end: it is gone all the same
    r = np.repeat(L, k)
    c, s = nr.ravel().astype(np.int64), ns.ravel()
    ok = (c >= 0) & (c != r)
    r, c, s = r[ok], c[ok], s[ok]
    # c's list without i: its own list where i was not in it, else moved up as above
    in_L = np.zeros(len(lists), dtype=bool)
    in_L[L] = True
    cl = np.where(in_L[c][:, None], np.full((len(c), k), -1), lists[c, :k])
    moved_c = np.flatnonzero(in_L[c])
    cl[moved_c] = nr[np.searchsorted(L, c[moved_c])]  # L is sorted (the reverse lists are)
    hit = cl == r[:, None]
    m = hit.any(1)
    w_rc = np.maximum(s[m].astype(np.float64), 0.0) ** gamma  # r's entry for c
    out_r, out_c, out_w = [r[m]], [c[m]], [w_rc]
    # the entry c → r, from c's list, where c is not rebuilt itself (else it is its own row above)
    back = m & ~in_L[c]
    pos = hit[back].argmax(1)
    w_cr = np.maximum(sims[c[back], pos].astype(np.float64), 0.0) ** gamma
    out_r.append(c[back])
    out_c.append(r[back])
    out_w.append(w_cr)
    return gone, np.concatenate(out_r), np.concatenate(out_c), np.concatenate(out_w)


def _diffuse_whole(space: MetricSpace, queries: np.ndarray, seeds: np.ndarray, self_ids: np.ndarray,
                   p: DiffusionParams) -> np.ndarray:
    """f = (I − αS)⁻¹ y on the whole gallery's graph for each query (n × B), y from its seed
    rows (−1: none), each leave-one-out query on the graph without its own item."""
    n, B = space.n, len(queries)
    g = whole_graph(space, p)
    A = sparse.csr_matrix((g["data"], g["indices"], g["indptr"]), shape=(n, n))
    Y = np.zeros((n, B))
    for b in range(B):
        r = seeds[b][seeds[b] >= 0]
        s = space.score(queries[b: b + 1], r)[0]
        Y[r, b] = np.maximum(s.astype(np.float64), 0.0) ** p.gamma
    deg = np.repeat(g["deg"][:, None], B, 1)
    keep = np.ones((n, B))
    parts = []  # the rebuilt entries of each leave-one-out query's graph: (row, column, weight, query)
    loo = np.flatnonzero(self_ids >= 0)
    if len(loo):
        lists, sims, digest = neighbour_lists(space, p.k + 1)
        rev = reverse_index(space, lists, p.k, digest)
        for j in loo:
            gone, r, c, w = _without_item(lists, sims, rev, int(self_ids[j]), p.k, p.gamma)
            keep[gone, j] = 0.0
            parts.append((r, c, w, np.full(len(r), j)))
    pr, pc, pw, pb = (np.concatenate([np.zeros(0, dtype=t), *(x[i] for x in parts)])
                      for i, t in enumerate((np.int64, np.int64, np.float64, np.int64)))

    def product(U: np.ndarray) -> np.ndarray:
        """A′U: the offline A with the rebuilt rows and columns left out, plus their new entries."""
        out = (A @ (U * keep)) * keep
        if len(pr):
            out += np.bincount(pr * B + pb, weights=pw * U[pc, pb], minlength=n * B).reshape(n, B)
        return out

    if len(loo):  # the degrees of the gallery without each query's item
        deg[:, loo] = product(np.ones((n, B)))[:, loo]
    inv = np.where(deg > 0, 1.0 / np.sqrt(np.maximum(deg, 1e-300)), 0.0)
    return conjugate_gradient(lambda U: U - p.alpha * inv * product(inv * U), Y, p.tol, p.iterations)


def _ranked(f: np.ndarray, rows: np.ndarray, k: int, s: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The top k of `rows` by f; equal f (items the diffusion does not reach: f = 0) by row, as
    run_test.m's stable `sort(scores, 'descend')` ranks the gallery, or, given the plain scores
    s (`ties=score`), by s first."""
    if len(f) > k:  # only those above the k-th value of f, and every tie with it, are sorted
        at = np.flatnonzero(f >= np.partition(f, len(f) - k)[len(f) - k])
        f, rows, s = f[at], rows[at], None if s is None else s[at]
    order = np.lexsort((rows, -f) if s is None else (rows, -s, -f))[:k]
    return rows[order], f[order]


@RERANKERS.register("diffusion", DiffusionParams, offline=True, depth="kq", pool="truncation",
                    grid={"k": (5, 10, 30, 50), "alpha": (0.9, 0.99), "gamma": (1.0, 3.0)},
                    whole_up_to=WHOLE_UP_TO, pool_above=TOPN, by_row=True)
def diffusion(space: MetricSpace, queries: np.ndarray, first: Hits | None, k: int, *, self_ids: np.ndarray,
              params: DiffusionParams) -> Hits:
    """Diffusion on the mutual kNN graph (Iscen et al. CVPR 2017): rank items by f = (I − αS)⁻¹y."""
    p = params
    assert first is not None  # registered with reads_first
    out_r = np.full((len(queries), k), -1, dtype=np.int64)
    out_s = np.full((len(queries), k), -np.inf, dtype=np.float32)
    # the whole graph is built in the process: a gallery read by row (no N-sized array) diffuses
    # on each query's graph instead, all its items where the truncation asks for them
    if p.truncation >= space.n and space.holds_gallery:
        seeds, _ = candidates(first, self_ids, p.kq)
        step = max(1, min(len(queries), BATCH_CELLS // space.n))
        whole_graph(space, p)  # built once, before the threads read it
        if (self_ids >= 0).any():
            built = neighbour_lists(space, p.k + 1)
            reverse_index(space, built.rows, p.k, built.digest)

        def batch(a: int) -> None:  # batches are independent: the sparse products release the GIL
            part = slice(a, a + step)
            F = _diffuse_whole(space, queries[part], seeds[part], self_ids[part], p)
            for j in range(F.shape[1]):
                f = F[:, j].copy()
                me = int(self_ids[a + j])
                # the top by f: those above the k-th value, and every tie with it
                cut = np.partition(-f, min(k, space.n - 1))[min(k, space.n - 1)] if k < space.n else np.inf
                rows = np.flatnonzero(-f <= cut)
                rows = rows[rows != me]
                s = space.score(queries[a + j: a + j + 1], rows)[0] if p.ties == "score" else None
                r, v = _ranked(f[rows], rows, k, s)
                out_r[a + j, : len(r)], out_s[a + j, : len(r)] = r, v
        in_threads(batch, range(0, len(queries), step))
        return space.hits(out_r, out_s)
    lists, sims, _ = neighbour_lists(space, p.k + 1)  # + 1: a leave-one-out row may drop out
    if first.k < min(p.truncation, space.n):  # `rerank` searches this deep (its own rows left out)
        first = space.search(queries, p.truncation, exclude=self_ids)
    rows, scores = candidates(first, self_ids, max(p.truncation, k))

    def one(b: int, place: np.ndarray | None) -> None:
        """Query b on the graph of its first-search candidates (findtrunc.m + trunclap.m)."""
        found = rows[b] >= 0
        sub = rows[b][found]
        if not len(sub):
            return
        nr, ns = without(lists[sub], sims[sub], np.full(len(sub), self_ids[b]), min(p.k, space.n))
        S = normalised(affinity(sub, nr, ns, p.gamma, place))
        seed = min(p.kq, len(sub))
        y = np.zeros(len(sub))
        s = scores[b][found]  # the search's exact s(q, ·), in its order: the top kq seed y
        y[:seed] = np.maximum(s[:seed].astype(np.float64), 0.0) ** p.gamma
        f = conjugate_gradient(lambda v: v - p.alpha * (S @ v), y, p.tol, p.iterations)
        r, v = _ranked(f, sub, k, s if p.ties == "score" else None)
        out_r[b, : len(r)] = r
        out_s[b, : len(r)] = v

    def some(a: int) -> None:  # queries are independent; each task its own `place`
        # (a gallery read by row: none of its size, each list looked up in its query's candidates)
        place = np.full(space.n + 1, -1, dtype=np.int32) if space.holds_gallery else None
        for b in range(a, min(a + QUERY_BATCH, len(queries))):
            one(b, place)
    in_threads(some, range(0, len(queries), QUERY_BATCH))
    return space.hits(out_r, out_s)
