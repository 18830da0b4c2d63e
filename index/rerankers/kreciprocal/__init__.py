"""k-reciprocal re-ranking: Zhong, Zheng, Cao, Li, "Re-ranking Person Re-identification with
k-reciprocal Encoding", CVPR 2017, following its official code (github zhunzhong07/
person-re-ranking, python-version/re_ranking_ranklist.py).  Over U = gallery ∪ {p}: R(p, k)
(Eq. 3), R*(p, k) (Eq. 6), V_{p,g_i} (Eq. 7), the local query expansion over N(p, k2) (§4.4),
the Jaccard distance d_J (Eq. 10) and d* = (1 − λ) d_J + λ d (Eq. 12).  Modules:
  paper.py   the algorithm whole, one dense distance matrix per probe (reference, tests)
  scan.py    one pass over the gallery per batch of probes: what the sets read of each row
  sets.py    R, R*, V for a batch of probes, from the gallery's offline sets where possible
  engine.py  d_J and d only where the probe can change them; the offline inverted index
  cache.py   the pair matrix and the λ-free terms kept in the memory cache
  local.py   the variant over each query's own pool (`sets=pool`): what a gallery read by row runs
docs/reranking.md explains the incremental computation and why it equals the dense one."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from core.errors import UserError
from core.params import param

from ...space import Hits, MetricSpace
from ...threads import in_threads
from ..neighbours import extremes_digest, neighbour_lists, reverse_index, row_extremes
from ..registry import AUTO, RERANKERS, WHOLE_GALLERY
from .cache import digest, gallery_similarities, remembered_terms
from .engine import support_index, terms, whole_gallery
from .local import check_pool, rank_pools
from .paper import final_distance
from .scan import ProbeScan
from .sets import ProbeBatch, gallery_sets, gather, reverse_lists

# probes re-ranked together: one pass over the keys and one vectorised pass of the sets.  The set
# work grows faster than the batch (its sorts), the pass's share of the keys shrinks with it: a
# batch reads at most KEY_BYTES of keys per probe, between BATCH and MAX_BATCH probes
BATCH, MAX_BATCH, KEY_BYTES = 32, 256, 1 << 19
TOP_SLACK = 256  # plain-order rows kept per probe beyond k: those d* leaves in the plain order come from them
BRUTE_POOL = 150  # a pool up to this is cheaper ranked candidate by candidate; above, through the inverted index
# `pool=auto` on a gallery read by row (where the sets are taken within each query's pool): the plain
# search's top POOL_BY_ROW (docs/fidelity.md: its MAP@R against the whole-gallery sets)
POOL_BY_ROW = 1000


@dataclass
class KReciprocalParams:
    k1: int = param(20, "k of the k-reciprocal sets R(p, k1); clipped to the gallery", bounds="[1, inf)", size=True)
    k2: int = param(6, "neighbours averaged in the local query expansion of the V vectors (1: none); clipped to the "
                       "gallery", bounds="[1, inf)", size=True)
    lambda_value: float = param(0.3, "λ: d* = (1 − λ) d_Jaccard + λ d_original", bounds="[0, 1]")
    pool: int = param(AUTO, "the query's first-search candidates ranked by d*, clipped to the gallery: all ranks "
                            "every item, as the official code does; a smaller pool is a variant that leaves the rest "
                            f"out; auto: all where the process holds the gallery, the top {POOL_BY_ROW} on a gallery "
                            "read by row", bounds="[1, inf)", named={"all": WHOLE_GALLERY, "auto": AUTO})
    sets: Literal["auto", "gallery", "pool"] = param(
        "auto", "where R, R* and V are taken: gallery, over every item (the official code); pool, a variant, within "
                "the query and its pool only, each distance scaled by its maximum there (it reads only the pool's "
                "rows); auto: gallery where the process holds the gallery, pool on a gallery read by row (Milvus)")

    def validate(self):
        if self.k2 > self.k1 + 1:
            raise UserError(f"kreciprocal: k2 must be in [1, k1 + 1], got {self.k2}")


@RERANKERS.register("kreciprocal", KReciprocalParams, offline=True, reads_first=False, pool="pool",
                    whole_up_to=WHOLE_GALLERY, pool_above=POOL_BY_ROW, by_row=True, whole_when={"sets": ("gallery",)},
                    grid={"k1": (4, 6, 10, 20, 30), "k2": (1, 3, 6), "lambda_value": (0.1, 0.3, 0.5)})
def kreciprocal(space: MetricSpace, queries: np.ndarray, first: Hits | None, k: int, *, self_ids: np.ndarray,
                params: KReciprocalParams) -> Hits:
    """k-reciprocal encoding (Zhong et al. CVPR 2017): Jaccard distance of k-reciprocal sets, d* = (1 − λ) d_J + λ d."""
    p = params
    if p.sets == "pool" or (p.sets == "auto" and not space.holds_gallery):
        return _within_pools(space, queries, k, self_ids, p)
    if not space.holds_gallery:
        raise UserError("kreciprocal: sets=gallery takes every item's k-reciprocal set, which a gallery read by row "
                        "does not give; sets=pool takes them within each query's pool")
    lists = neighbour_lists(space, min(p.k1 + 2, space.n))  # + 1: the item itself, + 1: a leave-one-out row
    extremes = row_extremes(space)
    # a gallery too small for lists of k1 + 2 is small enough to compute every set
    offline = gallery_sets(space, lists, extremes, p.k1) if lists.rows.shape[1] >= p.k1 + 2 else None
    reverse = reverse_lists(space, lists, p.k1) if offline is not None else None
    # every candidate by default (the official code): d* is computed only where it can move; a
    # pool up to BRUTE_POOL is cheaper to rank whole
    pool = max(p.pool, k)
    support = support_index(space, lists, extremes, offline, p.k1, p.k2) if offline and pool > BRUTE_POOL else None
    reverse_k2 = (reverse_index(space, lists.rows, p.k2, lists.digest)
                  if support is not None and p.k2 > 1 else None)
    # the probe's own list N(p, k1 + 1) is read from its candidates; the whole gallery's ranking
    # reads the first k rows of the plain order outside those it computes, TOP_SLACK more kept
    depth = p.k1 + 1 if support is not None else max(pool, p.k1 + 1)
    if support is not None:
        depth = max(depth, min(pool, space.n) if pool < space.n else k + TOP_SLACK)
    depth = min(depth, space.n)
    step = int(np.clip(space.n * space.dim * 4 // KEY_BYTES, BATCH, max(BATCH, MAX_BATCH)))
    starts = range(0, len(queries), step)

    def batch_terms(a: int) -> tuple:
        """One batch's terms, returned (never written into shared state): (pools, d_J, d)."""
        q, own = queries[a: a + step], self_ids[a: a + step]
        # one pass over the gallery: each probe's place in every list, its largest distance, its candidates
        record = None
        if reverse is not None:  # the lists that lose a leave-one-out probe's own row: the probe is put into them
            has = np.flatnonzero(own >= 0)
            ptr, src = reverse[p.k1]
            i, at = gather(ptr, own[has])
            record = (has[i], src[at].astype(np.int64))
        scan = ProbeScan(space, q, own, depth, enter=lists.sims[:, p.k1] if offline is not None else None,
                         floor=extremes["min1"] if support is not None else None, record=record)
        assert scan.t is not None  # a scanned batch (not ProbeScan.none)
        s_qq = np.einsum("qd,qd->q", scan.t, space.key(q))  # the pass's t(q)
        batch = ProbeBatch(space, lists, extremes, scan, s_qq, own, p.k1, offline, reverse)
        if support is not None:
            return whole_gallery(batch, p, support, reverse_k2, k, pool if pool < space.n else None)
        pools = scan.top[:, :pool]
        return (pools, *terms(batch, pools, p))

    def compute() -> dict:
        gallery_similarities(space)  # built once, before the batches share it
        return dict(zip(starts, in_threads(batch_terms, starts), strict=True))  # every batch, combined here

    # d_J and d do not depend on λ: a call that differs from a recent one in λ alone (a sweep over
    # λ, batch after batch) ranks the terms kept from it
    call = {"k1": p.k1, "k2": p.k2, "pool": pool, "k": k, "queries": digest(queries), "self_ids": digest(self_ids)}
    out_r = np.full((len(queries), k), -1, dtype=np.int64)
    out_s = np.full((len(queries), k), -np.inf, dtype=np.float32)
    inputs = (lists.digest, extremes_digest(space))
    for a, (pools, d_j, d_orig) in remembered_terms(space, call, compute, inputs).items():
        d = final_distance(pools, d_j, d_orig, p.lambda_value)
        order = np.argsort(d, axis=1, kind="stable")[:, :k]
        r, dd = np.take_along_axis(pools, order, 1), np.take_along_axis(d, order, 1)
        out_r[a: a + len(r), : r.shape[1]] = np.where(np.isfinite(dd), r, -1)
        out_s[a: a + len(r), : r.shape[1]] = np.where(np.isfinite(dd), 1.0 - dd, -np.inf)  # higher is closer
    return space.hits(out_r, out_s)



def _within_pools(space: MetricSpace, queries: np.ndarray, k: int, self_ids: np.ndarray,
                  p: KReciprocalParams) -> Hits:
    """`sets=pool` (local.py): each query's pool, the plain search's top `pool`, ranked by d*
    taken within it; equal d* keep the plain order."""
    pool = min(max(p.pool, k), space.n)
    check_pool(pool)
    starts = range(0, len(queries), BATCH)

    def batch(a: int) -> tuple[np.ndarray, np.ndarray]:
        first = space.search(queries[a: a + BATCH], pool, exclude=self_ids[a: a + BATCH])
        return first.rows, rank_pools(space, queries[a: a + BATCH], first.rows, p.k1, p.k2, p.lambda_value)

    out_r = np.full((len(queries), k), -1, dtype=np.int64)
    out_s = np.full((len(queries), k), -np.inf, dtype=np.float32)
    for a, (pools, d) in zip(starts, in_threads(batch, starts), strict=True):
        order = np.argsort(d, axis=1, kind="stable")[:, :k]
        r, dd = np.take_along_axis(pools, order, 1), np.take_along_axis(d, order, 1)
        out_r[a: a + len(r), : r.shape[1]] = np.where(np.isfinite(dd), r, -1)
        out_s[a: a + len(r), : r.shape[1]] = np.where(np.isfinite(dd), 1.0 - dd, -np.inf)
    return space.hits(out_r, out_s)
