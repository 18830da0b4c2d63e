"""Diffusion decoupled into an offline and an online part: Yang, Hinami, Matsui, Ly, Satoh,
"Efficient Image Retrieval via Decoupling Diffusion into Online and Offline Processing", AAAI
2019, as its official code runs it (fyang93/diffusion: diffusion.py `get_offline_results`,
rank.py `search_old`).

Offline, every gallery item i is diffused as a query of its own on its truncated graph: its top
T items (`item_truncation`, itself first), the mutual k-NN graph's Laplacian L_α = I − α D^{-1/2} A
D^{-1/2} of the whole gallery (A: the mutual k-NN affinities to the power γ; D: their degrees
over the whole graph) restricted to those T items, and f_i = L_α[T_i, T_i]⁻¹ e_i solved by
conjugate gradients (scipy's `cg`, tol 1e-6, 20 steps, its last iterate).  Row i of the offline
matrix holds f_i on T_i.  Online, a query's top kq items j with similarities s_j are its seeds:

    score(x) = Σ_j s_j^γ · F[j, x]

ranked over the items the kq rows reach (≤ kq · T), equal scores by row.  A query costs kq rows
read and one sparse sum, whatever the gallery's size; the offline pass costs one T-item solve
per item (`bench/diffusion_offline.py` measures both).

The rows are an artefact one per item (`artefact_in_blocks`): memory-mapped files beside a
gallery this process holds, a collection beside an engine's (read by row online).  The offline
pass reads every item's lists at random, so on an engine's gallery it first copies the lists into
memory-mapped files in a temporary folder (N × L × 8 bytes of disk: 0.5 GB at 10⁶, L = 64), and
writes the rows back to the engine a block at a time.

Leave-one-out (a query that is gallery item i): i is left out of the seeds and the answer, but
the offline rows were diffused on the graph that holds i (recomputing every row whose truncated
graph holds i is T solves a query).  docs/fidelity.md states what this and the other choices
cost.
"""
from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy import sparse

from core.params import param

from ..space import Hits, MetricSpace
from ..threads import in_threads
from .diffusion import _mutual, _ranked, power
from .neighbours import neighbour_lists, reverse_index, without
from .registry import RERANKERS, candidates

BLOCK = 1024  # items per block of the offline pass (an engine's insert; resumed from the last written)
# list entries (items × T × k) one block-diagonal system holds: its ~10 arrays of them take about 100 MB
PART_CELLS = 1 << 20
COPY_BLOCK = 8192  # rows of an engine's lists copied to the temporary files at a time


@dataclass
class DiffusionOfflineParams:
    k: int = param(50, "neighbours per item in the kNN graph, the item itself counted (fyang93/diffusion: kd = 50); "
                       "clipped to the gallery", bounds="[2, inf)", size=True)
    kq: int = param(10, "the query's top items whose offline rows are summed (kq = 10); clipped to the gallery",
                    bounds="[1, inf)", size=True)
    item_truncation: int = param(1000, "the items each item's offline diffusion runs on and keeps, itself and its "
                                       "top ones (truncation_size = 1000); clipped to the gallery",
                                 bounds="[2, 4096]")
    alpha: float = param(0.99, "α of L_α = I − αS", bounds="(0, 1)")
    gamma: float = param(3.0, "power γ of the similarities in the graph and of the seeds' weights",
                         bounds="(0, inf)")
    iterations: int = param(20, "conjugate-gradient steps at most (scipy cg's maxiter = 20)", bounds="[1, 1000]")
    tol: float = param(1e-6, "conjugate-gradient tolerance on the relative residual (tol = 1e-6)",
                       bounds="(0, inf)")


def batched_cg(matvec, b: np.ndarray, tol: float, iterations: int) -> np.ndarray:
    """scipy's `cg(A, b, rtol=tol, maxiter=iterations)` (no preconditioner, from x = 0, stopped
    once ‖r‖ < tol ‖b‖, its last iterate) for B independent systems side by side: `b` is B × T,
    `matvec` maps B × T to B × T (a block-diagonal A), each row with its own steps and stop."""
    B = np.asarray(b, dtype=np.float64)
    x = np.zeros_like(B)
    r = B.copy()
    atol = tol * np.linalg.norm(B, axis=1)
    live = np.linalg.norm(B, axis=1) > 0  # cg returns b itself for b = 0: x = 0 here, the same
    p = np.zeros_like(B)
    rho_prev = np.ones(len(B))
    with np.errstate(divide="ignore", invalid="ignore"):
        for it in range(iterations):
            live &= np.linalg.norm(r, axis=1) >= atol
            if not live.any():
                break
            rho = np.einsum("ij,ij->i", r, r)
            if it:
                p *= np.where(live, rho / rho_prev, 0.0)[:, None]
                p += r
            else:
                p[:] = r
            p[~live] = 0.0
            q = matvec(p)
            a = np.where(live, rho / np.einsum("ij,ij->i", p, q), 0.0)[:, None]
            x += a * p
            r -= a * q
            rho_prev = np.where(live, rho, rho_prev)
    return x


def degrees(read, items: np.ndarray, k: int, gamma: float) -> np.ndarray:
    """Each item's degree in the whole gallery's mutual k-NN graph (knngraph.m's, as
    fyang93/diffusion builds it): Σ max(s_ij, 0)^γ over the j ≠ i of its top k whose own top k
    holds i.  `read(ids, w)`: the first w entries of those items' lists (rows, sims)."""
    R, S = read(items, k)
    ok = (R >= 0) & (R != items[:, None])
    back = read(np.maximum(R, 0).ravel(), k)[0].reshape(len(items), k, k)
    mutual = ok & (back == items[:, None, None]).any(2)
    return np.where(mutual, power(np.maximum(S, 0.0), gamma), 0.0).sum(1)


def truncated(R: np.ndarray, items: np.ndarray, T: int) -> np.ndarray:
    """Each item's truncated graph from its list R: itself first, then its top items without it,
    T in all (B × T; −1 where a list runs out).  Under a metric whose item is its own top (cosine)
    this is its top T."""
    mine = R == items[:, None]
    order = np.argsort(mine, axis=1, kind="stable")  # the item's own entry moved to the end
    rest = np.take_along_axis(R, order, 1)[:, : T - 1]
    return np.concatenate([items[:, None], rest], axis=1)


def offline_block(read, deg_of, items: np.ndarray, p: DiffusionOfflineParams, T: int, k: int,
                  n: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows `items` of the offline matrix: (B × T item rows, B × T float32 f), each item's
    diffusion on its truncated graph (fyang93/diffusion `get_offline_result`), solved together
    as one block-diagonal system.  `read(ids, w)`: their lists' first w entries; `deg_of(ids)`:
    their degrees (`degrees`); n: the gallery's size."""
    sub = truncated(read(items, T)[0], items, T)  # B × T
    B = len(items)
    flat = sub.ravel()
    # each member's k-NN list in its item's graph: its entries' places there (b·T + place), −1 outside
    key = np.arange(B, dtype=np.int64)[:, None] * (n + 1) + (sub + 1)
    order = np.argsort(key.ravel(), kind="stable")
    sorted_key = key.ravel()[order]
    nb, ns = read(np.maximum(flat, 0), k)
    want = (np.repeat(np.arange(B, dtype=np.int64), T)[:, None] * (n + 1) + (nb + 1)).ravel()
    at = np.minimum(np.searchsorted(sorted_key, want), len(sorted_key) - 1)
    local = np.where(sorted_key[at] == want, order[at], -1).reshape(B * T, k)
    own = np.arange(B * T)[:, None]
    keep = (flat >= 0)[:, None] & (nb >= 0) & (local >= 0) & (local != own)
    A = _mutual(keep.sum(1), local[keep], np.maximum(ns[keep], 0.0), B * T, p.gamma)
    d = np.where(flat >= 0, deg_of(np.maximum(flat, 0)), 0.0)
    inv = np.where(d > 0, 1.0 / np.sqrt(np.maximum(d, 1e-300)), 0.0)
    row = np.repeat(np.arange(B * T), np.diff(A.indptr))
    S = sparse.csr_matrix((A.data * inv[row] * inv[A.indices], A.indices, A.indptr), shape=A.shape)
    y = np.zeros((B, T))
    y[:, 0] = 1.0

    def matvec(P: np.ndarray) -> np.ndarray:
        return P - p.alpha * (S @ P.ravel()).reshape(B, T)
    f = batched_cg(matvec, y, p.tol, p.iterations)
    return sub, np.where(sub >= 0, f, 0.0).astype(np.float32)


def reader(rows, sims):
    """read(ids, w) → (rows, sims): the first w entries of those items' lists, int64 and float64,
    from arrays (or memory maps, or an engine's columns, read by row)."""
    return lambda ids, w: (np.asarray(rows[:, :w][ids], dtype=np.int64), np.asarray(sims[:, :w][ids], dtype=np.float64))


def without_item(read, deg_of, reverse, i: int, k: int, k_without: int, gamma: float):
    """(read, deg_of) of the gallery without item i: every list with i taken out (and cut one
    shorter, as a list of that gallery is), and the degrees that change recomputed: those of the
    items whose top k held i (`reverse(i)`) and of the items that move into their top k.
    `k_without`: k in the gallery without i (one less where k was clipped to the whole gallery)."""
    def read_i(ids, w):
        R, S = read(ids, w + 1)
        return without(R, S, np.full(len(ids), i), w)
    held = np.asarray(reverse(i), dtype=np.int64)
    held = held[held != i]
    if len(held):
        R = read(held, k)[0]
        held = held[(R == i).any(1)]  # an engine's reverse lists hold every entry, not the top k alone
    # the item that moves into each such top k (none where k shrinks with the gallery)
    moved = read_i(held, k)[0][:, k - 1] if len(held) and k_without == k else np.zeros(0, np.int64)
    changed = np.unique(np.concatenate([held, moved[moved >= 0]]))
    fresh = (degrees(read_i, changed, k_without, gamma).astype(np.float32) if len(changed)
             else np.zeros(0, np.float32))

    def deg_i(ids):
        d = deg_of(ids)
        at = np.minimum(np.searchsorted(changed, ids), max(len(changed) - 1, 0))
        hit = (changed[at] == ids) if len(changed) else np.zeros(len(ids), bool)
        return np.where(hit, fresh[at] if len(changed) else 0.0, d)
    return read_i, deg_i


def _local_copy(lists, folder: Path, n: int) -> tuple[np.ndarray, np.ndarray]:
    """An engine's lists (EngineColumns) copied into memory-mapped files in `folder`, read in
    ranges of rows (the offline pass reads them at random)."""
    table = lists.rows.table
    w = lists.rows.width
    rows = np.lib.format.open_memmap(folder / "rows.npy", mode="w+", dtype=np.int32, shape=(n, w))
    sims = np.lib.format.open_memmap(folder / "sims.npy", mode="w+", dtype=np.float32, shape=(n, w))
    for a in range(0, n, COPY_BLOCK):
        got = table.read(a, min(a + COPY_BLOCK, n))
        rows[a: a + len(got["rows"])] = got["rows"][:, :w]
        sims[a: a + len(got["sims"])] = got["sims"][:, :w]
    return rows, sims


def _shape(space: MetricSpace, p: DiffusionOfflineParams) -> tuple[int, int]:
    """(T, k) clipped to the gallery: a row holds the item and at most n − 1 others."""
    return max(2, min(p.item_truncation, space.n)), max(2, min(p.k, space.n))


def _lists(space: MetricSpace, p: DiffusionOfflineParams, progress: bool = False):
    """The lists the rows are computed from: T and k entries, and one more for a left-out item."""
    T, k = _shape(space, p)
    return neighbour_lists(space, max(T, k) + 1, progress=progress)


def offline_rows(space: MetricSpace, p: DiffusionOfflineParams, progress: bool = False) -> dict:
    """Every item's offline diffusion row: {"rows": n × T item rows (−1: none), "f": n × T, "deg":
    n × 1, its degree in the mutual k-NN graph (float32, as every solve reads it)}; in the engine
    on a gallery read by row (a collection beside the gallery's)."""
    T, k = _shape(space, p)
    lists = _lists(space, p, progress)
    params = asdict(p) | {"item_truncation": T, "k": k}
    columns = {"rows": (T, "int32"), "f": (T, "float32"), "deg": (1, "float32")}
    state: dict = {}

    def fill(a: int, b: int) -> dict[str, np.ndarray]:
        if not state:  # the first block this call writes: the lists at hand and every item's degree
            if space.holds_gallery:
                read = reader(lists.rows, lists.sims)
            else:
                state["folder"] = tempfile.TemporaryDirectory(prefix="diffusion-offline-")
                read = reader(*_local_copy(lists, Path(state["folder"].name), space.n))
            deg = np.empty(space.n, dtype=np.float32)
            for s in range(0, space.n, BLOCK):
                deg[s: s + BLOCK] = degrees(read, np.arange(s, min(s + BLOCK, space.n)), k, p.gamma)
            state.update(read=read, deg=deg)
        out_r = np.empty((b - a, T), dtype=np.int32)
        out_f = np.empty((b - a, T), dtype=np.float32)
        step = max(1, PART_CELLS // (T * k))

        def part(s: int) -> None:
            e = min(s + step, b)
            r, f = offline_block(state["read"], lambda ids: state["deg"][ids].astype(np.float64), np.arange(s, e),
                                 p, T, k, space.n)
            out_r[s - a: e - a], out_f[s - a: e - a] = r, f
        in_threads(part, range(a, b, step))
        return {"rows": out_r, "f": out_f, "deg": state["deg"][a:b, None]}
    try:
        return space.artefact_in_blocks("diffusion-offline", params, columns, fill, inputs=(lists.digest,),
                                        block=BLOCK, progress=progress)
    finally:
        if "folder" in state:
            state["folder"].cleanup()


def _left_out_rows(space: MetricSpace, p: DiffusionOfflineParams, F: dict, seeds: np.ndarray, i: int,
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The seeds' rows as the gallery without item i has them (a leave-one-out query): solved
    again from the lists with i taken out and the degrees that changes."""
    T, k = _shape(space, p)
    lists = _lists(space, p)
    read = reader(lists.rows, lists.sims)

    def deg_of(ids):
        return np.asarray(F["deg"][ids], dtype=np.float64).reshape(-1)
    if space.holds_gallery:
        ptr, src = reverse_index(space, lists.rows, k, lists.digest)

        def reverse(j: int) -> np.ndarray:
            return src[ptr[j]: ptr[j + 1]]
    else:
        reverse = lists.rows.holding
    k_without = max(2, min(p.k, space.n - 1))
    read_i, deg_i = without_item(read, deg_of, reverse, i, k, k_without, p.gamma)
    return offline_block(read_i, deg_i, seeds, p, max(2, min(T, space.n - 1)), k_without, space.n)


def combined(seed_rows: np.ndarray, seed_f: np.ndarray, w: np.ndarray, drop: int, k: int,
             ) -> tuple[np.ndarray, np.ndarray]:
    """One query's top k of Σ_j w_j F[j, ·] over the items its seeds' rows reach (`seed_rows`,
    `seed_f`: kq × T), item `drop` (a leave-one-out query's own, −1 none) left out; equal scores
    by row (rank.py's sort; the items no row reaches are not ranked)."""
    ids = seed_rows.ravel().astype(np.int64)
    vals = (w[:, None] * seed_f.astype(np.float64)).ravel()
    ok = (ids >= 0) & (ids != drop)
    uniq, back = np.unique(ids[ok], return_inverse=True)
    return _ranked(np.bincount(back, weights=vals[ok], minlength=len(uniq)), uniq, k)


@RERANKERS.register("diffusion_offline", DiffusionOfflineParams, offline=True, depth="kq", by_row=True,
                    grid={"k": (10, 30, 50), "item_truncation": (63, 1000), "gamma": (1.0, 3.0)},
                    prepare=offline_rows)
def diffusion_offline(space: MetricSpace, queries: np.ndarray, first: Hits | None, k: int, *,
                      self_ids: np.ndarray, params: DiffusionOfflineParams) -> Hits:
    """Decoupled diffusion (Yang et al. AAAI 2019): each item diffused offline; a query sums its top kq rows."""
    assert first is not None  # registered with reads_first
    p = params
    F = offline_rows(space, p)
    seeds, s = candidates(first, self_ids, p.kq)
    out_r = np.full((len(queries), k), -1, dtype=np.int64)
    out_s = np.full((len(queries), k), -np.inf, dtype=np.float32)
    found = seeds >= 0
    uniq = np.unique(seeds[found & (self_ids[:, None] < 0)])  # a leave-one-out query's are solved again
    got_r, got_f = F["rows"][uniq], F["f"][uniq]  # every seed row once, read together (by row on an engine)
    place = {int(r): i for i, r in enumerate(uniq)}

    def one(b: int) -> None:
        mine = seeds[b][found[b]]
        if not len(mine):
            return
        w = power(np.maximum(s[b][found[b]].astype(np.float64), 0.0), p.gamma)
        if self_ids[b] >= 0:  # the rows of the gallery without the query's own item
            r_b, f_b = _left_out_rows(space, p, F, mine, int(self_ids[b]))
        else:
            at = [place[int(r)] for r in mine]
            r_b, f_b = got_r[at], got_f[at]
        r, v = combined(r_b, f_b, w, int(self_ids[b]), k)
        out_r[b, : len(r)], out_s[b, : len(r)] = r, v

    def some(a: int) -> None:
        for b in range(a, min(a + 64, len(queries))):
            one(b)
    in_threads(some, range(0, len(queries), 64))
    return space.hits(out_r, out_s)
