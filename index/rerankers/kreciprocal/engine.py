"""The incremental engine of k-reciprocal re-ranking: for a batch of probes, d_J and d (Eq. 10,
12) of the gallery rows that can reach the top k, computed only where the probe changes V_g
and read from the offline inverted index of the gallery's V vectors elsewhere; the same
numbers as the dense computation (paper.py), bit for bit where both run (docs/reranking.md)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ...space import MetricSpace
from ...threads import in_threads
from ..neighbours import Lists, extremes_digest, reverse_index
from .scan import Pairs, ProbeScan
from .sets import ProbeBatch, gather, lookup, sets_digest, top_rows, unique_inverse

if TYPE_CHECKING:
    from . import KReciprocalParams


def terms(batch: ProbeBatch, pools: np.ndarray, p: KReciprocalParams) -> tuple[np.ndarray, np.ndarray]:
    """d_J(p, g) and the row-normalised d(p, g) for each probe and each row g of its pool (B × pool)."""
    B, width = pools.shape
    probes = batch.probe()
    Y = np.concatenate([probes[:, None], np.where(pools >= 0, probes[:, None] - batch.n + pools, -1)], 1)
    Lk2 = np.full((Y.size, p.k2), -1, dtype=np.int64)        # N(y, k2) for the probe and its pool
    valid = Y.ravel() >= 0
    # k2 = 1 is no expansion in the code (V_y itself), not V of y's nearest, which need not be y
    Lk2[valid] = batch.lists(Y.ravel()[valid], p.k2) if p.k2 > 1 else Y.ravel()[valid][:, None]
    X, inv = unique_inverse(Lk2[Lk2 >= 0])
    ri, col, w = batch.V(X, p.k1)                              # V_z for every z there
    # V_qe(y) = mean of V_z over z ∈ N(y, k2) (§4.4).  The probe's first, as a dense table over
    # the codes (a column is b·(n + 1) + x: one table serves the whole batch)
    n_y = (Lk2 >= 0).sum(1)
    ptr = np.concatenate([[0], np.cumsum(np.bincount(ri, minlength=len(X)))])  # ri is sorted: V_z is ri's run z
    idx = np.full(Lk2.shape, -1)
    idx[Lk2 >= 0] = inv
    p_rows = idx.reshape(B, width + 1, p.k2)[:, 0]              # the probe's N(p, k2), as indices of X
    pz = p_rows[p_rows >= 0]
    pb = np.flatnonzero(p_rows >= 0) // p_rows.shape[1]
    i, at = gather(ptr, pz)
    pc, pinv = unique_inverse(col[at])  # V_qe(p), sparse: (columns, values)
    pv = np.bincount(pinv, weights=w[at] / n_y[pb[i] * (width + 1)])
    # the pool's: only entries in the probe's support count (min(·) is 0 elsewhere), summed per (y, column)
    keep = lookup(pc, pv, col) > 0
    yi = np.flatnonzero(Lk2 >= 0) // p.k2                       # row-major: the order of `inv`
    yi, zi = yi[~(yi % (width + 1) == 0)], inv[~(yi % (width + 1) == 0)]
    k_ptr = np.concatenate([[0], np.cumsum(np.bincount(ri[keep], minlength=len(X)))])  # kept entries, by node
    i, at = gather(k_ptr, zi)
    at = np.flatnonzero(keep)[at]
    t_y = yi[i]
    key = t_y * batch.n_codes + col[at]
    uk, kinv = unique_inverse(key)
    val = np.bincount(kinv, weights=w[at] / n_y[t_y])
    ky, kcol = np.divmod(uk, batch.n_codes)
    tmin = np.bincount(ky, weights=np.minimum(val, lookup(pc, pv, kcol)), minlength=Y.size).reshape(B, width + 1)[:, 1:]
    d_j = 1.0 - tmin / (2.0 - tmin)                            # Σ max = Σ V_p + Σ V_g − Σ min = 2 − Σ min
    s_pg = batch.scan.at(np.arange(B)[:, None], np.maximum(pools, 0))
    d_orig = (batch.s_qq[:, None] - s_pg) / batch.row_max(probes)[:, None]
    return d_j, d_orig


def probe_vector(batch: ProbeBatch, p: KReciprocalParams) -> tuple[np.ndarray, np.ndarray]:
    """Each probe's query-expanded V_qe(p) (§4.4: the mean of V_z over z ∈ N(p, k2)), one sparse
    vector over the batch's codes (its sorted columns, their values), summed as `terms` sums it."""
    probes = batch.probe()
    Lp = batch.lists(probes, p.k2) if p.k2 > 1 else probes[:, None]
    X, inv = unique_inverse(Lp[Lp >= 0])
    ri, col, w = batch.V(X, p.k1)
    n_p = (Lp >= 0).sum(1)
    ptr = np.concatenate([[0], np.cumsum(np.bincount(ri, minlength=len(X)))])  # ri is sorted: V_z is ri's run z
    pb = np.flatnonzero(Lp >= 0) // Lp.shape[1]
    i, at = gather(ptr, inv)
    pc, pinv = unique_inverse(col[at])
    return pc, np.bincount(pinv, weights=w[at] / n_p[pb[i]])


def support_index(space: MetricSpace, lists: Lists, extremes: dict, sets: dict, k1: int,
                  k2: int) -> dict[str, np.ndarray]:
    """Offline, over the gallery alone: every item's query-expanded V_qe(g) (the mean of V_z over
    z ∈ N(g, k2); V_z of Eq. 7 on R*(z, k1)), stored as the official code's inverted index: for
    each item j, the items g with V_qe(g)[j] > 0 ("items"[ptr[j]:ptr[j+1]]) and that value
    ("values").  Summed as `terms` sums it, so a probe reads the same numbers."""
    rows = lists.rows

    def compute():
        n = space.n
        cnt = np.diff(sets["ptr"])
        owner = np.repeat(np.arange(n), cnt)
        self_s = extremes["self"].astype(np.float64)
        rm = self_s - extremes["min1"]  # the row maximum of d, as ProbeBatch.row_max reads it
        rm = np.where(rm > 0, rm, 1.0)
        w = np.exp(-(self_s[owner] - sets["sims"].astype(np.float64)) / rm[owner])
        total = np.bincount(owner, weights=w, minlength=n)
        V = w / np.maximum(total[owner], 1e-300)

        def block(a: int) -> tuple[np.ndarray, np.ndarray]:
            g = np.arange(a, min(a + 2048, n))
            z = rows[g, :k2].astype(np.int64) if k2 > 1 else g[:, None]  # k2 = 1: V_g itself
            n_y = (z >= 0).sum(1)
            flat = np.flatnonzero(z >= 0)
            gi, at = gather(sets["ptr"], z.ravel()[flat])
            gi = flat[gi] // z.shape[1]
            uk, kinv = unique_inverse(sets["rows"][at].astype(np.int64) * n + g[gi])
            return uk, np.bincount(kinv, weights=V[at] / n_y[gi])
        keys, vals = zip(*in_threads(block, range(0, n, 2048)), strict=True)
        key, val = np.concatenate(keys), np.concatenate(vals)
        order = np.argsort(key, kind="stable")
        j, g = np.divmod(key[order], n)  # by column j, then item g
        ptr = np.concatenate([[0], np.cumsum(np.bincount(j, minlength=n))])
        return {"ptr": ptr, "items": g.astype(np.int32), "values": val[order]}
    inputs = (lists.digest, extremes_digest(space), sets_digest(space, lists, k1))
    return space.artefact("kreciprocal-support", {"k1": k1, "k2": k2}, compute, inputs=inputs)


def least_similar_of(space: MetricSpace, extremes: dict) -> tuple[np.ndarray, np.ndarray]:
    """(ptr, src): src[ptr[i]:ptr[i+1]] the items whose least similar item is i (`row_extremes`'s arg1)."""
    return reverse_index(space, extremes["arg1"][:, None], 1, extremes_digest(space))


def refresh(batch: ProbeBatch, p: KReciprocalParams, reverse_k2) -> Pairs:
    """The (probe, gallery row g) pairs whose V_qe(g) in the probe's universe may differ from the
    gallery's: g's list N(g, k2) changed, or it holds a node z whose V_z changed.  V_z changes
    where R*(z, k1) does or z's row maximum moves (the probe below z's smallest similarity, or
    the own row was it).  R*(z) can change only where R(z, k1) changed or R(c, ½k1) did for a
    member c (by the symmetry of R, z ∈ R(c, k1) of the gallery then, R(z, k1) being unchanged);
    R(·, k) can change only at the nodes affected at k, so those are compared with the offline
    sets first.  The R* of those z, and the probes', are computed here once, compared with the
    offline sets, and kept for `members` (`batch.refreshed`, `batch.computed_sets`)."""
    extremes, offline = batch.extremes, batch.offline
    assert offline is not None  # built with the offline sets (kreciprocal)
    n, stride = batch.n, batch.stride
    maybe_b, maybe_x = [], []
    for k in dict.fromkeys((p.k1, batch.k_half)):
        # R(c, k) where it can have changed (c affected at k), compared with the offline set
        tb, tc = batch.affected[k].pairs()
        R = np.sort(batch.reciprocal(tb * stride + tc, k), axis=1)
        off = offline["r1" if k == p.k1 else "rh"][tc]
        off = np.sort(np.where(off >= 0, tb[:, None] * stride + off, -1), axis=1)
        moved = (R != off).any(1)
        tb, tc = tb[moved], tc[moved]
        if k == p.k1:
            maybe_b.append(tb)
            maybe_x.append(tc)
        if k == batch.k_half:  # R*(x) reads R(c, ½k1) for c ∈ R(x, k1): by the symmetry of R, x ∈ R(c, k1)
            r1 = offline["r1"][tc]
            ok = r1 >= 0
            maybe_b.append(np.broadcast_to(tb[:, None], r1.shape)[ok])
            maybe_x.append(r1[ok])
    mb, mx = Pairs.of(np.concatenate(maybe_b), np.concatenate(maybe_x), n).pairs()
    codes = np.concatenate([mb * stride + mx, batch.probe()])
    codes.sort()
    ri, y = batch.expanded(codes, p.k1)
    sims = batch.similarity(codes[ri], y)
    cnt = np.bincount(ri, minlength=len(codes))
    kptr = np.concatenate([[0], np.cumsum(cnt)])
    batch.computed_sets = (codes, kptr, y, sims)
    # the same set as offline: as many members, each the same (both sorted)
    cb, cx = np.divmod(codes, stride)
    gal = cx < n
    optr = offline["ptr"]
    same = np.zeros(len(codes), dtype=bool)
    same[gal] = cnt[gal] == optr[cx[gal] + 1] - optr[cx[gal]]
    i, at = gather(optr, cx[same])
    node = np.flatnonzero(same)[i]
    differ = np.bincount(node, weights=y[kptr[node] + (at - optr[cx[node]])] != cb[node] * stride + offline["rows"][at],
                         minlength=len(codes)) > 0
    same &= ~differ
    batch.refreshed = Pairs.of(cb[gal & ~same], cx[gal & ~same], n)
    # V_z also changes where the probe is z's least similar item, or z's was the probe's own row
    has = np.flatnonzero(batch.own >= 0)
    ptr, src = least_similar_of(batch.space, extremes)
    i, at = gather(ptr, batch.own[has])
    assert batch.scan.below is not None  # scanned with the rows' least similarities
    vz = batch.refreshed | batch.scan.below | Pairs.of(has[i], src[at], n)
    if p.k2 == 1:  # V_qe(g) = V_g
        return vz
    zb, zx = vz.pairs()
    ptr, src = reverse_k2
    i, at = gather(ptr, zx)
    return batch.changed[p.k1] | Pairs.of(zb[i], src[at], n)  # N(g, k2) ⊂ N(g, k1 + 1)


def whole_gallery(batch: ProbeBatch, p: KReciprocalParams, support: dict, reverse_k2, k: int,
                  pool: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per probe, the rows that can reach its top k by d* over the whole gallery (the official
    code's ranking), or over the plain search's top `pool` candidates, in the plain order
    (−1 padded), with their d_J and d (`terms`).

    d_J(p, g) < 1 only where V_qe(p) and V_qe(g) share a nonzero entry.  Where V_qe(g) is the
    gallery's (`refresh` says where it may not be), the offline inverted index gives
    Σ_j min(V_p[j], V_g[j]) directly, as the official code computes it; the rows whose vector
    may have changed go through `terms`; every other row has d_J = 1 and d* = (1 − λ) +
    λ d(p, g), so the first k of them in the plain order are all that can reach the top k."""
    B, n, stride = batch.B, batch.n, batch.stride
    scan, own = batch.scan, batch.own
    has = np.flatnonzero(own >= 0)
    fresh = refresh(batch, p, reverse_k2) - Pairs.of(has, own[has], n)
    pc, pv = probe_vector(batch, p)
    inpool = None
    if pool is not None:  # only the plain search's top `pool` are ranked
        top = scan.top[:, :pool]
        ok = top >= 0
        inpool = Pairs.of(np.broadcast_to(np.arange(B)[:, None], top.shape)[ok], top[ok], n)
        fresh = fresh & inpool
    # unchanged vectors that meet the probe's support: Σ_j min(V_p[j], V_g[j]) over the index
    codes, vals = pc[pv > 0], pv[pv > 0]
    pb, pj = np.divmod(codes, stride)
    keep = pj < n  # the probe's own column: no unchanged vector holds it
    i, at = gather(support["ptr"], pj[keep])
    b, g = pb[keep][i], support["items"][at].astype(np.int64)
    mins = np.minimum(support["values"][at], vals[keep][i])
    ok = ~fresh.has(b, g) & (g != own[b])
    if inpool is not None:
        ok &= inpool.has(b, g)
    key = b[ok] * n + g[ok]
    order = np.argsort(key, kind="stable")  # per (probe, g): columns in ascending order, as `terms` sums
    uk, kinv = unique_inverse(key[order])
    tmin = np.bincount(kinv, weights=mins[ok][order])
    ob, og = np.divmod(uk, n)
    # the changed ones, by `terms` (each probe's in the plain order)
    fb, fg = fresh.pairs()
    per = np.bincount(fb, minlength=B)
    pools = np.full((B, max(int(per.max(initial=0)), 1)), -1, dtype=np.int64)
    o = np.lexsort((fg, -scan.at(fb, fg), fb))
    fb, fg = fb[o], fg[o]
    pools[fb, np.arange(len(fb)) - np.repeat(np.cumsum(per) - per, per)] = fg
    dj_fresh, do_fresh = terms(batch, pools, p)
    # the rest: the first k in the plain order outside both (and inside the pool)
    taken = (fresh, Pairs(uk, n))  # two sorted sets, each looked up (their union is a sort of both)
    rm = batch.row_max(batch.probe())
    o_start = np.searchsorted(ob, np.arange(B + 1))
    s_o = scan.at(ob, og)
    parts = []
    for j in range(B):
        og_j, t_j = og[o_start[j]: o_start[j + 1]], tmin[o_start[j]: o_start[j + 1]]
        f_j = pools[j][pools[j] >= 0]
        rest, s_rest = first_outside(scan, j, taken, min(k, n), pool)
        rows = np.concatenate([f_j, og_j, rest])
        s_j = np.concatenate([scan.at(j, f_j), s_o[o_start[j]: o_start[j + 1]], s_rest])
        tm = np.concatenate([t_j, np.zeros(len(rest))])
        d_j = np.concatenate([dj_fresh[j, : len(f_j)], 1.0 - tm / (2.0 - tm)])
        d_o = np.concatenate([do_fresh[j, : len(f_j)], (batch.s_qq[j] - s_j[len(f_j):]) / rm[j]])
        o = np.lexsort((rows, -s_j))  # the plain order (ranked stably by d* after)
        parts.append((rows[o], d_j[o], d_o[o]))
    width = max(len(r) for r, _, _ in parts)
    out = np.full((B, width), -1, dtype=np.int64), np.ones((B, width)), np.zeros((B, width))  # pads: finite
    for j, part in enumerate(parts):
        for a, v in zip(out, part, strict=True):
            a[j, : len(v)] = v
    return out


def first_outside(scan: ProbeScan, j: int, taken: tuple[Pairs, ...], k: int,
                  pool: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Probe j's first k rows in the plain order outside every set of `taken` (and within its first
    `pool`), with their scores: from the scan's top rows, or, where those run out before k are
    found and the probe's universe holds more, from its whole row."""
    top, top_s = scan.top[j], scan.top_s[j]
    if pool is not None:
        top, top_s = top[:pool], top_s[:pool]
    ok = top >= 0
    for t in taken:
        ok &= ~t.has(j, top)
    if ok.sum() >= k or pool is not None or (top >= 0).sum() < scan.depth:
        at = np.flatnonzero(ok)[:k]
        return top[at], top_s[at]
    s = scan.row(j)
    for t in taken:
        mine = t.codes[(t.codes >= j * scan.n) & (t.codes < (j + 1) * scan.n)]
        s[mine - j * scan.n] = -np.inf
    if scan.own[j] >= 0:
        s[scan.own[j]] = -np.inf
    rows = top_rows(s[None], np.array([scan.own[j]]), k)[0]
    rows = rows[rows >= 0]
    rows = rows[np.isfinite(s[rows])]
    return rows, scan.at(np.full(len(rows), j), rows)  # the pass's scores where it kept them
