"""One pass over the gallery for a batch of probes.  Everything k-reciprocal reads of a probe's
full row s(p, ·) is kept while the row goes by a block at a time: its `depth` best rows (the
plain order's head), the rows whose neighbour list it enters, the rows it is the least similar
item of, and its own least similar item.  Any other s(p, g) is computed when asked.  A batch
thus holds O(B · depth) numbers, not the B × n matrix, and the pass is the plain search's
one matrix product over the keys, which is what the online cost is measured against."""
from __future__ import annotations

import numpy as np

from ...space import SCAN_CELLS, MetricSpace

GATHER_PAIRS = 1 << 15  # keys gathered at a time for the pairs computed when asked (16 MB at d = 128)
DENSE_CELLS = 1 << 24  # a batch's whole rows are kept up to this many cells (64 MB): a look-up is cheaper than a dot


def find(keys: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where each of `c` sits in the sorted unique `keys`: (position, found) of c's shape."""
    c = np.asarray(c)
    if not len(keys):
        return np.zeros(c.shape, dtype=np.int64), np.zeros(c.shape, dtype=bool)
    pos = np.minimum(np.searchsorted(keys, c), len(keys) - 1)
    return pos, keys[pos] == c


class Pairs:
    """A set of (probe, gallery row) pairs, as sorted unique codes b·n + g: the sparse form of a
    B × n boolean matrix whose entries are few."""

    def __init__(self, codes: np.ndarray, n: int):
        self.codes, self.n = codes, n

    @classmethod
    def of(cls, b, g, n: int) -> Pairs:
        c = np.asarray(b, dtype=np.int64).ravel() * n + np.asarray(g, dtype=np.int64).ravel()
        return cls(np.unique(c), n)

    def has(self, b, g) -> np.ndarray:
        return find(self.codes, np.asarray(b, dtype=np.int64) * self.n + np.asarray(g, dtype=np.int64))[1]

    def pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """(b, g), by probe then row: np.nonzero's order of the dense matrix."""
        return np.divmod(self.codes, self.n)

    def __or__(self, other: Pairs) -> Pairs:
        return Pairs(np.union1d(self.codes, other.codes), self.n)

    def __and__(self, other: Pairs) -> Pairs:
        return Pairs(self.codes[np.isin(self.codes, other.codes, assume_unique=True)], self.n)

    def __sub__(self, other: Pairs) -> Pairs:
        return Pairs(self.codes[~np.isin(self.codes, other.codes, assume_unique=True)], self.n)

    def __len__(self) -> int:
        return len(self.codes)


class RunningTop:
    """Each of B rows' `depth` largest scores seen so far (ties kept), in a B × cap buffer: the
    candidates of a pass are appended, and a row that fills its buffer is cut back to its best,
    which raises its threshold `theta` (a score below it cannot be among the row's best)."""

    def __init__(self, B: int, depth: int):
        self.depth, self.cap = depth, max(4 * depth, 16)
        self.s = np.full((B, self.cap), -np.inf, dtype=np.float32)
        self.g = np.full((B, self.cap), -1, dtype=np.int64)
        self.fill = np.zeros(B, dtype=np.int64)
        self.theta = np.full(B, -np.inf, dtype=np.float32)

    def add(self, b: np.ndarray, g: np.ndarray, s: np.ndarray) -> None:
        """Append candidates (b sorted)."""
        B = len(self.fill)
        new = np.bincount(b, minlength=B)
        over = np.flatnonzero(self.fill + new > self.cap)
        if len(over):
            self.cut(over)
        need = int((self.fill + new).max(initial=0))
        if need > self.cap:  # more in one go than a cut leaves room for
            self.s = np.pad(self.s, ((0, 0), (0, need)), constant_values=-np.inf)
            self.g = np.pad(self.g, ((0, 0), (0, need)), constant_values=-1)
            self.cap += need
        start = np.searchsorted(b, np.arange(B))
        pos = self.fill[b] + np.arange(len(b)) - start[b]
        self.s[b, pos], self.g[b, pos] = s, g
        self.fill += new
        ready = np.flatnonzero(np.isneginf(self.theta) & (self.fill >= self.depth))
        if len(ready):
            self.cut(ready)

    def cut(self, rows: np.ndarray) -> None:
        s, g = self.s[rows], self.g[rows]
        th = np.partition(s, self.cap - self.depth, axis=1)[:, self.cap - self.depth]  # the depth-th largest
        keep = (s >= th[:, None]) & (g >= 0)
        order = np.argsort(~keep, axis=1, kind="stable")
        keep = np.take_along_axis(keep, order, 1)
        self.s[rows] = np.where(keep, np.take_along_axis(s, order, 1), -np.inf)
        self.g[rows] = np.where(keep, np.take_along_axis(g, order, 1), -1)
        self.fill[rows] = keep.sum(1)
        self.theta[rows] = np.maximum(self.theta[rows], th)

    def result(self, own: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each row's depth best, best first (ties: the lower column first), `own` left out."""
        bad = (self.g < 0) | (self.g == own[:, None]) | ~np.isfinite(self.s)
        order = np.lexsort((self.g, -self.s, bad), axis=-1)[:, : self.depth]
        bad = np.take_along_axis(bad, order, 1)
        return (np.where(bad, -1, np.take_along_axis(self.g, order, 1)),
                np.where(bad, -np.inf, np.take_along_axis(self.s, order, 1)).astype(np.float32))


class ProbeScan:
    """A batch of probes v (prepared queries) scanned against the gallery once.

    top, top_s   each probe's `depth` best rows, best first (ties: the lower row first), its own
                 row left out (−1 / −inf padded): `depth` entries of the plain order
    entered      the pairs with s(p, g) ≥ enter[g] (a row's (k1+1)-th similarity: the probe
                 enters g's list), with their scores
    below        the pairs with s(p, g) < floor[g] (a row's least similarity: the probe becomes
                 g's least similar item)
    q_min        each probe's least similarity over the gallery, its own row left out (+inf: none)
    `record` (b, g): pairs whose scores the pass records too (those read later, so that every
    score a decision reads comes from the pass's one product).
    `at(b, g)` reads s(p_b, g): the recorded score where the pass kept it, computed otherwise."""

    def __init__(self, space: MetricSpace, v: np.ndarray, own: np.ndarray, depth: int,
                 enter: np.ndarray | None = None, floor: np.ndarray | None = None,
                 record: tuple[np.ndarray, np.ndarray] | None = None):
        self.space, self.v, self.own = space, v, own
        self.B, self.n = B, n = len(v), space.n
        self.depth = depth = min(depth, n)
        self.t: np.ndarray | None = space.transform(v)
        self.q_min = np.full(B, np.inf, dtype=np.float32)
        best = RunningTop(B, depth)
        ent: list[tuple[np.ndarray, ...]] = []
        low: list[tuple[np.ndarray, ...]] = []
        seen: list[tuple[np.ndarray, ...]] = []
        has = np.flatnonzero(own >= 0)
        # a small gallery's rows are kept whole: the pairs asked later are then read, not computed
        self.S = np.empty((B, n), dtype=np.float32) if B * n <= DENSE_CELLS else None
        for a, z, S in space.score_blocks(v, max(1, SCAN_CELLS // max(B, 1))):
            w = z - a
            if self.S is not None:
                self.S[:, a:z] = S
            if enter is not None:
                f = np.flatnonzero((S >= enter[a:z]).ravel())
                ent.append((f // w, f % w + a, S.ravel()[f]))
            lo = S.min(1)
            if floor is not None:
                rows = np.flatnonzero(lo < floor[a:z].max(initial=-np.inf))  # only rows that can go below
                if len(rows):
                    Sr = S[rows]
                    f = np.flatnonzero((Sr < floor[a:z]).ravel())
                    low.append((rows[f // w], f % w + a, Sr.ravel()[f]))
            if record is not None and self.S is None:
                in_block = (record[1] >= a) & (record[1] < z)
                seen.append((record[0][in_block], record[1][in_block], S[record[0][in_block], record[1][in_block] - a]))
            mine = has[(own[has] >= a) & (own[has] < z)]
            if len(mine):  # the own row is not in the probe's universe
                S[mine, own[mine] - a] = np.inf
                lo[mine] = S[mine].min(1)
                S[mine, own[mine] - a] = -np.inf
            np.minimum(self.q_min, lo, out=self.q_min)
            if not depth:
                continue
            if w <= depth:
                bb, cc = np.divmod(np.arange(B * w), w)
            else:
                # the first block: its depth best per row and every tie of the depth-th (a tie
                # left out here could not come back: later blocks add only what reaches theta)
                th = best.theta
                if np.isneginf(th).all():
                    th = np.partition(S, w - depth, axis=1)[:, w - depth]
                f = np.flatnonzero((S >= th[:, None]).ravel())
                bb, cc = f // w, f % w
            best.add(bb, cc + a, S[bb, cc])  # bb is by row (row-major) either way
        self.top, self.top_s = best.result(own)
        e = [np.concatenate(c) for c in zip(*ent, strict=True)] if ent else [np.zeros(0, np.int64)] * 2 + [
            np.zeros(0, np.float32)]
        self.entered = tuple(e) if enter is not None else None
        self.below: Pairs | None = None
        if floor is not None:
            lb, lg, ls = (np.concatenate(c) for c in zip(*low, strict=True)) if low else ([], [], [])
            self.below = Pairs.of(lb, lg, n)
        self._codes, self._vals = np.zeros(0, np.int64), np.zeros(0, np.float32)
        if self.S is None:
            self._keep(e if enter is not None else None, (lb, lg, ls) if floor is not None and low else None, seen)

    def _keep(self, entered, below, seen) -> None:
        """Every score the pass kept (top rows, entered, below, recorded pairs), for `at`."""
        B, n = self.B, self.n
        okt = self.top >= 0
        rb = [np.broadcast_to(np.arange(B)[:, None], self.top.shape)[okt]]
        rg, rs = [self.top[okt]], [self.top_s[okt]]
        for pb, pg, ps in [*(x for x in (entered, below) if x is not None), *seen]:
            rb.append(np.asarray(pb))
            rg.append(np.asarray(pg))
            rs.append(np.asarray(ps))
        codes = np.concatenate(rb).astype(np.int64) * n + np.concatenate(rg)
        self._codes, first = np.unique(codes, return_index=True)
        self._vals = np.concatenate(rs).astype(np.float32)[first]

    @classmethod
    def none(cls, space: MetricSpace) -> ProbeScan:
        """One probe that enters no list and is the least similar item of none (s = −inf)."""
        out = cls.__new__(cls)
        out.space, out.B, out.n, out.depth = space, 1, space.n, 0
        out.own = np.full(1, -1)
        out.q_min = np.full(1, -np.inf, dtype=np.float32)
        out.top, out.top_s = np.zeros((1, 0), dtype=np.int64), np.zeros((1, 0), dtype=np.float32)
        out.entered, out.below, out.t, out.S = None, None, None, None
        return out

    def at(self, b, g) -> np.ndarray:
        """s(p_b, g) for pairs (arrays of one shape; float32)."""
        b, g = np.broadcast_arrays(np.asarray(b, dtype=np.int64), np.asarray(g, dtype=np.int64))
        out = np.empty(b.shape, dtype=np.float32)
        if self.t is None:
            out.fill(-np.inf)
            return out
        if self.S is not None:
            return self.S[b, g]
        flat = out.reshape(-1)
        at, hit = find(self._codes, (b * self.n + g).ravel())
        flat[hit] = self._vals[at[hit]]
        miss = np.flatnonzero(~hit)
        bm, gm = b.ravel()[miss], g.ravel()[miss]
        for a in range(0, len(miss), GATHER_PAIRS):
            sl = slice(a, a + GATHER_PAIRS)
            flat[miss[sl]] = np.einsum("md,md->m", self.t[bm[sl]], self.space.gallery_vectors(gm[sl]))
        return out

    def row(self, b: int) -> np.ndarray:
        """Probe b's whole row s(p_b, ·) (n,): a pass of its own, for the rare probe whose top
        `depth` rows are not enough."""
        if self.S is not None:
            return self.S[b].copy()
        return self.space.score(self.v[b: b + 1])[0]
