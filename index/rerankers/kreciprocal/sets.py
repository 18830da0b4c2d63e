"""The k-reciprocal sets of Zhong et al. (CVPR 2017) for a batch of probes at once: each
probe's universe U = (gallery − its own row) ∪ {p}, the neighbour lists N(x, k) over it,
R(x, k) (Eq. 3), R*(x, k1) (Eq. 6) and the vectors V_x (Eq. 7), read from the gallery's
offline sets wherever the probe changes nothing they depend on (docs/reranking.md)."""
from __future__ import annotations

import numpy as np

from core.memory import check_fits

from ...space import MetricSpace
from ...threads import in_threads
from ..neighbours import Lists, extremes_digest, reverse_index, without
from .cache import gallery_similarities
from .paper import half
from .scan import Pairs, ProbeScan, find

SET_CELLS = 1 << 23  # the offline sets' reverse checks per block (64 MB of int64)


def unique(a: np.ndarray) -> np.ndarray:
    """np.unique by sorting (numpy's hash-based unique is several times slower on these codes)."""
    a = np.sort(a, kind="stable")
    return a[np.concatenate([[True], a[1:] != a[:-1]])] if len(a) else a


def unique_inverse(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(a, return_inverse=True) by a stable sort: the codes here come in sorted runs
    (by node, then member), which it merges in near-linear time."""
    order = np.argsort(a, kind="stable")
    s = a[order]
    first = np.ones(len(s), dtype=bool)
    first[1:] = s[1:] != s[:-1]
    inv = np.empty(len(a), dtype=np.int64)
    inv[order] = np.cumsum(first) - 1
    return s[first], inv


def lookup(keys: np.ndarray, values: np.ndarray, at: np.ndarray) -> np.ndarray:
    """A sparse vector (sorted unique keys, values) read at `at` (0 where it has no entry)."""
    pos, found = find(keys, at)
    return np.where(found, values[pos], 0.0) if len(keys) else np.zeros(np.shape(at))


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



def gather(ptr: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR look-up of many keys at once: (i, at) for every position `at` in ptr[keys[i]]:ptr[keys[i] + 1]."""
    cnt = ptr[keys + 1] - ptr[keys]
    i = np.repeat(np.arange(len(keys)), cnt)
    return i, np.repeat(ptr[keys] - (np.cumsum(cnt) - cnt), cnt) + np.arange(int(cnt.sum()))


class ProbeBatch:
    """A batch of probes, each in its own universe U_b = (gallery − its own row) ∪ {probe b}.
    A node is encoded b·(n + 1) + x, x a gallery row or n for the probe itself, so that every
    step runs over all probes at once.  Lists are the cached gallery lists with the probe's own
    row taken out and the probe put in its place.  `offline`: the gallery-only sets
    (`gallery_sets`); without them (building them, or a gallery too small for them) every set
    is computed."""

    def __init__(self, space: MetricSpace, lists: Lists, extremes: dict[str, np.ndarray],
                 scan: ProbeScan, s_qq: np.ndarray, own: np.ndarray, k1: int, offline: dict | None = None,
                 reverse: dict | None = None):
        self.space, self.n = space, space.n
        self.stride = space.n + 1
        self.rows, self.sims = lists.rows, lists.sims
        self.extremes, self.scan, self.s_qq, self.own = extremes, scan, s_qq.astype(np.float64), own
        self.k1, self.k_half = k1, half(k1)
        self.B = scan.B
        self.n_codes = self.B * self.stride  # one past the largest code
        self.q_min = np.minimum(scan.q_min.astype(np.float64), self.s_qq)  # the own row is not in its universe
        # the probes' own lists: their best rows by s(p, ·), each probe in its place
        self.q_rows = self._insert(scan.top, scan.top_s, self.s_qq, k1 + 1)
        self.offline = offline
        # set by `refresh`: which gallery nodes' R*(x, k1) differ from the offline sets, and the
        # sets it computed (codes sorted; CSR members and similarities)
        self.refreshed: Pairs | None = None
        self.computed_sets: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
        if offline is not None:
            assert reverse is not None and scan.entered is not None  # built with the offline lists (`kreciprocal`)
            # changed[k]: the (probe, y) whose N(y, k+1) over U_b differs from the gallery's;
            # affected[k]: the nodes whose R(·, k) that can change: y, the entry the probe pushes
            # out of it, and where the probe's own row leaves it, the entry that comes in
            self.changed: dict[int, Pairs] = {}
            self.affected: dict[int, Pairs] = {}
            # lists are nested (N(y, ½k1 + 1) ⊂ N(y, k1 + 1)), so the probe entering a shorter
            # list enters the longer one: the scan's pairs at k1 hold those at ½k1
            bb, yy, ss = scan.entered
            has = np.flatnonzero(own >= 0)
            for k in (k1, self.k_half):
                if k != k1:
                    keep = ss >= self.sims[yy, k]
                    bb, yy, ss = bb[keep], yy[keep], ss[keep]
                ptr, src = reverse[k]  # lists holding the probe's own row among their first k + 1
                cnt = ptr[own[has] + 1] - ptr[own[has]]
                ob = np.repeat(has, cnt)
                oy = src[np.repeat(ptr[own[has]] - (np.cumsum(cnt) - cnt), cnt) + np.arange(int(cnt.sum()))]
                ch = Pairs.of(np.concatenate([bb, ob]), np.concatenate([yy, oy]), self.n)
                self.changed[k] = ch
                self.affected[k] = ch | Pairs.of(np.concatenate([bb, ob]),
                                                np.concatenate([self.rows[yy, k], self.rows[oy, k + 1]]), self.n)

    def probe(self) -> np.ndarray:
        return np.arange(self.B) * self.stride + self.n

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
        b, x = np.divmod(e, self.stride)
        out = np.full((len(e), L), -1, dtype=np.int64)
        isq = x == self.n
        out[isq] = self.q_rows[b[isq], :L]
        g = np.flatnonzero(~isq)
        if self.offline is not None and len(g):  # an unchanged list is the gallery's
            same = ~self.changed[self.k1].has(b[g], x[g])
            out[g[same]] = self.rows[x[g[same]], :L]
            g = g[~same]
        if len(g) and self.scan.t is None and self.rows.shape[1] > L:  # the gallery alone: its lists
            out[g] = self.rows[x[g], :L]
            g = g[:0]
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
            out[g] = self._insert(r, s, self.scan.at(bg, xg), L)
        return np.where(out >= 0, b[:, None] * self.stride + out, -1)

    def reciprocal(self, e: np.ndarray, k: int) -> np.ndarray:
        """R(x, k) per node (Eq. 3), as N(x, k+1) with non-members set to −1: from the offline
        gallery-only sets where no list it reads has changed, computed otherwise."""
        out = np.full((len(e), k + 1), -1, dtype=np.int64)
        fresh = np.ones(len(e), dtype=bool)
        if self.offline is not None:
            b, x = np.divmod(e, self.stride)
            g = np.flatnonzero(x < self.n)
            keep = g[~self.affected[k].has(b[g], x[g])]
            r = self.offline["r1" if k == self.k1 else "rh"][x[keep]].astype(np.int64)
            out[keep] = np.where(r >= 0, b[keep][:, None] * self.stride + r, -1)
            fresh[keep] = False
        f = np.flatnonzero(fresh)
        if len(f):
            F = self.lists(e[f], k + 1)
            valid = F >= 0
            u, inv = unique_inverse(F[valid])
            back = np.zeros(F.shape, dtype=bool)
            back[valid] = (self.lists(u, k + 1)[inv] == np.broadcast_to(e[f][:, None], F.shape)[valid][:, None]).any(1)
            out[f] = np.where(back, F, -1)
        return out

    def expanded(self, e: np.ndarray, k1: int) -> tuple[np.ndarray, np.ndarray]:
        """R*(x, k1) per node (Eq. 6) as pairs (node index, member), sorted, unique."""
        R = self.reciprocal(e, k1)
        mem = R >= 0
        ri, rv = np.flatnonzero(mem) // mem.shape[1], R[mem]
        u, inv = unique_inverse(rv)
        Rh = self.reciprocal(u, half(k1))[inv]  # R(c, ½k1) for each member c
        size = (Rh >= 0).sum(1)
        keys = np.sort(ri * self.n_codes + rv)
        look = np.where(Rh >= 0, ri[:, None] * self.n_codes + Rh, -1)
        at = np.minimum(np.searchsorted(keys, look), len(keys) - 1)
        inter = ((keys[at] == look) & (Rh >= 0)).sum(1)
        ok = inter > 2.0 / 3.0 * size
        add = ok[:, None] & (Rh >= 0)
        ai = np.broadcast_to(ri[:, None], Rh.shape)[add]
        both = unique(np.concatenate([ri * self.n_codes + rv, ai * self.n_codes + Rh[add]]))
        return np.divmod(both, self.n_codes)

    def similarity(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """s(x, y) for pairs of encoded nodes of the same universe."""
        b, xl = np.divmod(x, self.stride)
        yl = y % self.stride
        out = np.empty(len(x), dtype=np.float64)
        qx, qy = xl == self.n, yl == self.n
        out[qx & qy] = self.s_qq[b[qx & qy]]
        m = qx & ~qy
        out[m] = self.scan.at(b[m], yl[m])
        m = qy & ~qx
        out[m] = self.scan.at(b[m], xl[m])
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
                    ux, ix = unique_inverse(xl[miss])
                    T = self.space.transform(self.space.gallery_vectors(ux))
                    out[miss] = np.einsum("md,md->m", T[ix], self.space.gallery_vectors(yl[miss]))
        return out

    def self_similarity(self, e: np.ndarray) -> np.ndarray:
        b, x = np.divmod(e, self.stride)
        return np.where(x == self.n, self.s_qq[b], self.extremes["self"][np.minimum(x, self.n - 1)]).astype(np.float64)

    def row_max(self, e: np.ndarray) -> np.ndarray:
        """max_y d(x, y) over the node's universe: s(x, x) − min_y s(x, y)."""
        b, x = np.divmod(e, self.stride)
        g = np.minimum(x, self.n - 1)
        m = np.where(self.extremes["arg1"][g] == self.own[b], self.extremes["min2"][g], self.extremes["min1"][g])
        gal = x < self.n
        m[gal] = np.minimum(m[gal], self.scan.at(b[gal], g[gal]))  # the probe's column
        m = np.where(gal, m, self.q_min[b])
        d = self.self_similarity(e) - m
        return np.where(d > 0, d, 1.0)  # a row without a positive distance: left unscaled

    def members(self, e: np.ndarray, k1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """R*(x, k1) per node as (node index, member, s(x, member)), sorted by node index: the
        offline gallery-only set where R(x, k1) and each of its members' R(·, ½k1) are the
        gallery's, computed otherwise."""
        if self.offline is None:
            ri, y = self.expanded(e, k1)
            return ri, y, self.similarity(e[ri], y)
        b, x = np.divmod(e, self.stride)
        fresh = x == self.n
        g = np.flatnonzero(~fresh)
        if self.computed_sets is not None and self.refreshed is not None:  # computed by `refresh`, changed ones kept
            fresh[g] = self.refreshed.has(b[g], x[g])
        else:
            r1 = self.offline["r1"][x[g]]
            th = self.affected[self.k_half]
            fresh[g] = self.affected[k1].has(b[g], x[g]) | ((r1 >= 0) & th.has(b[g][:, None], np.maximum(r1, 0))).any(1)
        idx_f, idx_c = np.flatnonzero(fresh), np.flatnonzero(~fresh)
        if self.computed_sets is not None:
            codes, kptr, ky, ks = self.computed_sets
            at_k = np.searchsorted(codes, e[idx_f])
            ri_f, at = gather(kptr, at_k)
            ri_f, y_f, s_f = idx_f[ri_f], ky[at], ks[at]
        else:
            ri_f, y_f = self.expanded(e[idx_f], k1)
            ri_f = idx_f[ri_f]
            s_f = self.similarity(e[ri_f], y_f)
        ptr, mem, sims = self.offline["ptr"], self.offline["rows"], self.offline["sims"]
        xc = x[idx_c]
        i_c, at = gather(ptr, xc)
        ri_c = idx_c[i_c]
        y_c = b[ri_c] * self.stride + mem[at]
        ri = np.concatenate([ri_f, ri_c])
        order = np.argsort(ri, kind="stable")
        return ri[order], np.concatenate([y_f, y_c])[order], np.concatenate([s_f, sims[at]])[order]

    def V(self, e: np.ndarray, k1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Eq. 7's V_x for each node, sparse: (node index, member, weight), by node."""
        ri, y, s = self.members(e, k1)
        w = np.exp(-(self.self_similarity(e)[ri] - s) / self.row_max(e)[ri])
        total = np.bincount(ri, weights=w, minlength=len(e))
        return ri, y, w / np.maximum(total[ri], 1e-300)  # an empty R*(x) (bilinear oddities): V_x = 0


def sets_digest(space: MetricSpace, lists: Lists, k1: int) -> str:
    """The digest of `gallery_sets(space, lists, ·, k1)`."""
    return space.digest("kreciprocal-sets", {"k1": k1}, (lists.digest, extremes_digest(space)))


def gallery_sets(space: MetricSpace, lists: Lists, extremes: dict[str, np.ndarray],
                 k1: int) -> dict[str, np.ndarray]:
    """Offline: over the gallery alone, every item's R(x, k1) and R(x, ½k1) (its list entries,
    −1 where not reciprocal: "r1", "rh") and R*(x, k1) with s(x, ·) of its members (CSR:
    rows[ptr[x]:ptr[x+1]], sims alike)."""
    # at least R(x, k1) and R(x, ½k1) as lists, and each R*(x, k1) member with its similarity
    size = space.n * (k1 + 1) * 12
    check_fits(f"kreciprocal: the gallery's k-reciprocal sets ({space.n:,} items, k1 = {k1})", size,
               "give kreciprocal a smaller k1")

    def compute():
        # a batch whose probe enters no list: the gallery alone
        none = ProbeBatch(space, lists, extremes, ProbeScan.none(space), np.zeros(1), np.full(1, -1), k1)
        n, h = space.n, half(k1)
        step = max(1, min(4096, SET_CELLS // (k1 + 2) ** 2))  # a block's reverse checks: step × (k1 + 1)² entries

        def block(a: int) -> tuple:
            e = np.arange(a, min(a + step, n))
            ri, y = none.expanded(e, k1)
            return (none.reciprocal(e, k1).astype(np.int32), none.reciprocal(e, h).astype(np.int32),
                    y.astype(np.int32), none.similarity(e[ri], y).astype(np.float32), np.bincount(ri, minlength=len(e)))
        r1, rh, rows, sims, count = zip(*in_threads(block, range(0, n, step)), strict=True)
        return {"r1": np.concatenate(r1), "rh": np.concatenate(rh), "rows": np.concatenate(rows),
                "sims": np.concatenate(sims), "ptr": np.concatenate([[0], np.cumsum(np.concatenate(count))])}
    return space.artefact("kreciprocal-sets", {"k1": k1}, compute, inputs=(lists.digest, extremes_digest(space)),
                          reserve=size)


def reverse_lists(space: MetricSpace, lists: Lists, k1: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """For k = k1 and ½k1: (ptr, src) with src[ptr[i]:ptr[i+1]] the items whose first k + 1 list
    entries hold i (the lists a leave-one-out query's own row changes); kept in memory."""
    return {k: reverse_index(space, lists.rows, k + 1, lists.digest) for k in (k1, half(k1))}

