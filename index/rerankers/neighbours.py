"""The offline gallery–gallery pass the re-rankers share: each item's top-L neighbours under the
space's similarity (the item itself included, where its own score puts it, as a row of a full
similarity matrix sorted would have it), and each row's extreme similarities.  Both are the
space's artefacts (`space.artefact`); a leave-one-out query removes its own row from them online (`without`),
which is why every list is stored one entry longer than any re-ranker reads.  Above
APPROXIMATE_ABOVE items (PSD M′) the lists come from an HNSW index, re-scored exactly.
"""
from __future__ import annotations

import faiss
import numpy as np

from core.errors import UserError

from ..space import MetricSpace, memory_budget

BLOCK = 2048        # rows per search call in the list pass
# galleries above this many items build their lists with an HNSW index instead of an exact scan,
# where M′ is PSD (measured: docs/reranking.md, "Approximate neighbour lists")
APPROXIMATE_ABOVE = 250_000
HNSW = {"M": 32, "ef_construction": 80, "ef_search": 128}  # ef_search: at least twice the list length
SCAN_CELLS = 1 << 23  # cells per full-scan block in the minima pass (rows × n float32: 32 MB)


def stored_length(L: int, n: int) -> int:
    """Lists are stored at least 32 long, in steps of 16, so that re-rankers asking for
    somewhat different lengths share one pass."""
    return min(n, max(32, -(-int(L) // 16) * 16))


def neighbour_lists(space: MetricSpace, L: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, sims): every item's top-L items, best first (n × L int32, float32; views of the
    cached arrays: do not write to them).  Refused when they would not fit the memory budget."""
    L = min(int(L), space.n)
    F = space.factor() if space.n > APPROXIMATE_ABOVE else None
    approximate = F is not None and F.shape[1] > 0

    def build():
        Ls = stored_length(L, space.n)
        if space.n * Ls * 8 > memory_budget():
            raise UserError(f"re-ranking would keep every item's top {Ls} neighbours: "
                            f"{space.n * Ls * 8 / 2**30:.1f} GiB for {space.n:,} items, above the memory budget "
                            f"(--cache-memory {memory_budget() / 2**30:.1f}G); ask for fewer neighbours")
        if approximate:
            assert F is not None
            return approximate_lists(space, F, Ls)
        return exact_lists(space, np.arange(space.n), Ls)
    got = space.artefact("knn", HNSW if approximate else None, build, stale=lambda got: got["rows"].shape[1] < L)
    return got["rows"][:, :L], got["sims"][:, :L]


def exact_lists(space: MetricSpace, items: np.ndarray, Ls: int) -> dict[str, np.ndarray]:
    """The top Ls of each of `items` by an exact search of the whole gallery."""
    rows = np.empty((len(items), Ls), dtype=np.int32)
    sims = np.empty((len(items), Ls), dtype=np.float32)
    for s in range(0, len(items), BLOCK):
        h = space.search(space.gallery_vectors(items[s: s + BLOCK]), Ls)
        rows[s: s + BLOCK], sims[s: s + BLOCK] = h.rows, h.scores
    return {"rows": rows, "sims": sims}


def approximate_lists(space: MetricSpace, F: np.ndarray, Ls: int) -> dict[str, np.ndarray]:
    """Each item's top Ls from an HNSW inner-product index over Fᵀ key(x) (M′ = F Fᵀ, so its inner
    product is s), re-scored exactly and sorted best first; an item whose search came back short
    is searched exactly."""
    index = faiss.IndexHNSWFlat(F.shape[1], HNSW["M"], faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = HNSW["ef_construction"]
    for s in range(0, space.n, BLOCK):
        index.add(np.ascontiguousarray(space.gallery_vectors(np.arange(s, min(s + BLOCK, space.n))) @ F))
    index.hnsw.efSearch = max(HNSW["ef_search"], 2 * Ls)
    rows = np.empty((space.n, Ls), dtype=np.int32)
    sims = np.empty((space.n, Ls), dtype=np.float32)
    for s in range(0, space.n, BLOCK):
        idx = np.arange(s, min(s + BLOCK, space.n))
        keys = space.gallery_vectors(idx)
        _, cand = index.search(np.ascontiguousarray(keys @ F), Ls)
        cand = cand.astype(np.int64)
        exact = space.score(keys, cand)  # −inf where the search returned no row
        order = np.argsort(-exact, axis=1, kind="stable")
        rows[idx], sims[idx] = np.take_along_axis(cand, order, 1), np.take_along_axis(exact, order, 1)
    short = np.flatnonzero((rows < 0).any(1))
    if len(short):
        again = exact_lists(space, short, Ls)
        rows[short], sims[short] = again["rows"], again["sims"]
    return {"rows": rows, "sims": sims}


def row_extremes(space: MetricSpace) -> dict[str, np.ndarray]:
    """Per item x: its self-similarity s(x, x), and over every item y (x included) the smallest
    s(x, y), its row, and the second smallest (the smallest once a leave-one-out query removes
    the first)."""
    def compute():
        n = space.n
        out: dict[str, np.ndarray] = {"self": np.empty(n, np.float32), "min1": np.empty(n, np.float32),
               "arg1": np.empty(n, np.int64), "min2": np.empty(n, np.float32)}
        step = max(1, min(1024, SCAN_CELLS // max(n, 1)))
        for s in range(0, n, step):
            idx = np.arange(s, min(s + step, n))
            S = space.score(space.gallery_vectors(idx))
            r = np.arange(len(idx))
            out["self"][idx] = S[r, idx]
            a = S.argmin(1)
            out["arg1"][idx], out["min1"][idx] = a, S[r, a]
            S[r, a] = np.inf
            out["min2"][idx] = S.min(1) if n > 1 else np.inf
        return out
    return space.artefact("extremes", None, compute)


def without(rows: np.ndarray, sims: np.ndarray, drop: np.ndarray, L: int):
    """Each list with row `drop[i]` (−1: none) removed, order kept, cut to L."""
    mask = rows == np.asarray(drop)[:, None]
    if not mask.any():
        return rows[:, :L], sims[:, :L]
    order = np.argsort(mask, axis=1, kind="stable")[:, :L]
    return np.take_along_axis(rows, order, 1), np.take_along_axis(sims, order, 1)


def reverse_index(space: MetricSpace, lists: np.ndarray, k: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(ptr, src): src[ptr[i]:ptr[i+1]] are the items whose first k neighbours (`lists`) hold i,
    in item order; kept in the space's memory under `name` (one name per lists and k: callers that
    read the same lists share it)."""
    if lists.shape[1] < k:
        raise ValueError(f"a reverse index of the first {k} neighbours needs lists of {k} or more, "
                         f"not {lists.shape[1]}")
    def build():
        flat = lists[:, :k].ravel().astype(np.int64)
        order = np.argsort(flat, kind="stable")
        ptr = np.zeros(space.n + 1, dtype=np.int64)
        np.add.at(ptr, flat + 1, 1)
        return np.cumsum(ptr), np.repeat(np.arange(space.n), k)[order]
    return space.artefact(name, None, build, disk=False)
