"""k-reciprocal re-ranking: Zhong, Zheng, Cao, Li, "Re-ranking Person Re-identification with
k-reciprocal Encoding", CVPR 2017, following its official code (github zhunzhong07/
person-re-ranking, python-version/re_ranking_ranklist.py, the same as evaluation/utils/re_ranking.m).

Over the universe U = gallery ∪ {p} (the probe p), with N(x, k) the top k of x's row of
distances (x itself included):
  Eq. 3   R(x, k) = {y ∈ N(x, k+1) : x ∈ N(y, k+1)}                  (code: k+1 with x itself)
  Eq. 6   R*(x, k) = R(x, k) ∪ R(c, ½k) for every c ∈ R(x, k) with
          |R(x, k) ∩ R(c, ½k)| > ⅔ |R(c, ½k)|                            (code: ½k = round(k/2))
  Eq. 7   V_x[y] = exp(−d(x, y)) / Σ_{y′ ∈ R*(x)} exp(−d(x, y′)) on R*(x), 0 elsewhere
  §4.4    local query expansion: V_x ← mean of V_y over y ∈ N(x, k2)
  Eq. 10  d_J(p, g) = 1 − Σ_j min(V_p[j], V_g[j]) / Σ_j max(V_p[j], V_g[j])
  Eq. 12  d*(p, g) = (1 − λ) d_J(p, g) + λ d(p, g)
Distances: the code uses squared Euclidean distances, each row divided by its maximum.  Here
d(x, y) = s(x, x) − s(x, y) under the space's similarity, row-normalised the same way: in
cosine mode this is ½‖x̂ − ŷ‖²_M′ and the row normalisation makes it exactly the code's
distance of M′-normalised features; in bilinear mode it is the same drop in similarity.

What scales it.  Offline, once per space (cached): the gallery–gallery lists N(·, k1 + 2) and
each row's smallest similarities (neighbours.py), and over the gallery alone every item's
R(x, k1), R(x, ½k1) and R*(x, k1).  Online, the probe enters the lists (it takes its place in
every list whose (k+1)-th entry it does not fall below, and in every row's maximum; a
leave-one-out probe's own row leaves them).  Such a change of y's list can change R(x, k) only
for x = y, for the entry it pushes out and for the one a removed row lets in, so R(·, k) is
recomputed for those nodes alone, R*(x) only where x or a member of R(x, k1) is one of them, and
the offline sets serve everywhere else: the result is the same as recomputing everything.

Every gallery item is ranked by d* (the default pool, clipped to the gallery: the official code,
run for one probe at a time), yet d* is computed only where it can differ from (1 − λ) + λ d:
d_J(p, g) < 1 only where V_p and V_g share a nonzero entry.  Offline, the gallery's own V vectors
are stored as the official code's inverted index (item j → the g with V_g[j] > 0, and V_g[j]);
online, g whose V_g the probe may have changed (its list N(g, k2) changed, or holds a node whose
R* was recomputed or whose row maximum moved) get d* computed as below, the others read
Σ_j min(V_p[j], V_g[j]) from the index, and every item neither reaches has d_J = 1 exactly, so
the first k of those in the plain order are the only ones that can reach the top k.  A bounded
`pool` (a variant) ranks only the query's top `pool` candidates; up to BRUTE_POOL they are
ranked one by one: the V vectors of N(p, k2) and of N(g, k2) for each candidate g.  The
candidates come from the probe's full similarity row, which the row normalisation needs anyway,
not from a second (first) search.  Both ways give the same d*, bit for bit (tested).
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import faiss
import numpy as np

from core.errors import UserError
from core.params import param

from ..backends.gallery import Hits
from .neighbours import neighbour_lists, reverse_index, row_extremes, without
from .registry import RERANKERS, WHOLE_GALLERY
from .space import MetricSpace

BATCH = 32          # probes re-ranked together (one vectorised pass) ...
BATCH_CELLS = 1 << 22  # ... at most this many probe × gallery cells (S and the change flags: ~30 MB)
PAIR_CELLS = 1 << 25  # a gallery's whole similarity matrix is kept in RAM up to this many cells (128 MB)
SET_CELLS = 1 << 23  # the offline sets' reverse checks per block (64 MB of int64)
TERMS_BYTES = 1 << 26  # the latest calls' d_J and d kept for calls that differ in λ alone (64 MB)
_TERMS_LOCK = threading.Lock()
BRUTE_POOL = 150  # a pool up to this is cheaper ranked candidate by candidate; above, through the inverted index


@dataclass
class KReciprocalParams:
    k1: int = param(20, "k of the k-reciprocal sets R(p, k1); clipped to the gallery", bounds="[1, inf)", size=True)
    k2: int = param(6, "neighbours averaged in the local query expansion of the V vectors (1: none); clipped to the "
                       "gallery", bounds="[1, inf)", size=True)
    lambda_value: float = param(0.3, "λ: d* = (1 − λ) d_Jaccard + λ d_original", bounds="[0, 1]")
    pool: int = param(WHOLE_GALLERY, "the query's first-search candidates ranked by d*, clipped to the gallery: the "
                                     "default ranks every item, as the official code does; a smaller pool is a "
                                     "variant that leaves the rest out", bounds="[1, inf)")

    def validate(self):
        if self.k2 > self.k1 + 1:
            raise UserError(f"kreciprocal: k2 must be in [1, k1 + 1], got {self.k2}")


def unique(a: np.ndarray) -> np.ndarray:
    """np.unique by sorting (numpy's hash-based unique is several times slower on these codes)."""
    a = np.sort(a, kind="stable")
    return a[np.concatenate([[True], a[1:] != a[:-1]])] if len(a) else a


def top_rows(S: np.ndarray, own: np.ndarray, m: int) -> np.ndarray:
    """Each row's m largest entries (its own column, −1 none, left out), best first: the entries
    above a threshold estimated on a strided sample, sorted (a row where too few pass is
    partitioned whole).  Exact, and much cheaper than a partition of every row."""
    B, n = S.shape
    need = min(m + 1, n)
    if n <= 8 * need:
        order = np.argsort(-S, axis=1, kind="stable")[:, :need]
    else:
        step = max(1, n // 4096)
        sample = S[:, ::step]
        r = min(sample.shape[1], 2 * (need * sample.shape[1]) // n + 16)  # twice the expected count, and some
        thr = np.partition(sample, sample.shape[1] - r, axis=1)[:, sample.shape[1] - r]
        short = np.flatnonzero((S >= thr[:, None]).sum(1) < need)
        for b in short:  # rare: the sample's threshold is too high for this row
            thr[b] = np.partition(S[b], n - need)[n - need]
        bb, cc = np.divmod(np.flatnonzero(S >= thr[:, None]), n)
        o = np.lexsort((cc, -S[bb, cc], bb))  # by row, then best first (ties: lower column first)
        bb, cc = bb[o], cc[o]
        start = np.searchsorted(bb, np.arange(B))
        order = cc[start[:, None] + np.arange(need)[None, :]]
    rows = order.astype(np.int64)
    keep = rows != own[:, None]
    at = np.argsort(~keep, axis=1, kind="stable")[:, :m]  # the own row, if there, goes last and is cut
    out = np.take_along_axis(rows, at, 1)
    return np.where(np.take_along_axis(keep, at, 1), out, -1)


def gallery_similarities(space: MetricSpace) -> np.ndarray | None:
    """s(x, y) for every pair of gallery rows (n × n float32), kept in the space's memory while
    n² ≤ PAIR_CELLS: the pairs missing from the cached lists (members that an expansion brings
    in) are then a lookup, not a gather of d-dimensional keys per batch.  None above that."""
    if space.n * space.n > PAIR_CELLS:
        return None
    memo = space.store.memo
    if "kreciprocal-pairs" not in memo:
        S = np.empty((space.n, space.n), dtype=np.float32)
        for a in range(0, space.n, 2048):
            rows = np.arange(a, min(a + 2048, space.n))
            S[rows] = space.score(space.gallery_vectors(rows))
        memo["kreciprocal-pairs"] = {"S": S}
    return memo["kreciprocal-pairs"]["S"]


def half(k1: int) -> int:
    """The code's ½k1: int(np.around(k1 / 2)) (rounds half to even)."""
    return int(np.around(k1 / 2.0))


class _Batch:
    """A batch of probes, each in its own universe U_b = (gallery − its own row) ∪ {probe b}.
    A node is encoded b·(n + 1) + x, x a gallery row or n for the probe itself, so that every
    step runs over all probes at once.  Lists are the cached gallery lists with the probe's own
    row taken out and the probe put in its place.  `offline`: the gallery-only sets
    (`gallery_sets`); without them (building them, or a gallery too small for them) every set
    is computed."""

    def __init__(self, space: MetricSpace, lists: tuple[np.ndarray, np.ndarray], ext: dict[str, np.ndarray],
                 S: np.ndarray, s_qq: np.ndarray, own: np.ndarray, cand: np.ndarray,
                 k1: int, offline: dict | None = None, reverse: dict | None = None):
        self.space, self.n = space, space.n
        self.N1 = space.n + 1
        self.rows, self.sims = lists
        self.ext, self.S, self.s_qq, self.own = ext, S, s_qq.astype(np.float64), own
        self.k1, self.h = k1, half(k1)
        self.B = len(S)
        self.M = self.B * self.N1  # one past the largest code
        has = own >= 0
        self.q_min = np.minimum(S.min(1) if self.n else np.inf, self.s_qq)
        for b in np.flatnonzero(has):  # the probe's own row is not in its universe
            if S[b, own[b]] <= self.q_min[b]:
                self.q_min[b] = min(float(np.delete(S[b], own[b]).min()) if self.n > 1 else np.inf, self.s_qq[b])
        # the probes' own lists: their candidates by s(p, ·), each probe in its place
        cs = np.where(cand >= 0, np.take_along_axis(S, np.maximum(cand, 0), 1), -np.inf)
        order = np.argsort(-cs, axis=1, kind="stable")
        c, cs = np.take_along_axis(cand, order, 1), np.take_along_axis(cs, order, 1)
        self.q_rows = self._insert(c, cs, self.s_qq, k1 + 1)
        self.offline = offline
        # set by `refresh`: which gallery nodes' R*(x, k1) differ from the offline sets (B × n), and
        # the sets it computed (codes sorted; CSR members and similarities)
        self.refreshed: np.ndarray | None = None
        self.known: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        if offline is not None:
            assert reverse is not None  # built with the offline lists (rerank_kreciprocal)
            # changed[k][b, y]: N(y, k+1) over U_b differs from the gallery's; touched[k]: the
            # nodes whose R(·, k) that can change: y, the entry the probe pushes out of it, and
            # where the probe's own row leaves it, the entry that comes in
            self.changed, self.touched = {}, {}
            # one pass over S: lists are nested (N(y, ½k1 + 1) ⊂ N(y, k1 + 1)), so the probe
            # entering a shorter list enters the longer one
            bb, yy = np.divmod(np.flatnonzero(S >= self.sims[:, k1][None, :]), self.n)  # not below the (k1+1)-th
            for k in (k1, self.h):
                if k != k1:
                    keep = S[bb, yy] >= self.sims[yy, k]
                    bb, yy = bb[keep], yy[keep]
                ptr, src = reverse[k]  # lists holding the probe's own row among their first k + 1
                mine = [src[ptr[own[b]]: ptr[own[b] + 1]] for b in np.flatnonzero(has)]
                ob = np.concatenate([np.zeros(0, dtype=np.int64),
                                     *(np.full(len(m), b) for m, b in zip(mine, np.flatnonzero(has), strict=True))])
                oy = np.concatenate([np.zeros(0, dtype=np.int64), *mine])
                ch = np.zeros(S.shape, dtype=bool)
                ch[bb, yy] = True
                ch[ob, oy] = True
                t = ch.copy()
                t[bb, self.rows[yy, k]] = True      # the entry the probe pushes out
                t[ob, self.rows[oy, k + 1]] = True  # the entry that comes in where the own row leaves
                self.changed[k], self.touched[k] = ch, t

    def probe(self) -> np.ndarray:
        return np.arange(self.B) * self.N1 + self.n

    def _insert(self, r: np.ndarray, s: np.ndarray, sv: np.ndarray, L: int) -> np.ndarray:
        """Lists r (best first, similarities s; −1 padded) with the probe put in at similarity sv
        (after equal scores), cut to L: rows of gallery rows, n for the probe, −1 none."""
        if r.shape[1] < L:
            r = np.pad(r, ((0, 0), (0, L - r.shape[1])), constant_values=-1)
            s = np.pad(s, ((0, 0), (0, L - s.shape[1])), constant_values=-np.inf)
        r, s = r[:, :L], s[:, :L]
        pos = ((s > sv[:, None]) & (r >= 0)).sum(1)[:, None]
        j = np.arange(L)[None, :]
        prev = np.concatenate([r[:, :1], r[:, :-1]], 1)
        return np.where(j < pos, r, np.where(j == pos, self.n, prev))

    def lists(self, e: np.ndarray, L: int) -> np.ndarray:
        """N(x, L) over each node's universe (L ≤ k1 + 1), encoded (−1: none)."""
        b, x = np.divmod(e, self.N1)
        out = np.full((len(e), L), -1, dtype=np.int64)
        isq = x == self.n
        out[isq] = self.q_rows[b[isq], :L]
        g = np.flatnonzero(~isq)
        if self.offline is not None and len(g):  # an unchanged list is the gallery's
            same = ~self.changed[self.k1][b[g], x[g]]
            out[g[same]] = self.rows[x[g[same]], :L]
            g = g[~same]
        if len(g):
            bg, xg = b[g], x[g]
            r = self.rows[xg, : L + 1].astype(np.int64)
            s = self.sims[xg, : L + 1]
            if r.shape[1] < L + 1:  # lists as long as the gallery (k1 ≥ n − 1): padded
                r = np.pad(r, ((0, 0), (0, L + 1 - r.shape[1])), constant_values=-1)
                s = np.pad(s, ((0, 0), (0, L + 1 - s.shape[1])), constant_values=-np.inf)
            own = self.own[bg]
            drop = (r == own[:, None]).any(1)
            if drop.any():  # only the lists that hold the probe's own row are compacted
                r2, s2 = without(r[drop], s[drop], own[drop], L + 1)
                r, s = r.copy(), s.copy()
                r[drop], s[drop] = r2, s2
                r[drop, L], s[drop, L] = -1, -np.inf
            out[g] = self._insert(r, s, self.S[bg, xg], L)
        return np.where(out >= 0, b[:, None] * self.N1 + out, -1)

    def reciprocal(self, e: np.ndarray, k: int) -> np.ndarray:
        """R(x, k) per node (Eq. 3), as N(x, k+1) with non-members set to −1: from the offline
        gallery-only sets where no list it reads has changed, computed otherwise."""
        out = np.full((len(e), k + 1), -1, dtype=np.int64)
        fresh = np.ones(len(e), dtype=bool)
        if self.offline is not None:
            b, x = np.divmod(e, self.N1)
            g = np.flatnonzero(x < self.n)
            keep = g[~self.touched[k][b[g], x[g]]]
            r = self.offline["r1" if k == self.k1 else "rh"][x[keep]].astype(np.int64)
            out[keep] = np.where(r >= 0, b[keep][:, None] * self.N1 + r, -1)
            fresh[keep] = False
        f = np.flatnonzero(fresh)
        if len(f):
            F = self.lists(e[f], k + 1)
            valid = F >= 0
            u, inv = np.unique(F[valid], return_inverse=True)
            back = np.zeros(F.shape, dtype=bool)
            back[valid] = (self.lists(u, k + 1)[inv] == np.broadcast_to(e[f][:, None], F.shape)[valid][:, None]).any(1)
            out[f] = np.where(back, F, -1)
        return out

    def expanded(self, e: np.ndarray, k1: int) -> tuple[np.ndarray, np.ndarray]:
        """R*(x, k1) per node (Eq. 6) as pairs (node index, member), sorted, unique."""
        R = self.reciprocal(e, k1)
        mem = R >= 0
        ri, rv = np.flatnonzero(mem) // mem.shape[1], R[mem]
        u, inv = np.unique(rv, return_inverse=True)
        Rh = self.reciprocal(u, half(k1))[inv]  # R(c, ½k1) for each member c
        size = (Rh >= 0).sum(1)
        keys = np.sort(ri * self.M + rv)
        look = np.where(Rh >= 0, ri[:, None] * self.M + Rh, -1)
        at = np.minimum(np.searchsorted(keys, look), len(keys) - 1)
        inter = ((keys[at] == look) & (Rh >= 0)).sum(1)
        ok = inter > 2.0 / 3.0 * size
        add = ok[:, None] & (Rh >= 0)
        ai = np.broadcast_to(ri[:, None], Rh.shape)[add]
        both = unique(np.concatenate([ri * self.M + rv, ai * self.M + Rh[add]]))
        return np.divmod(both, self.M)

    def similarity(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """s(x, y) for pairs of encoded nodes of the same universe."""
        b, xl = np.divmod(x, self.N1)
        yl = y % self.N1
        out = np.empty(len(x), dtype=np.float64)
        qx, qy = xl == self.n, yl == self.n
        out[qx & qy] = self.s_qq[b[qx & qy]]
        m = qx & ~qy
        out[m] = self.S[b[m], yl[m]]
        m = qy & ~qx
        out[m] = self.S[b[m], xl[m]]
        g = np.flatnonzero(~qx & ~qy)
        if len(g):
            # most pairs are in x's cached list already; the rest are computed
            lr, ls = self.rows[xl[g]], self.sims[xl[g]]
            hit = lr == yl[g][:, None]
            found = hit.any(1)
            out[g[found]] = ls[found][hit[found]]
            miss = g[~found]
            if len(miss):
                pairs = gallery_similarities(self.space)
                if pairs is not None:
                    out[miss] = pairs[xl[miss], yl[miss]]
                else:
                    ux, ix = np.unique(xl[miss], return_inverse=True)
                    T = self.space.transform(self.space.gallery_vectors(ux))
                    out[miss] = np.einsum("md,md->m", T[ix], self.space.gallery_vectors(yl[miss]))
        return out

    def self_similarity(self, e: np.ndarray) -> np.ndarray:
        b, x = np.divmod(e, self.N1)
        return np.where(x == self.n, self.s_qq[b], self.ext["self"][np.minimum(x, self.n - 1)]).astype(np.float64)

    def row_max(self, e: np.ndarray) -> np.ndarray:
        """max_y d(x, y) over the node's universe: s(x, x) − min_y s(x, y)."""
        b, x = np.divmod(e, self.N1)
        g = np.minimum(x, self.n - 1)
        m = np.where(self.ext["arg1"][g] == self.own[b], self.ext["min2"][g], self.ext["min1"][g])
        m = np.minimum(m, self.S[b, g])  # the probe's column
        m = np.where(x == self.n, self.q_min[b], m)
        d = self.self_similarity(e) - m
        return np.where(d > 0, d, 1.0)  # a row without a positive distance: left unscaled

    def members(self, e: np.ndarray, k1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """R*(x, k1) per node as (node index, member, s(x, member)), sorted by node index: the
        offline gallery-only set where R(x, k1) and each of its members' R(·, ½k1) are the
        gallery's, computed otherwise."""
        if self.offline is None:
            ri, y = self.expanded(e, k1)
            return ri, y, self.similarity(e[ri], y)
        b, x = np.divmod(e, self.N1)
        fresh = x == self.n
        g = np.flatnonzero(~fresh)
        if self.known is not None and self.refreshed is not None:  # `refresh` computed these, kept those that changed
            fresh[g] = self.refreshed[b[g], x[g]]
        else:
            r1 = self.offline["r1"][x[g]]
            th = self.touched[self.h]
            fresh[g] = self.touched[k1][b[g], x[g]] | ((r1 >= 0) & th[b[g][:, None], np.maximum(r1, 0)]).any(1)
        idx_f, idx_c = np.flatnonzero(fresh), np.flatnonzero(~fresh)
        if self.known is not None:
            codes, kptr, ky, ks = self.known
            at_k = np.searchsorted(codes, e[idx_f])
            ri_f, at = gather(kptr, at_k)
            ri_f, y_f, s_f = idx_f[ri_f], ky[at], ks[at]
        else:
            ri_f, y_f = self.expanded(e[idx_f], k1)
            ri_f = idx_f[ri_f]
            s_f = self.similarity(e[ri_f], y_f)
        ptr, mem, sims = self.offline["ptr"], self.offline["rows"], self.offline["sims"]
        xc = x[idx_c]
        cnt = ptr[xc + 1] - ptr[xc]
        ri_c = np.repeat(idx_c, cnt)
        at = np.repeat(ptr[xc] - (np.cumsum(cnt) - cnt), cnt) + np.arange(cnt.sum())
        y_c = b[ri_c] * self.N1 + mem[at]
        ri = np.concatenate([ri_f, ri_c])
        order = np.argsort(ri, kind="stable")
        return ri[order], np.concatenate([y_f, y_c])[order], np.concatenate([s_f, sims[at]])[order]

    def V(self, e: np.ndarray, k1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Eq. 7's V_x for each node, sparse: (node index, member, weight), by node."""
        ri, y, s = self.members(e, k1)
        w = np.exp(-(self.self_similarity(e)[ri] - s) / self.row_max(e)[ri])
        total = np.bincount(ri, weights=w, minlength=len(e))
        return ri, y, w / np.maximum(total[ri], 1e-300)  # an empty R*(x) (bilinear oddities): V_x = 0


def distances(batch: _Batch, pools: np.ndarray, p: KReciprocalParams) -> np.ndarray:
    """d*(p, g) (Eq. 12) for each probe and each row g of its pool (B × pool, inf where −1)."""
    return combined(pools, *terms(batch, pools, p), p.lambda_value)


def combined(pools: np.ndarray, d_j: np.ndarray, d_orig: np.ndarray, lam: float) -> np.ndarray:
    """d* = (1 − λ) d_J + λ d (Eq. 12), inf where the pool has no row."""
    return np.where(pools >= 0, (1.0 - lam) * d_j + lam * d_orig, np.inf)


def terms(batch: _Batch, pools: np.ndarray, p: KReciprocalParams) -> tuple[np.ndarray, np.ndarray]:
    """d_J(p, g) and the row-normalised d(p, g) for each probe and each row g of its pool (B × pool)."""
    B, width = pools.shape
    probes = batch.probe()
    Y = np.concatenate([probes[:, None], np.where(pools >= 0, probes[:, None] - batch.n + pools, -1)], 1)
    Lk2 = np.full((Y.size, p.k2), -1, dtype=np.int64)        # N(y, k2) for the probe and its pool
    valid = Y.ravel() >= 0
    # k2 = 1 is no expansion in the code (V_y itself), not V of y's nearest, which need not be y
    Lk2[valid] = batch.lists(Y.ravel()[valid], p.k2) if p.k2 > 1 else Y.ravel()[valid][:, None]
    X, inv = np.unique(Lk2[Lk2 >= 0], return_inverse=True)
    ri, col, w = batch.V(X, p.k1)                              # V_z for every z there
    # V_qe(y) = mean of V_z over z ∈ N(y, k2) (§4.4).  The probe's first, as a dense table over
    # the codes (a column is b·(n + 1) + x: one table serves the whole batch)
    n_y = (Lk2 >= 0).sum(1)
    start = np.searchsorted(ri, np.arange(len(X)))
    cnt = np.bincount(ri, minlength=len(X))
    idx = np.full(Lk2.shape, -1)
    idx[Lk2 >= 0] = inv
    p_rows = idx.reshape(B, width + 1, p.k2)[:, 0]              # the probe's N(p, k2), as indices of X
    pz = p_rows[p_rows >= 0]
    pb = np.flatnonzero(p_rows >= 0) // p_rows.shape[1]
    reps = cnt[pz]
    at = np.repeat(start[pz] - (np.cumsum(reps) - reps), reps) + np.arange(reps.sum())
    vp = np.bincount(col[at], weights=w[at] / n_y[np.repeat(pb * (width + 1), reps)], minlength=batch.M)
    # the pool's: only entries in the probe's support count (min(·) is 0 elsewhere), summed per (y, column)
    keep = vp[col] > 0
    yi = np.flatnonzero(Lk2 >= 0) // p.k2                       # row-major: the order of `inv`
    yi, zi = yi[~(yi % (width + 1) == 0)], inv[~(yi % (width + 1) == 0)]
    kc = np.cumsum(keep)
    k_start = np.concatenate([[0], kc])[start]                  # kept entries of each node, contiguous
    k_cnt = np.bincount(ri[keep], minlength=len(X))
    kept = np.flatnonzero(keep)
    reps = k_cnt[zi]
    at = kept[np.repeat(k_start[zi] - (np.cumsum(reps) - reps), reps) + np.arange(reps.sum())]
    t_y = np.repeat(yi, reps)
    key = t_y * batch.M + col[at]
    uk, kinv = np.unique(key, return_inverse=True)
    val = np.bincount(kinv, weights=w[at] / n_y[t_y])
    ky, kcol = np.divmod(uk, batch.M)
    tmin = np.bincount(ky, weights=np.minimum(val, vp[kcol]), minlength=Y.size).reshape(B, width + 1)[:, 1:]
    d_j = 1.0 - tmin / (2.0 - tmin)                            # Σ max = Σ V_p + Σ V_g − Σ min = 2 − Σ min
    s_pg = np.take_along_axis(batch.S, np.maximum(pools, 0), 1)
    d_orig = (batch.s_qq[:, None] - s_pg) / batch.row_max(probes)[:, None]
    return d_j, d_orig


def gallery_sets(space: MetricSpace, lists: tuple[np.ndarray, np.ndarray], ext: dict[str, np.ndarray],
                 k1: int) -> dict[str, np.ndarray]:
    """Offline: over the gallery alone, every item's R(x, k1) and R(x, ½k1) (its list entries,
    −1 where not reciprocal: "r1", "rh") and R*(x, k1) with s(x, ·) of its members (CSR:
    rows[ptr[x]:ptr[x+1]], sims alike)."""
    def compute():
        none = _Batch(space, lists, ext, np.full((1, space.n), -np.inf, dtype=np.float32), np.zeros(1),
                      np.full(1, -1), np.zeros((1, 0), dtype=np.int64), k1)  # a probe that enters no list
        n, h = space.n, half(k1)
        out = {"r1": np.empty((n, k1 + 1), np.int32), "rh": np.empty((n, h + 1), np.int32)}
        ptr, parts_r, parts_s = np.zeros(n + 1, dtype=np.int64), [], []
        step = max(1, min(4096, SET_CELLS // (k1 + 2) ** 2))  # a block's reverse checks: step × (k1 + 1)² entries
        for a in range(0, n, step):
            e = np.arange(a, min(a + step, n))
            out["r1"][e], out["rh"][e] = none.reciprocal(e, k1), none.reciprocal(e, h)
            ri, y = none.expanded(e, k1)
            parts_r.append(y.astype(np.int32))
            parts_s.append(none.similarity(e[ri], y).astype(np.float32))
            ptr[e + 1] = np.bincount(ri, minlength=len(e))
        return out | {"ptr": np.cumsum(ptr), "rows": np.concatenate(parts_r), "sims": np.concatenate(parts_s)}
    return space.store.get("kreciprocal-sets", {"k1": k1}, compute)


def reverse_lists(space: MetricSpace, rows: np.ndarray, k1: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """For k = k1 and ½k1: (ptr, src) with src[ptr[i]:ptr[i+1]] the items whose first k + 1 list
    entries hold i (the lists a leave-one-out query's own row changes); kept in memory."""
    return {k: reverse_index(space, rows, k + 1, f"kreciprocal-reverse-{k + 1}") for k in (k1, half(k1))}


def gather(ptr: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR look-up of many keys at once: (i, at) for every position `at` in ptr[keys[i]]:ptr[keys[i] + 1]."""
    cnt = ptr[keys + 1] - ptr[keys]
    i = np.repeat(np.arange(len(keys)), cnt)
    return i, np.repeat(ptr[keys] - (np.cumsum(cnt) - cnt), cnt) + np.arange(int(cnt.sum()))


def probe_vector(batch: _Batch, p: KReciprocalParams) -> np.ndarray:
    """Each probe's query-expanded V_qe(p) (§4.4: the mean of V_z over z ∈ N(p, k2)) as one dense
    table over the batch's codes (M,), summed as `distances` sums it."""
    probes = batch.probe()
    Lp = batch.lists(probes, p.k2) if p.k2 > 1 else probes[:, None]
    X, inv = np.unique(Lp[Lp >= 0], return_inverse=True)
    ri, col, w = batch.V(X, p.k1)
    n_p = (Lp >= 0).sum(1)
    start = np.searchsorted(ri, np.arange(len(X)))
    cnt = np.bincount(ri, minlength=len(X))
    pb = np.flatnonzero(Lp >= 0) // Lp.shape[1]
    reps = cnt[inv]
    at = np.repeat(start[inv] - (np.cumsum(reps) - reps), reps) + np.arange(int(reps.sum()))
    return np.bincount(col[at], weights=w[at] / n_p[np.repeat(pb, reps)], minlength=batch.M)


def support_index(space: MetricSpace, rows: np.ndarray, ext: dict, sets: dict, k1: int,
                  k2: int) -> dict[str, np.ndarray]:
    """Offline, over the gallery alone: every item's query-expanded V_qe(g) (the mean of V_z over
    z ∈ N(g, k2); V_z of Eq. 7 on R*(z, k1)), stored as the official code's inverted index: for
    each item j, the items g with V_qe(g)[j] > 0 ("items"[ptr[j]:ptr[j+1]]) and that value
    ("values").  Summed as `distances` sums it, so a probe reads the same numbers."""
    def compute():
        n = space.n
        cnt = np.diff(sets["ptr"])
        owner = np.repeat(np.arange(n), cnt)
        self_s = ext["self"].astype(np.float64)
        rm = self_s - ext["min1"]  # the row maximum of d, as _Batch.row_max reads it
        rm = np.where(rm > 0, rm, 1.0)
        w = np.exp(-(self_s[owner] - sets["sims"].astype(np.float64)) / rm[owner])
        total = np.bincount(owner, weights=w, minlength=n)
        V = w / np.maximum(total[owner], 1e-300)
        keys, vals = [], []
        for a in range(0, n, 2048):
            g = np.arange(a, min(a + 2048, n))
            z = rows[g, :k2].astype(np.int64) if k2 > 1 else g[:, None]  # k2 = 1: V_g itself
            n_y = (z >= 0).sum(1)
            flat = np.flatnonzero(z >= 0)
            gi, at = gather(sets["ptr"], z.ravel()[flat])
            gi = flat[gi] // z.shape[1]
            uk, kinv = np.unique(sets["rows"][at].astype(np.int64) * n + g[gi], return_inverse=True)
            keys.append(uk)
            vals.append(np.bincount(kinv, weights=V[at] / n_y[gi]))
        key, val = np.concatenate(keys), np.concatenate(vals)
        order = np.argsort(key, kind="stable")
        j, g = np.divmod(key[order], n)  # by column j, then item g
        ptr = np.zeros(n + 1, dtype=np.int64)
        np.add.at(ptr, j + 1, 1)
        return {"ptr": np.cumsum(ptr), "items": g.astype(np.int32), "values": val[order]}
    return space.store.get("kreciprocal-support", {"k1": k1, "k2": k2}, compute)


def refresh(batch: _Batch, p: KReciprocalParams, rev_k2) -> np.ndarray:
    """B × n: the gallery rows g whose V_qe(g) in the probe's universe may differ from the
    gallery's: g's list N(g, k2) changed, or it holds a node z whose V_z changed.  V_z changes
    where R*(z, k1) does or z's row maximum moves (the probe below z's smallest similarity, or
    the own row was it).  R*(z) can change only where R(z, k1) changed or R(c, ½k1) did for a
    member c (by the symmetry of R, z ∈ R(c, k1) of the gallery then, R(z, k1) being unchanged);
    R(·, k) can change only at the nodes touched at k, so those are compared with the offline
    sets first.  The R* of those z, and the probes', are computed here once, compared with the
    offline sets, and kept for `members` (`batch.refreshed`, `batch.known`)."""
    ext, offline = batch.ext, batch.offline
    assert offline is not None  # built with the offline sets (kreciprocal)
    n, N1 = batch.n, batch.N1
    maybe = np.zeros_like(batch.touched[p.k1])
    for k in dict.fromkeys((p.k1, batch.h)):
        # R(c, k) where it can have changed (c touched at k), compared with the offline set
        tb, tc = np.nonzero(batch.touched[k])
        R = np.sort(batch.reciprocal(tb * N1 + tc, k), axis=1)
        off = offline["r1" if k == p.k1 else "rh"][tc]
        off = np.sort(np.where(off >= 0, tb[:, None] * N1 + off, -1), axis=1)
        moved = (R != off).any(1)
        tb, tc = tb[moved], tc[moved]
        if k == p.k1:
            maybe[tb, tc] = True
        if k == batch.h:  # R*(x) reads R(c, ½k1) for c ∈ R(x, k1): by the symmetry of R, x ∈ R(c, k1)
            r1 = offline["r1"][tc]
            ok = r1 >= 0
            maybe[np.broadcast_to(tb[:, None], r1.shape)[ok], r1[ok]] = True
    mb, mx = np.nonzero(maybe)
    codes = np.concatenate([mb * N1 + mx, batch.probe()])
    codes.sort()
    ri, y = batch.expanded(codes, p.k1)
    sims = batch.similarity(codes[ri], y)
    cnt = np.bincount(ri, minlength=len(codes))
    kptr = np.concatenate([[0], np.cumsum(cnt)])
    batch.known = (codes, kptr, y, sims)
    # the same set as offline: as many members, each the same (both sorted)
    cb, cx = np.divmod(codes, N1)
    gal = cx < n
    optr = offline["ptr"]
    same = np.zeros(len(codes), dtype=bool)
    same[gal] = cnt[gal] == optr[cx[gal] + 1] - optr[cx[gal]]
    i, at = gather(optr, cx[same])
    node = np.flatnonzero(same)[i]
    differ = np.bincount(node, weights=y[kptr[node] + (at - optr[cx[node]])] != cb[node] * N1 + offline["rows"][at],
                         minlength=len(codes)) > 0
    same &= ~differ
    batch.refreshed = np.zeros_like(maybe)
    batch.refreshed[cb[gal & ~same], cx[gal & ~same]] = True
    vz = batch.refreshed | (batch.S < ext["min1"][None, :]) | (ext["arg1"][None, :] == batch.own[:, None])
    if p.k2 == 1:  # V_qe(g) = V_g
        return vz
    out = batch.changed[p.k1].copy()  # N(g, k2) ⊂ N(g, k1 + 1)
    zb, zx = np.nonzero(vz)
    ptr, src = rev_k2
    i, at = gather(ptr, zx)
    out[zb[i], src[at]] = True
    return out


def whole_gallery(batch: _Batch, p: KReciprocalParams, support: dict, rev_k2, k: int,
                  pool: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per probe, the rows that can reach its top k by d* over the whole gallery (the official
    code's ranking), or over the plain search's top `pool` candidates, in the plain order
    (−1 padded), with their d_J and d (`terms`).

    d_J(p, g) < 1 only where V_qe(p) and V_qe(g) share a nonzero entry.  Where V_qe(g) is the
    gallery's (`refresh` says where it may not be), the offline inverted index gives
    Σ_j min(V_p[j], V_g[j]) directly, as the official code computes it; the rows whose vector
    may have changed go through `terms`; every other row has d_J = 1 and d* = (1 − λ) +
    λ d(p, g), so the first k of them in the plain order are all that can reach the top k."""
    B, n, N1 = batch.B, batch.n, batch.N1
    S, own = batch.S, batch.own
    fresh = refresh(batch, p, rev_k2)
    vp = probe_vector(batch, p)
    fresh[np.flatnonzero(own >= 0), own[own >= 0]] = False
    inpool = None
    if pool is not None:  # only the plain search's top `pool` are ranked
        top = top_rows(S, own, pool)
        inpool = np.zeros_like(fresh)
        ok = top >= 0
        inpool[np.broadcast_to(np.arange(B)[:, None], top.shape)[ok], top[ok]] = True
        fresh &= inpool
    # unchanged vectors that meet the probe's support: Σ_j min(V_p[j], V_g[j]) over the index
    codes = np.flatnonzero(vp > 0)
    pb, pj = np.divmod(codes, N1)
    keep = pj < n  # the probe's own column: no unchanged vector holds it
    i, at = gather(support["ptr"], pj[keep])
    b, g = pb[keep][i], support["items"][at].astype(np.int64)
    mins = np.minimum(support["values"][at], vp[codes[keep][i]])
    ok = ~fresh[b, g] & (g != own[b]) & (True if inpool is None else inpool[b, g])
    key = b[ok] * n + g[ok]
    order = np.argsort(key, kind="stable")  # per (probe, g): columns in ascending order, as `distances` sums
    uk, kinv = np.unique(key[order], return_inverse=True)
    tmin = np.bincount(kinv, weights=mins[ok][order])
    ob, og = np.divmod(uk, n)
    # the changed ones, by `terms` (each probe's in the plain order: top_rows's)
    fb, fg = np.nonzero(fresh)
    per = np.bincount(fb, minlength=B)
    pools = np.full((B, max(int(per.max(initial=0)), 1)), -1, dtype=np.int64)
    o = np.lexsort((fg, -S[fb, fg], fb))
    fb, fg = fb[o], fg[o]
    pools[fb, np.arange(len(fb)) - np.repeat(np.cumsum(per) - per, per)] = fg
    dj_fresh, do_fresh = terms(batch, pools, p)
    # the rest: the first k in the plain order outside both (and inside the pool)
    allowed = ~fresh if inpool is None else inpool & ~fresh
    allowed[ob, og] = False
    top = top_rows(np.where(allowed, S, -np.inf), own, min(k, n))
    rm = batch.row_max(batch.probe())
    o_start = np.searchsorted(ob, np.arange(B + 1))
    parts = []
    for j in range(B):
        og_j, t_j = og[o_start[j]: o_start[j + 1]], tmin[o_start[j]: o_start[j + 1]]
        f_j = pools[j][pools[j] >= 0]
        t = top[j][top[j] >= 0]
        rest = t[allowed[j, t]]
        rows = np.concatenate([og_j, rest])
        tm = np.concatenate([t_j, np.zeros(len(rest))])
        rows = np.concatenate([f_j, rows])
        d_j = np.concatenate([dj_fresh[j, : len(f_j)], 1.0 - tm / (2.0 - tm)])
        d_o = np.concatenate([do_fresh[j, : len(f_j)], (batch.s_qq[j] - S[j, rows[len(f_j):]]) / rm[j]])
        o = np.lexsort((rows, -S[j, rows]))  # the plain order (ranked stably by d* after)
        parts.append((rows[o], d_j[o], d_o[o]))
    width = max(len(r) for r, _, _ in parts)
    out = np.full((B, width), -1, dtype=np.int64), np.ones((B, width)), np.zeros((B, width))  # pads: finite
    for j, part in enumerate(parts):
        for a, v in zip(out, part, strict=True):
            a[j, : len(v)] = v
    return out


@RERANKERS.register("kreciprocal", KReciprocalParams, offline=True, reads_first=False, pool="pool",
                    grid={"k1": (4, 6, 10, 20, 30), "k2": (1, 3, 6), "lambda_value": (0.1, 0.3, 0.5)})
def kreciprocal(space: MetricSpace, queries: np.ndarray, first: Hits | None, k: int, *, self_ids: np.ndarray,
                params: KReciprocalParams) -> Hits:
    """k-reciprocal encoding (Zhong et al. CVPR 2017): Jaccard distance of k-reciprocal sets, d* = (1 − λ) d_J + λ d."""
    p = params
    lists = neighbour_lists(space, min(p.k1 + 2, space.n))  # + 1: the item itself, + 1: a leave-one-out row
    ext = row_extremes(space)
    # a gallery too small for lists of k1 + 2 is small enough to compute every set
    offline = gallery_sets(space, lists, ext, p.k1) if lists[0].shape[1] >= p.k1 + 2 else None
    reverse = reverse_lists(space, lists[0], p.k1) if offline is not None else None
    # every candidate by default (the official code): d* is computed only where it can move; a
    # pool up to BRUTE_POOL is cheaper to rank whole
    pool = max(p.pool, k)
    support = support_index(space, lists[0], ext, offline, p.k1, p.k2) if offline and pool > BRUTE_POOL else None
    rev_k2 = (reverse_index(space, lists[0], p.k2, f"kreciprocal-reverse-{p.k2}")
              if support is not None and p.k2 > 1 else None)
    # the probe's own list N(p, k1 + 1) is read from its candidates
    depth = min(p.k1 + 1 if support is not None else max(pool, p.k1 + 1), space.n)
    step = max(1, min(BATCH, BATCH_CELLS // max(space.n, 1)))
    starts = range(0, len(queries), step)
    out_r = np.full((len(queries), k), -1, dtype=np.int64)
    out_s = np.full((len(queries), k), -np.inf, dtype=np.float32)

    def rank(a: int, pools: np.ndarray, d_j: np.ndarray, d_orig: np.ndarray) -> None:
        d = combined(pools, d_j, d_orig, p.lambda_value)
        order = np.argsort(d, axis=1, kind="stable")[:, :k]
        r, dd = np.take_along_axis(pools, order, 1), np.take_along_axis(d, order, 1)
        out_r[a: a + len(r), : r.shape[1]] = np.where(np.isfinite(dd), r, -1)
        out_s[a: a + len(r), : r.shape[1]] = np.where(np.isfinite(dd), 1.0 - dd, -np.inf)  # higher is closer

    # d_J and d do not depend on λ: a call that differs from a recent one in λ alone (a sweep over
    # λ, batch after batch) ranks the terms kept from it (the latest calls' up to TERMS_BYTES)
    key = (p.k1, p.k2, pool, k, _digest(queries), _digest(self_ids))
    with _TERMS_LOCK:  # a server's concurrent requests share the space
        recent = space.store.memo.setdefault("kreciprocal-terms", OrderedDict())
        hit = recent.get(key)
        if hit is not None:
            recent.move_to_end(key)
    if hit is not None:
        for a, t in hit[0].items():
            rank(a, *t)
        return space.hits(out_r, out_s)
    kept: dict[int, tuple] = {}
    size = [0]
    gallery_similarities(space)  # built once, before the batches share it

    def one(a: int) -> None:
        q, own = queries[a: a + step], self_ids[a: a + step]
        S = space.score(q)  # each probe's row: its place in every list, its largest distance, its candidates
        cand = top_rows(S, own, depth)
        s_qq = np.einsum("qd,qd->q", space.transform(q), space.key(q))
        batch = _Batch(space, lists, ext, S, s_qq, own, cand, p.k1, offline, reverse)
        if support is not None:
            t = whole_gallery(batch, p, support, rev_k2, k, pool if pool < space.n else None)
        else:
            pools = cand[:, :pool]
            t = (pools, *terms(batch, pools, p))
        rank(a, *t)
        size[0] += sum(x.nbytes for x in t)
        if size[0] <= TERMS_BYTES:
            kept[a] = t

    _run(one, starts)
    if size[0] <= TERMS_BYTES:
        with _TERMS_LOCK:
            recent[key] = (kept, size[0])
            while sum(v[1] for v in recent.values()) > TERMS_BYTES:
                recent.popitem(last=False)
    return space.hits(out_r, out_s)


def _digest(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a)
    return hashlib.blake2b(a.data.cast("B"), digest_size=16).hexdigest() + str((a.dtype.str, a.shape))


def _run(one, starts: range) -> None:
    """one(a) for every batch start: in threads where FAISS has several."""
    workers = min(len(starts), max(1, faiss.omp_get_max_threads()))
    if workers > 1:
        # the batches are independent and numpy's sorts and set operations release the GIL: one
        # batch per core, each with BLAS on one thread (threaded BLAS under threads oversubscribes)
        from threadpoolctl import threadpool_limits

        with threadpool_limits(1, user_api="blas"), ThreadPoolExecutor(workers) as ex:
            list(ex.map(one, starts))
    else:
        for a in starts:
            one(a)
