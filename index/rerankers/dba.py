"""Database-side augmentation (αDBA): Radenović, Tolias, Chum, "Fine-tuning CNN Image Retrieval
with No Human Annotation", TPAMI 2019 (§5, alongside αQE).

Offline, every gallery item is replaced by the normalised, similarity-weighted sum of itself and
its top n neighbours (itself left out of them), with αQE's weights:

    x′ = normalise(x + Σ_{i ≤ n} max(s(x, y_i), 0)^α · y_i)

and queries are searched, unexpanded, against the augmented gallery: s(q, x′) = t(q) · x′.
The augmented keys are cached per (index, strategy, params, mode, n, α).

Leave-one-out: a query that is gallery item i must meet the gallery augmented without i.  The
items whose n neighbours include i (its reverse neighbours) are re-augmented online from their
lists with i removed (which is why lists are stored longer than n + 1), i itself is left out,
and the answer is merged from the cached search and those items' corrected scores: exactly the
augmentation of the gallery without i.

On a gallery read by row (Milvus) the augmented keys are the engine's data: a collection beside
the gallery's, built a block of items at a time from the neighbour lists (`artefact_in_blocks`),
indexed as the gallery is and searched there; the reverse neighbours of a leave-one-out query are
found by the engine (`holding`).  No array of the gallery's size is held in the process.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import faiss
import numpy as np

from core.memory import check_fits

from ..space import Hits, MetricSpace
from .expansion import ExpansionParams, weighted_sum
from .neighbours import neighbour_lists, reverse_index
from .registry import RERANKERS


@dataclass
class DBAParams(ExpansionParams):
    """αDBA's parameters (shared with αQE)."""


def _without_self(rows: np.ndarray, sims: np.ndarray, own: np.ndarray, drop: np.ndarray, n: int):
    """Each item's list with itself (and `drop`, a leave-one-out row, −1 none) removed, cut to n."""
    mask = (rows == own[:, None]) | (rows == drop[:, None])
    order = np.argsort(mask, axis=1, kind="stable")[:, :n]
    r, s = np.take_along_axis(rows, order, 1), np.take_along_axis(sims, order, 1)
    gone = np.take_along_axis(mask, order, 1)  # a list shorter than n + 2 may run out
    return np.where(gone, -1, r), np.where(gone, 0.0, s)


def _augment(space: MetricSpace, own: np.ndarray, nb: np.ndarray, s: np.ndarray, alpha: float) -> np.ndarray:
    return weighted_sum(space, space.gallery_vectors(own), nb, s, alpha)


def augmented(space: MetricSpace, p: DBAParams, progress: bool = False) -> dict[str, np.ndarray]:
    """The cached augmented keys ("keys", n × d) and the neighbours each used ("nb", n × nDBA); on
    a gallery read by row, the engine's columns of them (searched and read by row)."""
    if not space.holds_gallery:
        return _in_engine(space, p, progress)
    size = space.n * (space.dim + p.n) * 4
    check_fits(f"dba: the augmented gallery ({space.n:,} items × {space.dim})", size)
    lists = neighbour_lists(space, p.n + 2)

    def compute():
        rows, sims = lists.rows, lists.sims
        own = np.arange(space.n)
        nb, s = _without_self(rows, sims, own, np.full(space.n, -1), p.n)
        keys = np.empty((space.n, space.dim), dtype=np.float32)
        for a in range(0, space.n, 8192):
            keys[a: a + 8192] = _augment(space, own[a: a + 8192], nb[a: a + 8192], s[a: a + 8192], p.alpha)
        return {"keys": keys, "nb": nb.astype(np.int32)}
    return space.artefact("dba", asdict(p), compute, inputs=(lists.digest,), reserve=size)


def _in_engine(space: MetricSpace, p: DBAParams, progress: bool = False) -> dict:
    """`augmented` on a gallery read by row: built in the engine a block at a time, from each
    block's lists and the vectors of their rows."""
    lists = neighbour_lists(space, p.n + 2, progress=progress)

    def fill(a: int, b: int) -> dict[str, np.ndarray]:
        own = np.arange(a, b)
        nb, s = _without_self(lists.rows[own], lists.sims[own], own, np.full(len(own), -1), p.n)
        return {"nb": nb, "keys": _augment(space, own, nb, s, p.alpha)}
    return space.artefact_in_blocks("dba", asdict(p), {"nb": (p.n, "int64"), "keys": (space.dim, "float32")}, fill,
                                    inputs=(lists.digest,), searched="keys", progress=progress)


def _reverse(space: MetricSpace, p: DBAParams, aug: dict) -> Callable[[int], np.ndarray]:
    """Item i → the items whose nDBA neighbours include i: from the reverse-neighbour lists kept in
    memory (CSR), or on a gallery read by row, asked of the engine."""
    if not space.holds_gallery:
        return aug["nb"].holding
    source = space.digest("dba", asdict(p), (neighbour_lists(space, p.n + 2).digest,))
    ptr, rev = reverse_index(space, aug["nb"], aug["nb"].shape[1], source)
    return lambda i: rev[ptr[i]: ptr[i + 1]]


def _search(keys, t: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The inner-product top k of the augmented keys: FAISS's flat search (what an IndexFlatIP over
    them runs) on the cached array itself, not on a second copy of it; the engine's own search of
    a column it keeps (`nearest`)."""
    if not isinstance(keys, np.ndarray):
        return keys.nearest(t, k)
    return faiss.knn(np.ascontiguousarray(t, dtype=np.float32), keys, k, metric=faiss.METRIC_INNER_PRODUCT)


@RERANKERS.register("dba", DBAParams, offline=True, reads_first=False, by_row=True,
                    grid={"n": (1, 2, 3, 5, 10), "alpha": (0.0, 1.0, 3.0, 5.0)}, prepare=augmented)
def dba(space: MetricSpace, queries: np.ndarray, first: Hits | None, k: int, *, self_ids: np.ndarray,
        params: DBAParams) -> Hits:
    """Database-side augmentation (Radenović et al. TPAMI 2019): search x′ = normalise(x + Σ s(x, yᵢ)^α yᵢ)."""
    aug = augmented(space, params)
    reverse = _reverse(space, params, aug)
    t = space.transform(queries)
    k = min(k, space.n)
    loo = np.flatnonzero(self_ids >= 0)
    plain = np.flatnonzero(self_ids < 0)
    rows = np.full((len(queries), k), -1, dtype=np.int64)
    scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
    if len(plain):
        sc, found = _search(aug["keys"], t[plain], k)
        rows[plain], scores[plain] = found, sc
    if len(loo):
        # one batched scan for every leave-one-out query, deep enough for the one whose item
        # has the most reverse neighbours (each query drops its item and those)
        affected = [reverse(int(i)) for i in self_ids[loo]]
        kk = min(space.n, k + max(len(a) for a in affected) + 1)
        sc, found = _search(aug["keys"], t[loo], kk)
        for j, b in enumerate(loo):
            rows[b], scores[b] = _leave_one_out(space, params, affected[j], t[b], int(self_ids[b]), k,
                                                found[j], sc[j])
    return space.hits(rows, scores)


def _leave_one_out(space: MetricSpace, p: DBAParams, affected: np.ndarray, t: np.ndarray, i: int,
                   k: int, found: np.ndarray, sc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One query's top k against the gallery augmented without item i, from its top
    (k + |reverse neighbours of i (`affected`)| + 1 or more) against the cached augmentation."""
    ok = (found >= 0) & (found != i) & ~np.isin(found, affected)
    rows, scores = found[ok].astype(np.int64), sc[ok].astype(np.float32)
    if len(affected):
        lists, sims, _ = neighbour_lists(space, p.n + 2)
        nb, s = _without_self(lists[affected], sims[affected], affected, np.full(len(affected), i), p.n)
        keys = _augment(space, affected, nb, s, p.alpha)
        rows = np.concatenate([rows, affected])
        scores = np.concatenate([scores, (keys @ t).astype(np.float32)])
    order = np.argsort(-scores, kind="stable")[:k]
    out_r, out_s = np.full(k, -1, dtype=np.int64), np.full(k, -np.inf, dtype=np.float32)
    out_r[: len(order)], out_s[: len(order)] = rows[order], scores[order]
    return out_r, out_s
