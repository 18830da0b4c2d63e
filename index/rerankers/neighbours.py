"""The offline gallery–gallery pass the re-rankers share: each item's top-L neighbours under the
space's similarity (the item itself included, where its own score puts it, as a row of a full
similarity matrix sorted would have it), and each row's extreme similarities.  Both are the
space's artefacts (`space.artefact`), the lists one per stored length; a leave-one-out query
removes its own row from them online (`without`), which is why every list is stored one entry
longer than any re-ranker reads.  Above APPROXIMATE_ABOVE items (PSD M′) both come from one HNSW
index, every score re-computed exactly: the lists from a search for the most similar items, the
extremes from one for the least similar (a search for −Fᵀ key(x)) and from the `antipodes`.
Where Fᵀ key(x) has more than GRAPH_DIM dimensions, the graph holds its projection onto the top
GRAPH_DIM principal directions (`graph_basis`), and each search asks for WIDEN times as many
candidates before the exact re-scoring.
"""
from __future__ import annotations

from typing import NamedTuple

import faiss
import numpy as np

from core.errors import UserError
from core.memory import check_fits

from ..space import SCAN_CELLS, MetricSpace
from ..threads import in_threads

BLOCK = 2048        # rows per search call in the list pass
# galleries above this many items build their lists with an HNSW index instead of an exact scan,
# where M′ is PSD (measured: docs/reranking.md, "Approximate neighbour lists")
APPROXIMATE_ABOVE = 250_000
# the exact passes (an indefinite M′, which has no F for HNSW) are refused above this many items:
# they scan N² pairs, about 9 CPU-minutes each at 400,000 items and 6 times that at 10⁶
EXACT_MAX = 500_000
HNSW = {"M": 32, "ef_construction": 80, "ef_search": 128}  # ef_search: at least twice the list length
# lists are stored at least this long: every re-ranker's default (diffusion's k = 50, + 1 for a
# left-out query) reads one artefact, so one pass serves them all
MIN_LENGTH = 64
EXTREME_CANDIDATES = 8  # least similar candidates per item from the HNSW index, each re-scored exactly
# gallery items (a seeded draw) whose exact least similar items are every item's candidates too
# (`antipodes`): a search for −Fᵀ key(x) lands far from the data, where the graph is weakest
EXTREME_SAMPLE = 1024
ANTIPODES = 1024  # at most this many of them, the most often met
# the graph's vectors have at most GRAPH_DIM dimensions: a 1,280-d key costs ten times as much per
# distance, and 128 principal directions keep the candidates (measured: docs/reranking.md)
GRAPH_DIM = 128
WIDEN = 2  # candidates per kept entry searched in a projected graph
PROJECTION_SAMPLE = 65_536  # gallery items (a seeded draw) whose second moment gives the projection


def stored_length(L: int, n: int) -> int:
    """Lists are stored at least MIN_LENGTH long, in steps of 16, so that re-rankers asking for
    somewhat different lengths share one pass (each stored length is an artefact of its own)."""
    return min(n, max(MIN_LENGTH, -(-int(L) // 16) * 16))


class Lists(NamedTuple):
    """Every item's top-L items, best first (n × L int32 rows, float32 sims: views of the cached
    arrays, not to be written to), and the digest of the artefact they were read from."""
    rows: np.ndarray
    sims: np.ndarray
    digest: str


def _lists_spec(space: MetricSpace, L: int) -> tuple[dict, int, np.ndarray | None, int]:
    """(params, stored length, F where the lists come from the HNSW graph else None, widen).  A
    space read by row (an engine's gallery) searches its engine: never an HNSW graph of its own."""
    by_engine = not space.holds_gallery
    F = space.factor() if space.n > APPROXIMATE_ABOVE and not by_engine else None
    approximate = F is not None and F.shape[1] > 0
    Ls = stored_length(L, space.n)
    if not approximate:
        return {"length": Ls}, Ls, None, 1
    assert F is not None
    graph, widen = graph_params(F)
    return graph | {"length": Ls}, Ls, F, widen


def neighbour_lists(space: MetricSpace, L: int, *, progress: bool = False) -> Lists:
    """Every item's top-L items.  Lists of each stored length are an artefact of their own: a
    request for longer lists never replaces shorter ones, so what a caller reads does not depend
    on what was asked before (an approximate search, or a deeper one, may order the first
    entries differently).  The pass runs BLOCK items at a time (through the space's own search,
    or the HNSW graph's, built first), into memory-mapped files that a build cut short resumes
    from the last block written, and are read memory-mapped: the page cache holds the lists, not
    the process (`artefact_in_blocks`; `progress`: a bar with an ETA)."""
    L = min(int(L), space.n)
    params, Ls, F, widen = _lists_spec(space, L)
    columns = {"rows": (Ls, "int32"), "sims": (Ls, "float32")}
    if F is None:
        if space.holds_gallery:  # an engine's search costs what its index costs
            refuse_exact_scan(space, "neighbour lists")
        got = space.artefact_in_blocks("knn", params, columns, lambda a, b: searched_lists(space, np.arange(a, b), Ls),
                                       block=BLOCK, progress=progress)
    else:
        graph: dict = {}  # built at the first block this call writes (a resumed build builds it again)

        def from_graph(a: int, b: int) -> dict[str, np.ndarray]:
            assert F is not None
            if not graph:
                G = graph_basis(space, F)
                index = hnsw_index(space, G)
                # the extremes from the same graph while it is at hand (row_extremes reads them)
                space.artefact("extremes", extremes_params(graph_params(F)[0]),
                               lambda: approximate_extremes(space, G, index, widen), reserve=space.n * 20)
                graph.update(G=G, index=index)
            return approximate_block(space, graph["G"], Ls, graph["index"], widen, np.arange(a, b))
        got = space.artefact_in_blocks("knn", params, columns, from_graph, block=BLOCK, progress=progress)
    return Lists(got["rows"][:, :L], got["sims"][:, :L], space.digest("knn", params))


def refuse_exact_scan(space: MetricSpace, what: str) -> None:
    """One line instead of hours of work: the exact N² pass above EXACT_MAX items."""
    if space.n > EXACT_MAX:
        raise UserError(f"re-ranking needs the {what} of all {space.n:,} items, and this M′ is indefinite, so "
                        f"they need an exact scan of every pair (hours at this size; approximate lists need a "
                        f"positive semi-definite M′); choose a PSD strategy or a gallery of at most "
                        f"{EXACT_MAX:,} items")


def searched_lists(space: MetricSpace, items: np.ndarray, Ls: int) -> dict[str, np.ndarray]:
    """The top Ls of each of `items` by the space's own search (`item_neighbours`): an exact scan
    of an array, the engine's index for a gallery it keeps."""
    rows, sims = space.item_neighbours(items, Ls)
    return {"rows": rows, "sims": sims}


def graph_params(F: np.ndarray) -> tuple[dict, int]:
    """(params, widen): the name of the HNSW artefacts over Fᵀ key(x) (projected or not, see
    `graph_basis`) and how many candidates per kept entry their searches ask for."""
    if F.shape[1] <= GRAPH_DIM:
        return HNSW, 1
    return HNSW | {"dim": GRAPH_DIM, "widen": WIDEN, "sample": PROJECTION_SAMPLE}, WIDEN


def graph_basis(space: MetricSpace, F: np.ndarray) -> np.ndarray:
    """G, the HNSW graph holding Gᵀ key(x): F where F has at most GRAPH_DIM columns; otherwise
    F V, V the top GRAPH_DIM eigenvectors of the second moment of Fᵀ key(x) over a seeded draw
    of PROJECTION_SAMPLE items (not centred: it is inner products the graph approximates)."""
    if F.shape[1] <= GRAPH_DIM:
        return F

    def build():
        rows = np.random.default_rng(0).choice(space.n, min(space.n, PROJECTION_SAMPLE), replace=False)
        C = np.zeros((F.shape[1], F.shape[1]))
        for a in range(0, len(rows), BLOCK):
            Y = space.gallery_vectors(np.sort(rows[a: a + BLOCK])) @ F
            C += (Y.T @ Y).astype(np.float64)
        _, V = np.linalg.eigh(C)  # ascending
        return {"G": np.ascontiguousarray(F @ V[:, ::-1][:, :GRAPH_DIM].astype(np.float32))}
    return space.artefact("graph-basis", graph_params(F)[0], build, disk=False)["G"]


def hnsw_index(space: MetricSpace, F: np.ndarray) -> faiss.IndexHNSWFlat:
    """An HNSW inner-product index over Fᵀ key(x) (M′ = F Fᵀ, so its inner product is s)."""
    index = faiss.IndexHNSWFlat(F.shape[1], HNSW["M"], faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = HNSW["ef_construction"]
    for s in range(0, space.n, BLOCK):
        index.add(np.ascontiguousarray(space.gallery_vectors(np.arange(s, min(s + BLOCK, space.n))) @ F))
    return index


def approximate_lists(space: MetricSpace, F: np.ndarray, Ls: int,
                      index: faiss.IndexHNSWFlat | None = None, widen: int = 1) -> dict[str, np.ndarray]:
    """Each item's top Ls from the HNSW index over Fᵀ key(x) (built here when not given): the
    top widen × Ls found, re-scored exactly, the best Ls kept best first; an item whose search
    came back short is searched exactly."""
    index = hnsw_index(space, F) if index is None else index
    rows = np.empty((space.n, Ls), dtype=np.int32)
    sims = np.empty((space.n, Ls), dtype=np.float32)
    for s in range(0, space.n, BLOCK):
        idx = np.arange(s, min(s + BLOCK, space.n))
        got = approximate_block(space, F, Ls, index, widen, idx)
        rows[idx], sims[idx] = got["rows"], got["sims"]
    return {"rows": rows, "sims": sims}


def approximate_block(space: MetricSpace, F: np.ndarray, Ls: int, index: faiss.IndexHNSWFlat, widen: int,
                      idx: np.ndarray) -> dict[str, np.ndarray]:
    """The top Ls of the items `idx` from the HNSW index over Fᵀ key(x): the top widen × Ls
    found, re-scored exactly, the best Ls kept best first; an item whose search came back short
    is searched exactly."""
    C = min(space.n, widen * Ls)
    index.hnsw.efSearch = max(HNSW["ef_search"], 2 * Ls, C)
    keys = space.gallery_vectors(idx)
    _, cand = index.search(np.ascontiguousarray(keys @ F), C)
    cand = cand.astype(np.int64)
    exact = space.score(keys, cand)  # −inf where the search returned no row
    order = np.argsort(-exact, axis=1, kind="stable")[:, :Ls]
    rows = np.take_along_axis(cand, order, 1).astype(np.int32)
    sims = np.take_along_axis(exact, order, 1).astype(np.float32)
    short = np.flatnonzero((rows < 0).any(1))
    if len(short):
        again = searched_lists(space, idx[short], Ls)
        rows[short], sims[short] = again["rows"], again["sims"]
    return {"rows": rows, "sims": sims}


def extremes_params(params: dict | None) -> dict:
    """The name of the HNSW row extremes: the graph's, and the antipodes' draw."""
    return (params or {}) | {"extreme_sample": EXTREME_SAMPLE, "antipodes": ANTIPODES}


def antipodes(space: MetricSpace) -> np.ndarray:
    """The least similar items of a seeded draw of EXTREME_SAMPLE gallery items (each one's
    EXTREME_CANDIDATES + 1 smallest s, by an exact scan of its row), as sorted unique rows; the
    ANTIPODES most often met where there are more, so that scoring them against every item costs
    at most what the draw's scan costs.  The items that are some item's least similar are few
    where the features are (the gallery's extreme points away from the data), so these are the
    others' too (measured: docs/reranking.md)."""
    n = space.n
    drawn = np.sort(np.random.default_rng(0).choice(n, min(n, EXTREME_SAMPLE), replace=False))
    keep = min(EXTREME_CANDIDATES + 1, n)
    # one pass over the keys for the whole draw (a block of columns at a time), each row's
    # `keep` smallest carried from block to block
    low_s = np.full((len(drawn), 0), np.inf, np.float32)
    low_g = np.zeros((len(drawn), 0), np.int64)
    for a, _, S in space.score_blocks(space.gallery_vectors(drawn), max(keep, SCAN_CELLS // len(drawn))):
        s_ = np.concatenate([low_s, S], axis=1)
        g_ = np.concatenate([low_g, np.broadcast_to(np.arange(a, a + S.shape[1]), S.shape)], axis=1)
        at = np.argpartition(s_, keep - 1, axis=1)[:, :keep] if s_.shape[1] > keep else np.argsort(s_, axis=1)
        low_s, low_g = np.take_along_axis(s_, at, 1), np.take_along_axis(g_, at, 1)
    rows, count = np.unique(low_g, return_counts=True)
    if len(rows) > ANTIPODES:
        rows = np.sort(rows[np.argsort(-count, kind="stable")[:ANTIPODES]])
    return rows


def approximate_extremes(space: MetricSpace, F: np.ndarray, index: faiss.IndexHNSWFlat | None = None,
                         widen: int = 1) -> dict[str, np.ndarray]:
    """row_extremes from the HNSW index: each item's least similar items are the most similar to
    −Fᵀ key(x); the widen × EXTREME_CANDIDATES found, the `antipodes` and x itself are scored
    exactly, so each minimum is an exact similarity, at least the true minimum."""
    index = hnsw_index(space, F) if index is None else index
    index.hnsw.efSearch = HNSW["ef_search"]
    n = space.n
    hubs = antipodes(space)
    out: dict[str, np.ndarray] = {"self": np.empty(n, np.float32), "min1": np.empty(n, np.float32),
                                  "arg1": np.empty(n, np.int64), "min2": np.empty(n, np.float32)}
    for s in range(0, n, BLOCK):
        idx = np.arange(s, min(s + BLOCK, n))
        keys = space.gallery_vectors(idx)
        _, cand = index.search(np.ascontiguousarray(-(keys @ F)), min(n, widen * EXTREME_CANDIDATES))
        cand = np.concatenate([idx[:, None], cand.astype(np.int64)], axis=1)  # x itself: as the exact pass sees it
        S = np.concatenate([space.score(keys, cand), space.score(keys, hubs)], axis=1)
        twice = (cand[:, 1:] < 0) | (cand[:, 1:] == idx[:, None]) | np.isin(cand[:, 1:], hubs)  # none, or a row twice
        S[:, 1: cand.shape[1]][twice] = np.inf
        S[:, cand.shape[1]:][hubs[None, :] == idx[:, None]] = np.inf
        r = np.arange(len(idx))
        two = np.sort(np.argpartition(S, 1, axis=1)[:, :2], axis=1)  # the two smallest; ties: the first column
        swap = S[r, two[:, 1]] < S[r, two[:, 0]]
        two[swap] = two[swap][:, ::-1]
        w = cand.shape[1]
        rows = np.where(two < w, cand[r[:, None], np.minimum(two, w - 1)], hubs[np.maximum(two - w, 0)])
        # the two kept re-scored as the lists' scores are (the antipodes' product rounds differently)
        S2 = np.where(np.isfinite(S[r[:, None], two]), space.score(keys, rows), np.inf)
        out["self"][idx] = S[:, 0]
        out["arg1"][idx] = rows[:, 0]
        out["min1"][idx] = S2[:, 0]
        out["min2"][idx] = S2[:, 1]
    return out


def _extremes_spec(space: MetricSpace) -> tuple[dict | None, np.ndarray | None, int]:
    """(params, F where the extremes come from the HNSW graph else None, widen)."""
    F = space.factor() if space.n > APPROXIMATE_ABOVE else None
    if F is not None and F.shape[1] > 0:
        graph, widen = graph_params(F)
        return extremes_params(graph), F, widen
    return None, None, 1


def extremes_digest(space: MetricSpace) -> str:
    """The digest of the artefact `row_extremes(space)` reads."""
    return space.digest("extremes", _extremes_spec(space)[0])


def row_extremes(space: MetricSpace) -> dict[str, np.ndarray]:
    """Per item x: its self-similarity s(x, x), and over every item y (x included) the smallest
    s(x, y), its row, and the second smallest (the smallest once a leave-one-out query removes
    the first).  Above APPROXIMATE_ABOVE items (PSD M′) from the HNSW index (`approximate_extremes`)."""
    params, F, widen = _extremes_spec(space)
    size = space.n * 20
    check_fits(f"re-ranking: every item's row extremes ({space.n:,} items)", size)
    if F is not None:
        def from_graph():
            return approximate_extremes(space, graph_basis(space, F), widen=widen)
        return space.artefact("extremes", params, from_graph, reserve=size)

    def compute():
        refuse_exact_scan(space, "row extremes")
        n = space.n
        out: dict[str, np.ndarray] = {"self": np.empty(n, np.float32), "min1": np.empty(n, np.float32),
               "arg1": np.empty(n, np.int64), "min2": np.empty(n, np.float32)}
        step = max(1, min(1024, SCAN_CELLS // max(n, 1)))

        def block(s: int) -> None:  # blocks write disjoint rows: threads need no lock
            idx = np.arange(s, min(s + step, n))
            S = space.score(space.gallery_vectors(idx))
            r = np.arange(len(idx))
            out["self"][idx] = S[r, idx]
            a = S.argmin(1)
            out["arg1"][idx], out["min1"][idx] = a, S[r, a]
            S[r, a] = np.inf
            out["min2"][idx] = S.min(1) if n > 1 else np.inf
        in_threads(block, range(0, n, step))
        return out
    return space.artefact("extremes", None, compute, reserve=size)


def without(rows: np.ndarray, sims: np.ndarray, drop: np.ndarray, L: int):
    """Each list with row `drop[i]` (−1: none) removed, order kept, cut to L."""
    mask = rows == np.asarray(drop)[:, None]
    hit = np.flatnonzero(mask.any(1))
    if not len(hit):
        return rows[:, :L], sims[:, :L]
    # only the lists that hold their row move (a query's item is in a few of its candidates' lists)
    out_r, out_s = np.array(rows[:, :L]), np.array(sims[:, :L])
    order = np.argsort(mask[hit], axis=1, kind="stable")[:, :L]
    out_r[hit] = np.take_along_axis(rows[hit], order, 1)
    out_s[hit] = np.take_along_axis(sims[hit], order, 1)
    return out_r, out_s


def reverse_csr(lists: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(ptr, src): src[ptr[i]:ptr[i+1]] are the rows of `lists` (n × k) that hold item i, in row
    order; −1 entries (a list that ran out) hold nothing."""
    flat = np.asarray(lists).ravel().astype(np.int64)
    keep = flat >= 0
    order = np.argsort(flat[keep], kind="stable")
    ptr = np.zeros(n + 1, dtype=np.int64)
    np.add.at(ptr, flat[keep] + 1, 1)
    return np.cumsum(ptr), np.repeat(np.arange(len(lists)), lists.shape[1])[keep][order]


def reverse_index(space: MetricSpace, lists: np.ndarray, k: int, source: str) -> tuple[np.ndarray, np.ndarray]:
    """`reverse_csr` of the first k columns of `lists`, an array read from the artefact whose
    digest is `source`; kept in the space's memory under that digest and k (callers that read
    the same lists share it)."""
    if lists.shape[1] < k:
        raise ValueError(f"a reverse index of the first {k} neighbours needs lists of {k} or more, "
                         f"not {lists.shape[1]}")
    return space.artefact("reverse", {"k": k}, lambda: reverse_csr(lists[:, :k], space.n), inputs=(source,),
                          disk=False)
