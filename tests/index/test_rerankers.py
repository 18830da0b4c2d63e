"""Re-rankers (index/rerankers) against direct numpy implementations of their papers' formulas,
leave-one-out honesty, the offline caches' location and invalidation, and the registry."""
import dataclasses
import importlib.util
import sys
import typing
from pathlib import Path

import numpy as np
import pytest

from core.errors import UserError
from index.backends.search import Searcher
from index.backends.store import Items, read_index, write_index
from index.refinements import refine
from index.rerankers import (
    RERANKERS,
    SIZE_LIMIT,
    WHOLE_GALLERY,
    SearcherSpace,
    check_size_limit,
    gallery_counts,
    rerank,
    resolved,
    size_params,
)
from index.space import CACHE, cache_root

D, K_EMB, N = 16, 6, 150
CASES = [("trained", {}, "cosine"), ("identity", {}, "bilinear"), ("diagonal", {"r": 0.5, "seed": 1}, "bilinear")]
CASE_IDS = ["trained-cosine", "identity-bilinear", "diagonal-indefinite-bilinear"]


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    """Every cache goes under the test's own folder (XDG_CACHE_HOME), never the user's or the repo."""
    home = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    CACHE.clear()  # and no state kept in memory by an earlier test
    return home


def features(n=N, seed=0):
    """Clustered trunk features (classes around centres) and a neck."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(12, D))
    lab = rng.integers(0, 12, n)
    x = (centres[lab] + 0.7 * rng.normal(size=(n, D))).astype(np.float32)
    W = rng.normal(size=(K_EMB, D)).astype(np.float32)
    return x, lab, W


def build(path, x, lab, W, factory=None):
    n = len(x)
    items = Items(np.arange(1000, 1000 + n), lab.astype(np.int64), [f"img/{i}.png" for i in range(n)], ["test"] * n)
    write_index(path, x, items, W, normalize=True, info={"backbone": "synthetic"}, factory=factory)
    return Searcher(read_index(path))


@pytest.fixture
def gallery(tmp_path):
    x, lab, W = features()
    return build(tmp_path / "idx", x, lab, W), x, W


def queries(x, m=6, seed=1):
    rng = np.random.default_rng(seed)
    return (x[rng.choice(len(x), m, replace=False)] + 0.3 * rng.normal(size=(m, D))).astype(np.float32)


# ---------------------------------------------------------------- the reference similarity
class Ref:
    """s(a, b) under M′ in float64, written from the definitions (index/metric.py)."""

    def __init__(self, searcher, strategy, params, mode):
        W = searcher.data.W.astype(np.float64)
        self.M = refine(strategy, W.T @ W, params)
        self.mode = mode
        self.G = np.asarray(searcher.data.features, dtype=np.float64)  # stored: L2-normalised

    def prep(self, q):
        q = np.asarray(q, dtype=np.float64)
        return q / np.linalg.norm(q, axis=1, keepdims=True)

    def mnorm(self, v):
        return np.sqrt(np.maximum(np.einsum("ij,jk,ik->i", v, self.M, v), 0))

    def key(self, v):
        return v / self.mnorm(v)[:, None] if self.mode == "cosine" else v

    def normalise(self, v):
        return self.key(v) if self.mode == "cosine" else v / np.linalg.norm(v, axis=1, keepdims=True)

    def t(self, v):
        return (v @ self.M) / (self.mnorm(v)[:, None] if self.mode == "cosine" else 1.0)

    def s(self, a, b):
        return self.t(a) @ self.key(b).T


def topk(scores, k, exclude=None):
    s = scores.astype(np.float64).copy()
    if exclude is not None:
        s[exclude] = -np.inf
    order = np.argsort(-s, kind="stable")[:k]
    return order, s[order]


def space_for(searcher, strategy, params, mode):
    return SearcherSpace(searcher, strategy, params, mode)


# ---------------------------------------------------------------- none
@pytest.mark.parametrize("strategy,params,mode", CASES, ids=CASE_IDS)
def test_none_is_bit_identical_to_the_plain_search(gallery, strategy, params, mode):
    searcher, x, _ = gallery
    q = queries(x)
    plain = searcher.search(q, strategy, params, mode, k=10)
    got = rerank("none", space_for(searcher, strategy, params, mode), q, 10)
    np.testing.assert_array_equal(got.rows, plain.rows)
    np.testing.assert_array_equal(got.scores, plain.scores)
    assert got.scores.dtype == plain.scores.dtype and got.rows.dtype == plain.rows.dtype


def test_none_returns_the_given_first_search_itself(gallery):
    searcher, x, _ = gallery
    q = queries(x)
    plain = searcher.search(q, "trained", {}, "cosine", k=10)
    assert rerank("none", space_for(searcher, "trained", {}, "cosine"), q, 10, first=plain) is plain


# ---------------------------------------------------------------- αQE
@pytest.mark.parametrize("strategy,params,mode", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("n,alpha", [(2, 3.0), (5, 1.0), (3, 0.0)])
def test_aqe_is_the_papers_formula(gallery, strategy, params, mode, n, alpha):
    searcher, x, _ = gallery
    ref = Ref(searcher, strategy, params, mode)
    q = queries(x)
    got = rerank("aqe", space_for(searcher, strategy, params, mode), q, 10, params={"n": n, "alpha": alpha})
    for i, qi in enumerate(ref.prep(q)):
        s = ref.s(qi[None], ref.G)[0]
        nb, sn = topk(s, n)
        q2 = ref.normalise(ref.key(qi[None]) + (np.maximum(sn, 0) ** alpha) @ ref.key(ref.G[nb]))
        rows, scores = topk(ref.s(q2, ref.G)[0], 10)
        np.testing.assert_array_equal(got.rows[i], rows)
        np.testing.assert_allclose(got.scores[i], scores, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- αDBA
@pytest.mark.parametrize("strategy,params,mode", CASES, ids=CASE_IDS)
def test_dba_is_the_papers_formula(gallery, strategy, params, mode):
    searcher, x, _ = gallery
    ref = Ref(searcher, strategy, params, mode)
    n, alpha = 3, 3.0
    S = ref.s(ref.G, ref.G)
    aug = np.empty_like(ref.G)
    for j in range(N):
        nb, sn = topk(S[j], n, exclude=j)
        aug[j] = ref.normalise(ref.key(ref.G[j:j + 1]) + (np.maximum(sn, 0) ** alpha) @ ref.key(ref.G[nb]))[0]
    q = queries(x)
    got = rerank("dba", space_for(searcher, strategy, params, mode), q, 10, params={"n": n, "alpha": alpha})
    for i, qi in enumerate(ref.prep(q)):
        rows, scores = topk((ref.t(qi[None]) @ aug.T)[0], 10)
        np.testing.assert_array_equal(got.rows[i], rows)
        np.testing.assert_allclose(got.scores[i], scores, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- diffusion
def diffusion_reference(ref, q, k, kq, alpha, gamma):
    """knngraph.m, transition_matrix.m, ymake.m, then f = (I − αS)⁻¹ y by a dense solve."""
    S = ref.s(ref.G, ref.G)
    knn = np.argsort(-S, axis=1, kind="stable")[:, :k]  # each item among its own k
    A = np.zeros_like(S)
    for i in range(N):
        for j in knn[i]:
            if j != i and i in knn[j]:
                A[i, j] = max(S[i, j], 0.0) ** gamma
    d = A.sum(1)
    inv = np.where(d > 0, 1 / np.sqrt(np.where(d > 0, d, 1)), 0)
    T = inv[:, None] * A * inv[None, :]
    s = ref.s(q[None], ref.G)[0]
    y = np.zeros(N)
    top = np.argsort(-s, kind="stable")[:kq]
    y[top] = np.maximum(s[top], 0) ** gamma
    return np.linalg.solve(np.eye(N) - alpha * T, y)


@pytest.mark.parametrize("strategy,params,mode", CASES[:2], ids=CASE_IDS[:2])
def test_diffusion_is_the_dense_solve_of_the_papers_system(gallery, strategy, params, mode):
    searcher, x, _ = gallery
    ref = Ref(searcher, strategy, params, mode)
    p = {"k": 8, "kq": 4, "alpha": 0.9, "gamma": 3.0, "truncation": N, "iterations": 500, "tol": 1e-12}
    q = queries(x)
    got = rerank("diffusion", space_for(searcher, strategy, params, mode), q, 10, params=p)
    for i, qi in enumerate(ref.prep(q)):
        f = diffusion_reference(ref, qi, p["k"], p["kq"], p["alpha"], p["gamma"])
        rows, vals = topk(f, 10)
        np.testing.assert_array_equal(got.rows[i], rows)
        np.testing.assert_allclose(got.scores[i], vals, rtol=1e-4, atol=1e-6 * np.abs(f).max())


def test_diffusion_defaults_to_the_whole_graph_up_to_a_size_and_to_the_official_truncation_above(
        gallery, monkeypatch):
    """truncation=auto: the whole gallery's graph up to `whole_up_to` items (run_test.m on global
    descriptors), each query's graph cut to its top `pool_above` in a larger gallery (run_test.m's
    topn on its large sets); "all" and a number mean the same at every size."""
    from index.rerankers import AUTO, WHOLE_GALLERY, ranked_pool, resolved

    entry = RERANKERS.get("diffusion")
    assert (entry.spec.whole_up_to, entry.spec.pool_above) == (500_000, 10_000)
    assert RERANKERS.params("diffusion", {}).truncation == AUTO
    for n, want in ((500_000, WHOLE_GALLERY), (500_001, 10_000)):
        assert resolved("diffusion", {}, n).truncation == want
        assert resolved("diffusion", {"truncation": "all"}, n).truncation == WHOLE_GALLERY
        assert resolved("diffusion", {"truncation": 60}, n).truncation == 60
    assert ranked_pool("diffusion", {}, 10, 500_001) == 10_000 and ranked_pool("diffusion", {}, 10, 9) == WHOLE_GALLERY
    # the same switch on this gallery of N items, its size lowered below it and raised above it
    searcher, x, _ = gallery
    space, q, p = space_for(searcher, "trained", {}, "cosine"), queries(x), {"k": 8, "kq": 4}
    whole = rerank("diffusion", space, q, 10, params=p | {"truncation": "all"})
    cut = rerank("diffusion", space, q, 10, params=p | {"truncation": 12})
    assert not np.array_equal(whole.rows, cut.rows)  # the premise: the cut changes the answer here
    for up_to, want in ((N, whole), (N - 1, cut)):
        monkeypatch.setitem(RERANKERS._entries, "diffusion", dataclasses.replace(
            entry, spec=dataclasses.replace(entry.spec, whole_up_to=up_to, pool_above=12)))
        got = rerank("diffusion", space, q, 10, params=p)
        np.testing.assert_array_equal(got.rows, want.rows)
        np.testing.assert_array_equal(got.scores, want.scores)


def test_the_mutual_knn_affinity_keeps_mutual_edges_and_no_list_end():
    """knngraph.m's A on a sub-graph: w_ij = max(s_ij, 0)^γ where each of i, j is in the other's
    list, 0 elsewhere; a list that ran out (−1) links to nothing, not to the gallery's last item."""
    from index.rerankers.diffusion import affinity

    n = 6
    sub = np.array([1, 3, 5])  # the gallery's last item (5) is in the sub-graph
    rows = np.array([[3, 5, 0], [1, 2, -1], [3, -1, -1]])
    sims = np.array([[0.9, 0.5, 0.8], [0.7, 0.6, 0.0], [0.4, 0.0, 0.0]], dtype=np.float32)
    place = np.full(n + 1, -1, dtype=np.int32)  # the gallery's n rows, and the −1 entries' place
    A = affinity(sub, rows, sims, 3.0, place).toarray()
    want = np.zeros((3, 3))
    want[0, 1], want[1, 0] = 0.9 ** 3, 0.7 ** 3  # 1 ↔ 3 is mutual; 1 → 5 and 5 → 3 are not
    np.testing.assert_allclose(A, want, rtol=1e-6)
    assert (place == -1).all()
    # without a gallery-sized `place` (a gallery read by row): each neighbour looked up in `sub`
    np.testing.assert_array_equal(affinity(sub, rows, sims, 3.0, None).toarray(), A)


def test_diffusion_with_the_official_settings_stays_near_the_solution(gallery):
    """run_test.m's α = 0.99 and 20 iterations of pcg: close to the exact f where it matters."""
    searcher, x, _ = gallery
    ref = Ref(searcher, "trained", {}, "cosine")
    q = queries(x)
    got = rerank("diffusion", space_for(searcher, "trained", {}, "cosine"), q, 5, params={"k": 8, "kq": 4})
    for i, qi in enumerate(ref.prep(q)):
        f = diffusion_reference(ref, qi, 8, 4, 0.99, 3.0)
        np.testing.assert_allclose(got.scores[i], f[got.rows[i]], rtol=0.05, atol=0.05 * np.abs(f).max())


# ---------------------------------------------------------------- k-reciprocal
def kreciprocal_reference(D, k1, k2, lam):
    """The official code (python-version/re_ranking_ranklist.py), step by step, on a distance
    matrix over [probe, gallery...]; rows normalised by their maximum as the Matlab version does.
    Returns the probe's final distances to the gallery.  A row without a positive distance (an
    indefinite M′ in a small universe; never a Euclidean one) is left unscaled, as ours is."""
    top = D.max(1, keepdims=True)
    original = D / np.where(top > 0, top, 1.0)
    n_all = len(D)
    V = np.zeros_like(original)
    rank = np.argsort(original, axis=1, kind="stable")
    half = int(np.around(k1 / 2.0))
    for i in range(n_all):
        forward = rank[i, :k1 + 1]
        backward = rank[forward, :k1 + 1]
        recip = forward[np.where(backward == i)[0]]
        expansion = recip
        for c in recip:
            cf = rank[c, :half + 1]
            cb = rank[cf, :half + 1]
            c_recip = cf[np.where(cb == c)[0]]
            if len(np.intersect1d(c_recip, recip)) > 2.0 / 3.0 * len(c_recip):
                expansion = np.append(expansion, c_recip)
        expansion = np.unique(expansion)
        w = np.exp(-original[i, expansion])
        V[i, expansion] = w / w.sum()
    if k2 != 1:
        V = np.stack([V[rank[i, :k2]].mean(0) for i in range(n_all)])
    temp_min = np.minimum(V[0][None, :], V).sum(1)
    jaccard = 1 - temp_min / (2 - temp_min)
    final = jaccard * (1 - lam) + original[0] * lam
    return final[1:]


def by_distance(final, s):
    """Rows by d*, equal d* (λ = 0 makes Jaccard ties common) in the first search's order."""
    first = np.argsort(np.argsort(-s, kind="stable"), kind="stable")
    return np.lexsort((first, np.round(final, 9)))


def universe_distances(ref, q):
    """d(x, y) = s(x, x) − s(x, y) over [probe, gallery...]."""
    U = np.vstack([q[None], ref.G])
    S = ref.s(U, U)
    return np.diag(S)[:, None] - S


KR_PATHS = ["candidates", "inverted-index", "inverted-index-pairs-computed"]
KR_PARAMS = [(20, 6, 0.3), (9, 3, 0.5), (10, 1, 0.0)]  # ½·9 rounds to 4 (half to even)
# a Latin square over (path, parameters, case): each pair of the three meets once, in 9 runs, not 27
KR_SQUARE = [(path, *KR_PARAMS[j], *CASES[(i + j) % len(CASES)])
             for i, path in enumerate(KR_PATHS) for j in range(len(KR_PARAMS))]


@pytest.fixture(params=KR_PATHS)
def kr_path(request, monkeypatch):
    """The two ways k-reciprocal ranks a pool: d* candidate by candidate, or (pools above
    BRUTE_POOL, here every pool) the inverted index over the gallery's V vectors; the latter also
    with the probes' rows not kept (a large gallery's), every score beyond the pass's computed."""
    import index.rerankers.kreciprocal as kr

    monkeypatch.setattr(kr, "BRUTE_POOL", 10**9 if request.param == "candidates" else 0)
    monkeypatch.setattr(kr.scan, "DENSE_CELLS", 0 if request.param.endswith("computed") else kr.scan.DENSE_CELLS)
    return request.param


@pytest.mark.parametrize("kr_path,k1,k2,lam,strategy,params,mode", KR_SQUARE, indirect=["kr_path"],
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{c[3]}-{CASE_IDS[CASES.index(c[4:])]}" for c in KR_SQUARE])
def test_kreciprocal_is_the_official_algorithm_with_the_full_pool(gallery, kr_path, strategy, params, mode, k1, k2,
                                                                  lam):
    searcher, x, _ = gallery
    ref = Ref(searcher, strategy, params, mode)
    q = np.vstack([queries(x), -x[:2]])  # and two outliers: the farthest item of many rows
    got = rerank("kreciprocal", space_for(searcher, strategy, params, mode), q, 10,
                 params={"k1": k1, "k2": k2, "lambda_value": lam})  # the default pool: every item
    for i, qi in enumerate(ref.prep(q)):
        final = kreciprocal_reference(universe_distances(ref, qi), k1, k2, lam)
        rows = by_distance(final, ref.s(qi[None], ref.G)[0])[:10]
        np.testing.assert_array_equal(got.rows[i], rows)
        np.testing.assert_allclose(got.scores[i], 1 - final[rows], rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy,params,mode", CASES, ids=CASE_IDS)
def test_kreciprocal_dense_reference_is_the_official_code_and_the_engine_is_it(gallery, strategy, params, mode):
    """kreciprocal/paper.py computes the whole universe as the official code does; the incremental
    engine gives its ranking and d*, plain probes and leave-one-out ones alike."""
    from index.rerankers.kreciprocal.paper import dense

    searcher, x, _ = gallery
    ref = Ref(searcher, strategy, params, mode)
    space = space_for(searcher, strategy, params, mode)
    q = np.vstack([queries(x, 3), x[[5, 60]]])
    own = np.array([-1, -1, -1, 5, 60])
    d_star = dense(space, space.prepare(q), own, 10, 3, 0.3)
    for i, qi in enumerate(ref.prep(q[:3])):
        np.testing.assert_allclose(d_star[i], kreciprocal_reference(universe_distances(ref, qi), 10, 3, 0.3),
                                   rtol=0, atol=1e-5)
    assert np.isinf(d_star[3, 5]) and np.isinf(d_star[4, 60]) and np.isfinite(np.delete(d_star[3], 5)).all()
    got = rerank("kreciprocal", space, q, 10, params={"k1": 10, "k2": 3, "lambda_value": 0.3}, self_ids=own)
    for i, qi in enumerate(ref.prep(q)):
        rows = by_distance(d_star[i], ref.s(qi[None], ref.G)[0])[:10]
        np.testing.assert_array_equal(got.rows[i], rows)
        np.testing.assert_allclose(got.scores[i], 1 - d_star[i, rows], rtol=0, atol=1e-5)


@pytest.mark.parametrize("k1", [39, 40, 60])
def test_kreciprocal_with_k1_as_large_as_the_gallery(tmp_path, kr_path, k1):
    """Lists as long as the gallery (k1 + 1 ≥ n): every set is the official code's still."""
    x, lab, W = features(n=40, seed=3)
    searcher = build(tmp_path / "small", x, lab, W)
    ref = Ref(searcher, "trained", {}, "cosine")
    q = np.vstack([queries(x, 3), -x[:1]])
    got = rerank("kreciprocal", space_for(searcher, "trained", {}, "cosine"), q, 10, params={"k1": k1, "k2": 4})
    for i, qi in enumerate(ref.prep(q)):
        final = kreciprocal_reference(universe_distances(ref, qi), min(k1, 40), 4, 0.3)
        rows = by_distance(final, ref.s(qi[None], ref.G)[0])[:10]
        np.testing.assert_array_equal(got.rows[i], rows)
        np.testing.assert_allclose(got.scores[i], 1 - final[rows], rtol=0, atol=1e-5)


@pytest.mark.parametrize("pool", [25, 12])  # 12 < k1 + 1: the probe's own list still reads k1 + 1 candidates
def test_kreciprocal_pool_limits_what_is_ranked_not_how(gallery, kr_path, pool):
    """With a pool smaller than the gallery, each candidate's d* is still the full computation's."""
    searcher, x, _ = gallery
    ref = Ref(searcher, "trained", {}, "cosine")
    q = queries(x)
    got = rerank("kreciprocal", space_for(searcher, "trained", {}, "cosine"), q, 10, params={"pool": pool})
    for i, qi in enumerate(ref.prep(q)):
        final = kreciprocal_reference(universe_distances(ref, qi), 20, 6, 0.3)
        cand, _ = topk(ref.s(qi[None], ref.G)[0], pool)
        order = np.lexsort((np.arange(pool), np.round(final[cand], 9)))[:10]
        np.testing.assert_array_equal(got.rows[i], cand[order])
        np.testing.assert_allclose(got.scores[i], 1 - final[cand[order]], rtol=0, atol=1e-5)


@pytest.mark.parametrize("strategy,params,mode", CASES, ids=CASE_IDS)
def test_kreciprocal_within_pools_is_the_official_algorithm_on_each_pool(gallery, strategy, params, mode):
    """`sets=pool`: the official code run on the universe [probe, its plain top `pool`] (rows
    scaled within it), plain and leave-one-out probes; with every item in the pool, the paper's
    whole-gallery answer."""
    searcher, x, _ = gallery
    ref = Ref(searcher, strategy, params, mode)
    space = space_for(searcher, strategy, params, mode)
    q = np.vstack([queries(x, 4), x[[5, 60]]])
    own = np.array([-1, -1, -1, -1, 5, 60])
    for pool in (30, 12):  # 12 < k1 + 1: R(p, k1) is every item of the universe
        got = rerank("kreciprocal", space, q, 10, params={"sets": "pool", "pool": pool, "k1": 20, "k2": 6},
                     self_ids=own)
        for i, qi in enumerate(ref.prep(q)):
            cand, _ = topk(ref.s(qi[None], ref.G)[0], pool, exclude=own[i] if own[i] >= 0 else None)
            U = np.vstack([qi[None], ref.G[cand]])
            S = ref.s(U, U)
            final = kreciprocal_reference(np.diag(S)[:, None] - S, 20, 6, 0.3)
            order = np.lexsort((np.arange(pool), np.round(final, 9)))[:10]
            np.testing.assert_array_equal(got.rows[i], cand[order])
            np.testing.assert_allclose(got.scores[i], 1 - final[order], rtol=0, atol=1e-5)
    whole = rerank("kreciprocal", space, q[:4], 10, params={"sets": "pool", "pool": "all", "k1": 10, "k2": 3})
    paper = rerank("kreciprocal", space, q[:4], 10, params={"sets": "gallery", "k1": 10, "k2": 3})
    np.testing.assert_array_equal(whole.rows, paper.rows)
    np.testing.assert_allclose(whole.scores, paper.scores, rtol=0, atol=1e-5)


def test_kreciprocal_within_pools_refuses_a_pool_too_large_to_hold(gallery, monkeypatch):
    from index.rerankers.kreciprocal import local

    searcher, x, _ = gallery
    monkeypatch.setattr(local, "MAX_POOL", 50)
    with pytest.raises(UserError, match=r"^kreciprocal: sets=pool ranks each query's pool as one dense matrix: "
                                        r"give pool ≤ 50 \(got 51\)$"):
        rerank("kreciprocal", space_for(searcher, "trained", {}, "cosine"), queries(x), 10,
               params={"sets": "pool", "pool": 51})


def test_kreciprocal_reads_by_row_unless_its_sets_are_the_gallery():
    """Its default reads by row (the sets within each query's pool there: `auto` is the top
    POOL_BY_ROW); sets=gallery asks for the paper's whole-gallery sets, on a space that holds them."""
    from index.rerankers import reads_by_row
    from index.rerankers.kreciprocal import POOL_BY_ROW

    assert reads_by_row("kreciprocal") and reads_by_row("kreciprocal", {"sets": "pool"})
    assert not reads_by_row("kreciprocal", {"sets": "gallery"})
    assert resolved("kreciprocal", {}, 10**7).pool == WHOLE_GALLERY  # in a process that holds the gallery: all
    assert resolved("kreciprocal", {}, 10**7, whole=False).pool == POOL_BY_ROW


def test_kreciprocal_distance_is_the_official_one_for_normalised_features(gallery):
    """Cosine mode under M′ = I on L2-normalised features: d(x, y) = s(x, x) − s(x, y), row-
    normalised, equals the code's squared Euclidean distance, row-normalised."""
    searcher, x, _ = gallery
    ref = Ref(searcher, "identity", {}, "cosine")
    q = ref.prep(queries(x))[0]
    ours = universe_distances(ref, q)
    U = np.vstack([q[None], ref.G])
    sq = ((U[:, None, :] - U[None, :, :]) ** 2).sum(-1)
    np.testing.assert_allclose(ours / ours.max(1, keepdims=True), sq / sq.max(1, keepdims=True), atol=1e-6)


@pytest.mark.parametrize("mode", ["cosine", "bilinear"])
def test_kreciprocal_offline_sets_change_nothing(tmp_path, monkeypatch, mode):
    """Reusing the gallery-only sets where the probe changes no list they read gives the answer
    of computing every set afresh, for plain and leave-one-out queries."""
    import index.rerankers.kreciprocal as kr

    x, lab, W = features(n=500, seed=3)
    searcher = build(tmp_path / "idx", x, lab, W)
    own = np.concatenate([[-1, -1, -1], np.arange(0, 500, 2)])  # leave-one-out queries: many lists lose a row
    q = np.vstack([queries(x, 3, seed=4), x[own[3:]]])
    p = {"k1": 12, "k2": 4, "pool": 80}
    fast = rerank("kreciprocal", space_for(searcher, "trained", {}, mode), q, 20, params=p, self_ids=own)
    monkeypatch.setattr(kr, "gallery_sets", lambda *a, **k: None)
    CACHE.clear()  # the terms too: computed again without the offline sets
    slow = rerank("kreciprocal", space_for(searcher, "trained", {}, mode), q, 20, params=p, self_ids=own)
    np.testing.assert_array_equal(fast.rows, slow.rows)
    np.testing.assert_allclose(fast.scores, slow.scores, rtol=0, atol=1e-6)


@pytest.mark.parametrize("whole", [False, True], ids=["pool", "whole-gallery"])
def test_kreciprocal_batches_in_threads_and_the_pair_lookup_change_nothing(tmp_path, monkeypatch, whole):
    """Batches re-ranked in parallel threads, with the missing pairs read from the gallery's
    similarity matrix, give the sequential answer that computes each pair from the keys."""
    import faiss

    import index.rerankers.kreciprocal as kr

    x, lab, W = features(n=400, seed=5)
    searcher = build(tmp_path / "idx", x, lab, W)
    own = np.concatenate([[-1, -1], np.arange(0, 400, 3)])
    q = np.vstack([queries(x, 2, seed=6), x[own[2:]]])
    assert len(q) > 3 * kr.BATCH  # several batches
    p = {"k1": 12, "k2": 4} if whole else {"k1": 12, "k2": 4, "pool": 60}
    if whole:  # the whole gallery through the inverted index, built in threads too
        monkeypatch.setattr(kr, "BRUTE_POOL", 0)
    before = faiss.omp_get_max_threads()
    fast, slow = space_for(searcher, "trained", {}, "cosine"), space_for(searcher, "trained", {}, "cosine")
    try:
        faiss.omp_set_num_threads(2)
        threaded = rerank("kreciprocal", fast, q, 20, params=p, self_ids=own)
        faiss.omp_set_num_threads(1)
        assert fast.held("kreciprocal-pairs")
        CACHE.clear()
        monkeypatch.setattr(kr.cache, "PAIR_SHARE", 1 << 62)  # no pair matrix: every missing pair from the keys
        seq = rerank("kreciprocal", slow, q, 20, params=p, self_ids=own)
    finally:
        faiss.omp_set_num_threads(before)
    assert not slow.held("kreciprocal-pairs")
    np.testing.assert_array_equal(threaded.rows, seq.rows)
    np.testing.assert_allclose(threaded.scores, seq.scores, rtol=0, atol=1e-6)


def test_kreciprocal_candidates_are_each_rows_exact_top():
    """The candidates from the probe's full similarity row: a sampled threshold then a sort, the
    probe's own column left out; a row whose best entries the sample misses is partitioned whole."""
    from index.rerankers.kreciprocal.sets import top_rows

    rng = np.random.default_rng(0)
    S = rng.normal(size=(6, 20000)).astype(np.float32)
    S[1, ::4] += 5.0  # the sample (every 4th column) is all of row 1's best: its threshold is too high
    S[2] = np.round(S[2], 1)  # ties: the lower column first
    own = np.array([-1, 3, int(np.argmax(S[2])), -1, 7, int(np.argsort(-S[5])[40])])
    got = top_rows(S, own, 100)
    for b in range(6):
        order = [c for c in np.argsort(-S[b], kind="stable") if c != own[b]][:100]
        np.testing.assert_array_equal(got[b], order)


@pytest.mark.parametrize("ties", [False, True], ids=["scores", "tied-scores"])
@pytest.mark.parametrize("width", [3, 10**6], ids=["blocks-of-3", "one-block"])
@pytest.mark.parametrize("dense", [True, False], ids=["rows-kept", "pairs-computed"])
@pytest.mark.parametrize("depth", [1, 7, 40, 149, 150])
def test_the_probe_scan_keeps_what_the_whole_rows_give(tmp_path, monkeypatch, depth, dense, width, ties):
    """One blocked pass over the gallery (blocks of 3 rows here, so that a row's best are cut back
    many times) keeps each probe's best rows (own row out, ties: the lower row first), the rows
    whose list it enters, those it is below the least similarity of, and its least similarity:
    those of its whole row; any other score is read from the kept rows or computed."""
    import index.rerankers.kreciprocal.scan as sc
    from index.rerankers.kreciprocal.sets import top_rows

    x, lab, W = features(seed=7)
    x[100:120] = x[80:100]  # equal items: tied scores
    if ties:  # small integer features: inner products tie everywhere, at every depth's boundary
        x = np.random.default_rng(3).integers(0, 3, x.shape).astype(np.float32)
    searcher = build(tmp_path / "idx", x, lab, W)
    space = space_for(searcher, "identity", {}, "bilinear")
    q = space.prepare(np.vstack([queries(x, 4, seed=8), x[[3, 85, 110]]]))
    own = np.array([-1, -1, -1, -1, 3, 85, 110])
    S = space.score(q)
    rng = np.random.default_rng(0)
    enter = np.quantile(S, 0.9, axis=0) + rng.normal(0, 0.01, space.n).astype(np.float32)
    floor = (np.quantile(S, 0.1, axis=0) + rng.normal(0, 0.01, space.n)).astype(np.float32)  # off any score
    monkeypatch.setattr(sc, "SCAN_CELLS", width * len(q))
    monkeypatch.setattr(sc, "DENSE_CELLS", 10**9 if dense else 0)
    scan = sc.ProbeScan(space, q, own, depth, enter=enter, floor=floor)
    assert (scan.S is not None) == dense
    np.testing.assert_array_equal(scan.top, top_rows(S, own, depth))
    # a BLAS product over a block of rows may round a score 1 ulp off the whole product's (the kernels sum in
    # another order on some CPUs): the rows are the same, the scores equal to float32's precision
    close = {"rtol": 1e-6, "atol": 2e-7}
    np.testing.assert_allclose(scan.top_s, np.where(scan.top >= 0, np.take_along_axis(S, np.maximum(scan.top, 0), 1),
                                                    -np.inf), **close)
    b, g, s = scan.entered
    want_b, want_g = np.nonzero(S >= enter)
    assert sorted(zip(b.tolist(), g.tolist(), strict=True)) == list(zip(want_b.tolist(), want_g.tolist(), strict=True))
    np.testing.assert_allclose(s, S[b, g], **close)
    assert scan.below is not None
    np.testing.assert_array_equal(np.stack(scan.below.pairs()), np.stack(np.nonzero(S < floor)))
    masked = S.copy()
    masked[np.flatnonzero(own >= 0), own[own >= 0]] = np.inf
    np.testing.assert_allclose(scan.q_min, masked.min(1), **close)
    bb, gg = np.divmod(rng.choice(S.size, 300, replace=False), space.n)  # recorded or computed alike
    np.testing.assert_allclose(scan.at(bb, gg), S[bb, gg], rtol=1e-5, atol=1e-6)
    if not dense:  # the pairs read later for a decision are the pass's own scores, recorded
        recorded = sc.ProbeScan(space, q, own, depth, enter=enter, floor=floor, record=(bb, gg))
        lb, lg = scan.below.pairs()
        for wb, wg in ((bb, gg), (lb, lg)):
            np.testing.assert_allclose(recorded.at(wb, wg), S[wb, wg], **close)


def test_pairs_are_the_boolean_matrix_they_stand_for():
    from index.rerankers.kreciprocal.scan import Pairs

    rng = np.random.default_rng(0)
    A, B = rng.random((5, 30)) < 0.2, rng.random((5, 30)) < 0.2
    pa, pb = Pairs.of(*np.nonzero(A), 30), Pairs.of(*np.nonzero(B), 30)
    for got, want in ((pa | pb, A | B), (pa & pb, A & B), (pa - pb, A & ~B)):
        np.testing.assert_array_equal(np.stack(got.pairs()), np.stack(np.nonzero(want)))
        assert len(got) == want.sum()
    b, g = np.divmod(np.arange(150), 30)
    np.testing.assert_array_equal(pa.has(b, g), A.ravel())
    assert not Pairs.of([], [], 30).has(b, g).any()


def test_kreciprocal_rows_past_the_scans_best_come_from_the_whole_row(gallery, monkeypatch):
    """Where a probe's best rows run out before its first k outside the d*-computed ones are
    found (no slack kept), those come from its whole row: the same ranking."""
    import index.rerankers.kreciprocal as kr
    from index.rerankers.kreciprocal.scan import ProbeScan

    monkeypatch.setattr(kr, "BRUTE_POOL", 0)  # the whole gallery through the inverted index
    searcher, x, _ = gallery
    q, own = np.vstack([queries(x, 4), x[:6]]), np.concatenate([np.full(4, -1), np.arange(6)])
    p = {"k1": 10, "k2": 3}
    want = rerank("kreciprocal", space_for(searcher, "trained", {}, "cosine"), q, 30, params=p, self_ids=own)
    CACHE.clear()
    rows, whole = ProbeScan.row, []
    monkeypatch.setattr(kr, "TOP_SLACK", 0)
    monkeypatch.setattr(kr.scan, "DENSE_CELLS", 0)  # the whole row from a pass of its own
    monkeypatch.setattr(ProbeScan, "row", lambda self, b: whole.append(b) or rows(self, b))
    got = rerank("kreciprocal", space_for(searcher, "trained", {}, "cosine"), q, 30, params=p, self_ids=own)
    assert len(whole) > 0
    np.testing.assert_array_equal(got.rows, want.rows)
    np.testing.assert_allclose(got.scores, want.scores, rtol=0, atol=1e-6)


def check_universes(space, ref, q, own, k1):
    """For each probe (a leave-one-out one too), every node's R(x, k1), R(x, ½k1) (offline sets
    reused where the probe changes nothing) and largest distance are those of the universe
    (gallery − own row) ∪ {probe}, written from its distance matrix."""
    import index.rerankers.kreciprocal.sets as kr
    from index.rerankers.kreciprocal.paper import half
    from index.rerankers.neighbours import neighbour_lists, row_extremes

    n = space.n
    lists = neighbour_lists(space, k1 + 2)
    extremes = row_extremes(space)
    offline, reverse = kr.gallery_sets(space, lists, extremes, k1), kr.reverse_lists(space, lists, k1)
    from index.rerankers.kreciprocal.scan import ProbeScan

    q = space.prepare(q)
    scan = ProbeScan(space, q, own, n, enter=lists[1][:, k1], floor=extremes["min1"])
    s_qq = np.einsum("qd,qd->q", space.transform(q), space.key(q))
    batch = kr.ProbeBatch(space, lists, extremes, scan, s_qq, own, k1,
                          offline, reverse)
    for b, (qb, i) in enumerate(zip(ref.prep(q), own, strict=True)):
        keep = np.flatnonzero(np.arange(n) != i)                 # universe: [probe, gallery rows in keep]
        U = np.vstack([qb[None], ref.G[keep]])
        S = ref.s(U, U)
        Dm = np.diag(S)[:, None] - S
        rank = np.argsort(Dm, axis=1, kind="stable")
        code = np.concatenate([[b * (n + 1) + n], b * (n + 1) + keep])  # the batch's codes of the universe
        np.testing.assert_allclose(batch.row_max(code), Dm.max(1), rtol=1e-5, atol=1e-6)
        for k in (k1, half(k1)):
            got = batch.reciprocal(code, k)
            for u in range(len(U)):
                want = {code[j] for j in rank[u, :k + 1] if u in rank[j, :k + 1]}
                assert set(got[u][got[u] >= 0].tolist()) == want, (b, u, k)


@pytest.mark.parametrize("strategy,params,mode", CASES, ids=CASE_IDS)
def test_kreciprocal_sets_and_row_maxima_are_the_universes(gallery, strategy, params, mode):
    searcher, x, _ = gallery
    own = np.concatenate([np.full(4, -1), np.arange(0, N, 5), [1, 2, 3]])
    rng = np.random.default_rng(5)
    # plain probes, two outliers (the farthest item of many rows), leave-one-out probes equal to
    # their item and three that are not (their item's row minimum is then no longer theirs)
    q = np.vstack([queries(x, 2), -x[:2], x[own[4:-3]], x[1:4] + 0.5 * rng.normal(size=(3, D))])
    check_universes(space_for(searcher, strategy, params, mode), Ref(searcher, strategy, params, mode), q, own, 10)


def test_kreciprocal_sets_when_a_removed_row_lets_an_entry_in(tmp_path):
    """A leave-one-out probe away from its item: lists that lose the item take in their next
    entry, whose R(·, k) can gain a member (a gallery where that happens)."""
    from index.backends.store import in_memory_index

    rng = np.random.default_rng(0)
    n, d = 40, 3
    x = (rng.normal(size=(4, d))[rng.integers(0, 4, n)] + 0.8 * rng.normal(size=(n, d))).astype(np.float32)
    W = rng.normal(size=(3, d)).astype(np.float32)
    searcher = Searcher(in_memory_index(x, np.zeros(n, dtype=np.int64), W))
    q = x + 0.5 * rng.normal(size=x.shape).astype(np.float32)
    check_universes(space_for(searcher, "identity", {}, "cosine"), Ref(searcher, "identity", {}, "cosine"), q,
                    np.arange(n), 4)


# ---------------------------------------------------------------- leave-one-out
LOO = [("aqe", {"n": 3}), ("kreciprocal", {"k1": 10, "k2": 4, "pool": 40}), ("kreciprocal", {}),
       ("dba", {"n": 3}), ("diffusion", {"k": 8, "kq": 4, "truncation": 60}), ("diffusion", {"k": 8, "kq": 4}),
       ("diffusion_offline", {"k": 8, "kq": 4, "item_truncation": 40}), ("diffusion_offline", {"k": 8}), ("none", {})]


def assert_as_if_left_out(tmp_path, name, rparams, x, lab, W, own, k, strategy="trained", params=None,
                          mode="cosine"):
    """Each gallery item of `own`, as a query with self_ids, gets the answer of the gallery built
    without it (rows mapped back to the full gallery's)."""
    params = params or {}
    full = build(tmp_path / "full", x, lab, W)
    got = rerank(name, space_for(full, strategy, params, mode), x[own], k, params=rparams, self_ids=own)
    for qi, i in enumerate(own):
        keep = np.arange(len(x)) != i
        alone = build(tmp_path / f"without{i}", x[keep], lab[keep], W)
        want = rerank(name, space_for(alone, strategy, params, mode), x[i:i + 1], k, params=rparams)
        np.testing.assert_array_equal(got.rows[qi], np.nonzero(keep)[0][want.rows[0]])
        np.testing.assert_allclose(got.scores[qi], want.scores[0], rtol=1e-4, atol=1e-5)
        assert i not in got.rows[qi]


@pytest.mark.parametrize("strategy,params,mode", CASES[:2], ids=CASE_IDS[:2])
@pytest.mark.parametrize("name,rparams", LOO, ids=[f"{n}-{i}" for i, (n, _) in enumerate(LOO)])
def test_a_gallery_item_as_query_is_reranked_as_if_it_were_not_in_the_gallery(tmp_path, name, rparams, strategy,
                                                                                params, mode):
    x, lab, W = features()
    assert_as_if_left_out(tmp_path, name, rparams, x, lab, W, np.array([3, 40, 77, 149]), 10, strategy, params, mode)


def test_diffusion_batches_in_threads_change_nothing(tmp_path, monkeypatch):
    """The whole-gallery diffusion's query batches solved in parallel threads give the
    sequential answer, leave-one-out rows among them."""
    import faiss

    import index.rerankers.diffusion as dif

    x, lab, W = features(n=300, seed=5)
    searcher = build(tmp_path / "idx", x, lab, W)
    own = np.concatenate([[-1, -1], np.arange(0, 300, 29)])
    q = np.vstack([queries(x, 2, seed=6), x[own[2:]]])
    monkeypatch.setattr(dif, "BATCH_CELLS", 3 * 300)  # batches of 3 queries
    before = faiss.omp_get_max_threads()
    try:
        faiss.omp_set_num_threads(2)
        threaded = rerank("diffusion", space_for(searcher, "trained", {}, "cosine"), q, 20, params={"k": 10},
                          self_ids=own)
        faiss.omp_set_num_threads(1)
        CACHE.clear()
        seq = rerank("diffusion", space_for(searcher, "trained", {}, "cosine"), q, 20, params={"k": 10},
                     self_ids=own)
    finally:
        faiss.omp_set_num_threads(before)
    np.testing.assert_array_equal(threaded.rows, seq.rows)
    np.testing.assert_array_equal(threaded.scores, seq.scores)


@pytest.mark.parametrize("rparams", [{"k": 19}, {"k": 20}, {}], ids=["k=n-1", "k=n", "default-k-above-n"])
def test_diffusion_leave_one_out_on_a_gallery_no_larger_than_k(tmp_path, rparams):
    """Neighbour lists as long as the gallery keep the left-out item at their end; it is gone all the same."""
    x, lab, W = features(20, seed=3)
    assert_as_if_left_out(tmp_path, "diffusion", rparams, x, lab, W, np.array([0, 7, 19]), 5)


@pytest.mark.parametrize("dense", [True, False], ids=["rows-kept", "pairs-computed"])
@pytest.mark.parametrize("rparams", [{"k1": 10, "k2": 4}, {"k1": 10, "k2": 4, "pool": 40}, {"k2": 1}])
def test_kreciprocal_leave_one_out_through_the_inverted_index(tmp_path, monkeypatch, rparams, dense):
    """The inverted-index path (every pool here), a gallery item as query: the answer of the
    gallery without it, the probes' rows kept whole or not."""
    import index.rerankers.kreciprocal as kr

    monkeypatch.setattr(kr, "BRUTE_POOL", 0)
    monkeypatch.setattr(kr.scan, "DENSE_CELLS", kr.scan.DENSE_CELLS if dense else 0)
    x, lab, W = features()
    assert_as_if_left_out(tmp_path, "kreciprocal", rparams, x, lab, W, np.array([3, 40, 77, 149]), 10)


def test_kreciprocal_a_sweep_over_lambda_reuses_the_terms(gallery, monkeypatch):
    """Calls that differ in λ alone rank the kept d_J and d again: the same answer as computed afresh."""
    import index.rerankers.kreciprocal as kr

    searcher, x, _ = gallery
    space = space_for(searcher, "trained", {}, "cosine")
    q, own = x[:20], np.arange(20)
    first = rerank("kreciprocal", space, q, 10, params={"lambda_value": 0.3}, self_ids=own)
    calls, terms = [], kr.terms
    monkeypatch.setattr(kr, "terms", lambda *a: calls.append(1) or terms(*a))
    again = rerank("kreciprocal", space, q, 10, params={"lambda_value": 0.7}, self_ids=own)
    assert not calls  # nothing recomputed
    CACHE.clear()
    fresh = rerank("kreciprocal", space_for(searcher, "trained", {}, "cosine"), q, 10,
                   params={"lambda_value": 0.7}, self_ids=own)
    assert calls  # computed again once the memory cache is emptied
    np.testing.assert_array_equal(again.rows, fresh.rows)
    np.testing.assert_array_equal(again.scores, fresh.scores)
    assert not np.array_equal(first.scores, again.scores)


def test_self_ids_accepts_a_first_search_that_holds_the_query(gallery):
    searcher, x, _ = gallery
    space = space_for(searcher, "trained", {}, "cosine")
    own = np.array([5, 6])
    plain = searcher.search(x[own], "trained", {}, "cosine", k=60)  # holds each query's own row
    assert (plain.rows[:, 0] == own).all()
    for name in ("none", "aqe", "kreciprocal"):
        with_first = rerank(name, space, x[own], 10, self_ids=own, first=plain)
        alone = rerank(name, space, x[own], 10, self_ids=own)
        np.testing.assert_array_equal(with_first.rows, alone.rows)
        assert not (with_first.rows == own[:, None]).any()


@pytest.mark.parametrize("name", ["none", "aqe", "dba", "kreciprocal", "diffusion"])
def test_rerankers_run_on_an_approximate_index(tmp_path, name):
    x, lab, W = features()
    searcher = build(tmp_path / "hnsw", x, lab, W, factory="HNSW16")
    assert not searcher.exact
    own = np.array([2, 50, -1])
    q = np.vstack([x[own[:2]], queries(x, 1)])
    got = rerank(name, space_for(searcher, "trained", {}, "cosine"), q, 8, self_ids=own)
    assert got.rows.shape == (3, 8) and (got.rows >= 0).all()
    assert not (got.rows[:2] == own[:2, None]).any()
    assert all(len(set(r)) == 8 for r in got.rows.tolist())


def test_self_ids_are_checked(gallery):
    searcher, x, _ = gallery
    space = space_for(searcher, "trained", {}, "cosine")
    with pytest.raises(UserError, match="self_ids must be gallery rows"):
        rerank("aqe", space, x[:2], 5, self_ids=[0, N])
    with pytest.raises(UserError, match="one row per query"):
        rerank("aqe", space, x[:2], 5, self_ids=[0])


# ---------------------------------------------------------------- caches
@pytest.mark.parametrize("name", ["dba", "kreciprocal", "diffusion"])
def test_offline_caches_live_outside_the_index_and_leave_it_verifiable(tmp_path, cache_home, name):
    x, lab, W = features()
    searcher = build(tmp_path / "idx", x, lab, W)
    before = sorted(p.name for p in (tmp_path / "idx").iterdir())
    space = space_for(searcher, "trained", {}, "cosine")
    rerank(name, space, queries(x), 5)
    assert sorted(p.name for p in (tmp_path / "idx").iterdir()) == before
    read_index(tmp_path / "idx", verify=True)  # every checksum still holds
    root = cache_root()
    assert root == cache_home / "dml-retrieval" / "rerank"
    files = sorted(p for p in root.rglob("*") if p.is_file())
    assert files and all(p.suffix in (".npz", ".npy", ".json") for p in files)
    assert all(space.cache_key in p.parts for p in files)
    npz = [p for p in files if p.suffix == ".npz"]
    assert npz and all(len(np.load(p, allow_pickle=False).files) for p in npz)  # readable without pickle
    npy = [p for p in files if p.suffix == ".npy"]  # the neighbour lists: memory-mapped arrays
    assert npy and all(np.load(p, allow_pickle=False).size for p in npy)


def test_a_cache_inside_the_index_folder_is_refused(tmp_path):
    x, lab, W = features()
    searcher = build(tmp_path / "idx", x, lab, W)
    space = SearcherSpace(searcher, "trained", {}, "cosine", cache_dir=tmp_path / "idx" / "cache")
    with pytest.raises(UserError, match="inside the index folder"):
        rerank("dba", space, queries(x), 5)
    assert not (tmp_path / "idx" / "cache").exists()


def test_changing_the_index_changes_the_cache_key_and_the_answer_follows(tmp_path, cache_home):
    x, lab, W = features(n=N + 20)
    path = tmp_path / "idx"
    q = queries(x[:N])
    first = space_for(build(path, x[:N], lab[:N], W), "trained", {}, "cosine")
    rerank("kreciprocal", first, q, 10)
    rerank("dba", first, q, 10)
    grown = space_for(build(path, x, lab, W), "trained", {}, "cosine")  # items added in place
    assert grown.cache_key != first.cache_key
    got = {n: rerank(n, grown, q, 10) for n in ("kreciprocal", "dba")}
    dirs = {p.name for p in cache_root().iterdir()}
    assert dirs == {first.cache_key, grown.cache_key}
    fresh_home = tmp_path / "fresh"
    fresh = SearcherSpace(Searcher(read_index(path)), "trained", {}, "cosine", cache_dir=fresh_home)
    for n, h in got.items():
        want = rerank(n, fresh, q, 10)
        np.testing.assert_array_equal(h.rows, want.rows)
        np.testing.assert_array_equal(h.scores, want.scores)
    shrunk = space_for(build(path, x[: N - 10], lab[: N - 10], W), "trained", {}, "cosine")
    assert shrunk.cache_key not in (first.cache_key, grown.cache_key)


def test_the_cache_key_follows_strategy_params_and_mode(gallery):
    searcher, _, _ = gallery
    keys = {space_for(searcher, s, p, m).cache_key for s, p, m in
            [("trained", {}, "cosine"), ("trained", {}, "bilinear"), ("diagonal", {"r": 0.5, "seed": 1}, "bilinear"),
             ("diagonal", {"r": 0.5, "seed": 2}, "bilinear")]}
    assert len(keys) == 4
    assert space_for(searcher, "trained", {}, "cosine").cache_key == space_for(searcher, "trained", None,
                                                                               "cosine").cache_key


def test_a_new_space_reads_the_cache_from_disk_instead_of_recomputing(gallery, monkeypatch):
    searcher, x, _ = gallery
    q = queries(x)
    want = rerank("kreciprocal", space_for(searcher, "trained", {}, "cosine"), q, 10)
    from index.space import OfflineStore

    def refuse(*a, **k):
        raise AssertionError("recomputed a cached pass")
    monkeypatch.setattr(OfflineStore, "save", refuse)
    CACHE.clear()  # nothing in memory: every artefact is read from disk
    got = rerank("kreciprocal", space_for(searcher, "trained", {}, "cosine"), q, 10)  # a new space: from disk
    np.testing.assert_array_equal(got.rows, want.rows)


# ---------------------------------------------------------------- registry
DUMMY = '''from dataclasses import dataclass

from core.params import param
from index.rerankers.registry import RERANKERS


@dataclass
class DummyParams:
    shift: int = param(0, "rotate the first search's list by this much")


@RERANKERS.register("dummy-rotate", DummyParams, depth="shift", grid={"shift": (0, 1)})
def dummy(space, queries, first, k, *, self_ids, params):
    """A test re-ranker: the first search, rotated."""
    import numpy as np
    rows = np.roll(first.rows[:, :k], -params.shift, axis=1)
    return space.hits(rows, space.score(queries, rows))
'''


@pytest.fixture
def dummy_module(tmp_path):
    (tmp_path / "dummy_rotate.py").write_text(DUMMY)
    spec = importlib.util.spec_from_file_location("dummy_rotate", tmp_path / "dummy_rotate.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # the "one import line"
    yield
    RERANKERS.unregister("dummy-rotate")
    sys.modules.pop("dummy_rotate", None)


def test_a_new_reranker_is_one_file_and_one_import(dummy_module, gallery):
    assert "dummy-rotate" in RERANKERS
    assert "dummy-rotate: A test re-ranker: the first search, rotated." in RERANKERS.help_text()
    assert "dummy-rotate" in RERANKERS.listing() and "shift = 0" in RERANKERS.listing()
    searcher, x, _ = gallery
    space = space_for(searcher, "trained", {}, "cosine")
    got = rerank("dummy-rotate", space, queries(x), 5, params={"shift": 1})
    plain = searcher.search(queries(x), "trained", {}, "cosine", k=5)
    np.testing.assert_array_equal(got.rows, np.roll(plain.rows, -1, axis=1))
    # the CLI's help and the strategy × re-ranker sweep
    import argparse

    from index.analysis.rerank_eval import rerank_matrix
    from index.cli import build_parser
    from index.search_config import SearchConfig

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert "dummy-rotate" in sub["search"].format_help() and "dummy-rotate" in sub["evaluate"].format_help()
    x, lab, W = features(n=120, seed=7)
    rows = rerank_matrix({"test": (x, lab)}, W, [SearchConfig.of("trained", {}, "cosine")], ("dummy-rotate",),
                         progress=False)["test"]
    assert [r["rerank"] for r in rows] == ["none", "dummy-rotate"]
    assert rows[1]["rerank_params"] == {"shift": 0} and rows[1]["map@r"] == rows[0]["map@r"]  # at its default: a no-op


def test_every_reranker_is_listed_with_its_spec():
    assert {"none", "aqe", "dba", "kreciprocal", "diffusion"} <= set(RERANKERS.names())
    offline = {e.name for e in RERANKERS.entries() if e.spec.offline}
    assert offline == {"dba", "kreciprocal", "diffusion", "diffusion_offline"}
    assert "offline part" in RERANKERS.listing()


def test_a_spec_naming_what_is_not_a_parameter_fails_at_registration():
    from index.rerankers.aqe import AQEParams

    with pytest.raises(ValueError, match=r"'x': grid or whole_when names \['m'\]"):
        RERANKERS.register("x", AQEParams, grid={"m": (1,)})(lambda *a, **k: None)
    with pytest.raises(ValueError, match=r"'x': depth='pool' is not one of its parameters"):
        RERANKERS.register("x", AQEParams, depth="pool")(lambda *a, **k: None)
    with pytest.raises(TypeError, match="unknown keyword 'ofline'"):
        RERANKERS.register("x", AQEParams, ofline=True)
    assert "x" not in RERANKERS


def test_parameters_are_typed_and_checked(gallery):
    searcher, x, _ = gallery
    space = space_for(searcher, "trained", {}, "cosine")
    with pytest.raises(UserError, match="no parameter 'k3'"):
        rerank("kreciprocal", space, x[:1], 5, params={"k3": 1})
    with pytest.raises(UserError, match="k2 must be in"):
        rerank("kreciprocal", space, x[:1], 5, params=["k2=30"])
    with pytest.raises(UserError, match="alpha must be in"):
        rerank("diffusion", space, x[:1], 5, params={"alpha": 1.0})


def test_cosine_under_an_indefinite_metric_is_refused_as_in_search(gallery):
    searcher, _, _ = gallery
    with pytest.raises(UserError, match="positive semi-definite"):
        SearcherSpace(searcher, "diagonal", {"r": 0.5, "seed": 1}, "cosine")


def test_nothing_is_written_into_the_repository(tmp_path):
    root = Path(__file__).resolve().parents[2]
    assert root not in cache_root().parents


def test_size_parameters_are_declared_and_held_to_a_server_limit():
    assert size_params("aqe") == ["n"] and size_params("dba") == ["n"]
    assert size_params("kreciprocal") == ["k1", "k2"]
    assert size_params("diffusion") == ["k", "kq"]
    # the candidate pools count gallery items too (clipped to it), but cost no more than the default
    assert gallery_counts("kreciprocal") == ["k1", "k2", "pool"]
    assert gallery_counts("diffusion") == ["k", "kq", "truncation"]
    check_size_limit("aqe", {"n": 200}, 200)
    check_size_limit("kreciprocal", {"pool": 10**9}, 200)
    with pytest.raises(UserError, match=r"^re-ranker 'aqe': n must be ≤ 200 \(this server's limit\), got 1000000$"):
        check_size_limit("aqe", {"n": 1_000_000}, 200)
    with pytest.raises(UserError, match=r"^re-ranker 'kreciprocal': k1 must be ≤ 200 \(this server's limit\), got"):
        check_size_limit("kreciprocal", {"k1": 201}, 200)
    with pytest.raises(UserError, match="re-ranker 'dba': alpha must be a finite number, got inf"):
        check_size_limit("dba", {"alpha": "inf"}, 200)


@pytest.mark.parametrize("name", [e.name for e in RERANKERS.entries()])
def test_every_default_is_within_the_recommended_server_limit(name):
    check_size_limit(name, {}, SIZE_LIMIT)
    grid = RERANKERS.get(name).spec.grid  # and every value a sweep tries
    for param in set(grid) & set(size_params(name)):
        check_size_limit(name, {param: max(grid[param])}, SIZE_LIMIT)


FLOATS = [(e.name, f.name) for e in RERANKERS.entries() for f in dataclasses.fields(e.params)
          if typing.get_type_hints(e.params)[f.name] is float]


@pytest.mark.parametrize("name,param", FLOATS, ids=[f"{n}-{p}" for n, p in FLOATS])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_no_float_parameter_takes_a_non_finite_value(gallery, name, param, value):
    searcher, x, _ = gallery
    with pytest.raises(UserError, match=f"^re-ranker '{name}': {param} must be a finite number, got"):
        rerank(name, space_for(searcher, "trained", {}, "cosine"), x[:1], 5, params={param: value})


def test_every_float_parameter_is_checked_for_finiteness():
    """The battery above covers every re-ranker's float parameters (none declares nonfinite)."""
    assert {"aqe", "dba", "kreciprocal", "diffusion"} <= {n for n, _ in FLOATS}
    assert ("dba", "alpha") in FLOATS and ("diffusion", "tol") in FLOATS
    assert not [f for e in RERANKERS.entries() for f in dataclasses.fields(e.params) if f.metadata.get("nonfinite")]


COUNTS = [(e.name, f) for e in RERANKERS.entries() for f in gallery_counts(e.name)]


@pytest.mark.parametrize("name,param", COUNTS, ids=[f"{n}-{p}" for n, p in COUNTS])
def test_a_size_above_the_gallery_is_the_whole_gallery(tmp_path, name, param):
    """A count of gallery items far above the gallery answers as the gallery size does (and so
    does the work of that size: every re-ranker is handed the clipped value)."""
    n = 50
    x, lab, W = features(n=n, seed=4)
    space = space_for(build(tmp_path / "small", x, lab, W), "trained", {}, "cosine")
    q = np.vstack([queries(x, 3), x[[5, 30]]])
    own = np.array([-1, -1, -1, 5, 30])
    extra = {"k1": n} if param == "k2" else {}  # k2 ≤ k1 + 1
    huge = rerank(name, space, q, 10, self_ids=own, params={param: 10**9, **{k: 10**9 for k in extra}})
    at_n = rerank(name, space, q, 10, self_ids=own, params={param: n, **extra})
    np.testing.assert_array_equal(huge.rows, at_n.rows)
    np.testing.assert_array_equal(huge.scores, at_n.scores)


def test_neighbour_lists_are_memory_mapped_outside_the_memory_budget(gallery, monkeypatch):
    """The lists are files the process maps (the page cache holds them): a budget smaller than
    they are keeps them, and they count for none of it."""
    import index.rerankers.neighbours as nb

    searcher, x, _ = gallery
    monkeypatch.setattr(CACHE, "budget", 100 * 40 * 8)  # below 150 × 64 × 8 bytes of lists
    space = space_for(searcher, "trained", {}, "cosine")
    lists = nb.neighbour_lists(space, 42)
    assert isinstance(lists.rows, np.memmap) and isinstance(lists.sims, np.memmap)
    assert space.held("knn", {"length": 64}) and CACHE.used < 150 * 64 * 8  # not counted: the rest is M′'s
    np.testing.assert_array_equal(lists.rows, nb.searched_lists(space, np.arange(150), 64)["rows"][:, :42])


# ---------------------------------------------------------------- approximate neighbour lists
@pytest.mark.parametrize("strategy,params,mode", CASES[:2], ids=CASE_IDS[:2])
def test_the_factor_of_a_psd_metric_gives_its_similarity(gallery, strategy, params, mode):
    searcher, _, _ = gallery
    space = space_for(searcher, strategy, params, mode)
    F = space.factor()
    keys = space.gallery_vectors(np.arange(40))
    np.testing.assert_allclose((keys @ F) @ (keys @ F).T, space.score(keys)[:, :40], rtol=1e-4, atol=1e-5)
    assert space_for(searcher, "diagonal", {"r": 0.5, "seed": 1}, "bilinear").factor() is None  # indefinite


def test_an_exact_scan_above_its_size_limit_is_refused_in_one_line(tmp_path, monkeypatch):
    """An indefinite M′ has no HNSW route: above EXACT_MAX items its N² passes are refused at
    once, naming what to do; a PSD M′ of the same size takes the approximate route."""
    import index.rerankers.neighbours as nb

    x, lab, W = features(n=300, seed=3)
    searcher = build(tmp_path / "idx", x, lab, W)
    monkeypatch.setattr(nb, "EXACT_MAX", 100)
    monkeypatch.setattr(nb, "APPROXIMATE_ABOVE", 100)
    indefinite = space_for(searcher, "diagonal", {"r": 0.5, "seed": 1}, "bilinear")
    for run in (lambda: nb.neighbour_lists(indefinite, 10), lambda: nb.row_extremes(indefinite),
                lambda: rerank("kreciprocal", indefinite, queries(x), 5)):
        with pytest.raises(UserError, match="choose a PSD strategy or a gallery of at most 100 items") as e:
            run()
        assert "\n" not in str(e.value)
    psd = space_for(searcher, "trained", {}, "cosine")
    assert nb.neighbour_lists(psd, 10)[0].shape == (300, 10) and psd.held("knn", nb.HNSW | {"length": 64})


def test_approximate_row_extremes_against_the_exact_ones(tmp_path, monkeypatch):
    """Above APPROXIMATE_ABOVE items the row extremes come from the HNSW index (a search for
    −Fᵀ key(x)), each re-scored exactly: on a small gallery the least similar item agrees with the
    exact pass for ≥ 99 % of rows, every minimum is the exact score of its row and never below
    the exact minimum, and the lists' pass leaves them behind for k-reciprocal to read."""
    import index.rerankers.neighbours as nb

    x, lab, W = features(n=1500, seed=7)
    searcher = build(tmp_path / "idx", x, lab, W)
    space = space_for(searcher, "trained", {}, "cosine")
    exact = nb.row_extremes(space)
    monkeypatch.setattr(nb, "APPROXIMATE_ABOVE", 0)
    nb.neighbour_lists(space, 30)
    assert space.held("extremes", nb.extremes_params(nb.HNSW))  # built with the lists, from one graph
    got = nb.row_extremes(space)
    assert (got["arg1"] == exact["arg1"]).mean() >= 0.99
    keys = space.gallery_vectors(np.arange(len(x)))
    np.testing.assert_allclose(got["self"], exact["self"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got["min1"], space.score(keys, got["arg1"][:, None])[:, 0])
    assert (got["min1"] >= exact["min1"] - 1e-5).all() and (got["min2"] >= got["min1"]).all()
    assert (got["arg1"] != np.arange(len(x))).all()  # cosine: no item is its own least similar
    CACHE.clear()
    assert nb.row_extremes(space) is not None  # alone, without the lists
    assert space.held("extremes", nb.extremes_params(nb.HNSW))


def test_the_antipodes_make_the_extremes_exact_where_the_draw_covers_the_gallery(tmp_path, monkeypatch):
    """The least similar items of a drawn sample are every row's candidates too (`antipodes`):
    where the draw is the whole gallery, each row's two smallest similarities are among them, so
    even a graph too weak to find any gives the exact pass's extremes: a row met twice (found
    by the graph and drawn) is not counted twice in min2.  The draw's smallest are carried
    from block to block of one pass over the keys."""
    import index.rerankers.neighbours as nb

    x, lab, W = features(n=600, seed=3)
    searcher = build(tmp_path / "idx", x, lab, W)
    space = space_for(searcher, "trained", {}, "cosine")
    exact = nb.row_extremes(space)
    monkeypatch.setattr(nb, "APPROXIMATE_ABOVE", 0)
    monkeypatch.setattr(nb, "EXTREME_SAMPLE", 600)
    monkeypatch.setattr(nb, "ANTIPODES", 600 * (nb.EXTREME_CANDIDATES + 1))  # every one kept
    monkeypatch.setattr(nb, "SCAN_CELLS", 600 * 50)  # the draw's pass in blocks of 50 columns
    monkeypatch.setitem(nb.HNSW, "M", 4)
    monkeypatch.setitem(nb.HNSW, "ef_construction", 8)
    got = nb.row_extremes(space)
    np.testing.assert_array_equal(got["arg1"], exact["arg1"])
    np.testing.assert_allclose(got["min1"], exact["min1"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["min2"], exact["min2"], rtol=1e-5, atol=1e-6)
    assert (got["min2"] > got["min1"]).all()  # no row counted twice (distinct random features: no ties)
    hubs = nb.antipodes(space)
    assert len(hubs) < 600 and (np.diff(hubs) > 0).all()  # few, sorted, unique
    keys = space.gallery_vectors(np.arange(600))
    bottom = np.argsort(space.score(keys), axis=1)[:, : nb.EXTREME_CANDIDATES + 1]
    np.testing.assert_array_equal(hubs, np.unique(bottom))
    monkeypatch.setattr(nb, "ANTIPODES", 20)  # more than that: the 20 most often met
    rows, count = np.unique(bottom, return_counts=True)
    kept = nb.antipodes(space)
    assert len(kept) == 20 and (np.diff(kept) > 0).all() and np.isin(kept, rows).all()
    assert count[np.isin(rows, kept)].min() >= count[~np.isin(rows, kept)].max()


def test_approximate_neighbour_lists_against_the_exact_ones(tmp_path, monkeypatch):
    """Above APPROXIMATE_ABOVE items the lists come from HNSW, each re-scored exactly: on a small
    gallery they hold at least 99 % of the exact top L, every score is the exact s, best first,
    and re-rankers run on them; an indefinite M′ keeps the exact scan."""
    import index.rerankers.neighbours as nb

    x, lab, W = features(n=1500, seed=7)
    searcher = build(tmp_path / "idx", x, lab, W)
    space = space_for(searcher, "trained", {}, "cosine")
    exact_rows, _, _ = nb.neighbour_lists(space, 30)
    monkeypatch.setattr(nb, "APPROXIMATE_ABOVE", 0)
    monkeypatch.setitem(nb.HNSW, "ef_construction", 40)  # a weaker graph than the default: recall still holds
    rows, sims, _ = nb.neighbour_lists(space, 30)
    # two artefacts: never read for each other
    assert space.held("knn", nb.HNSW | {"length": 64}) and space.held("knn", {"length": 64})
    found = (rows[:, :, None] == exact_rows[:, None, :]).any(1).mean()
    assert found >= 0.99
    assert (rows[:, 0] == np.arange(len(x))).mean() > 0.99  # cosine: each item first in its own list
    np.testing.assert_array_equal(sims, space.score(space.gallery_vectors(np.arange(len(x))), rows.astype(np.int64)))
    assert (np.diff(sims, axis=1) <= 0).all()
    got = rerank("kreciprocal", space, queries(x), 10)
    assert (got.rows >= 0).all()
    builds = []  # diffusion's default lists (k = 50, + 1) come from the same graph: no second build
    monkeypatch.setattr(nb, "hnsw_index", lambda *a: builds.append(1))
    assert nb.neighbour_lists(space, 51)[0].shape == (1500, 51) and not builds
    np.testing.assert_array_equal(nb.neighbour_lists(space, 51)[0][:, :30], rows)
    indefinite = space_for(searcher, "diagonal", {"r": 0.5, "seed": 1}, "bilinear")
    r_ind, _, _ = nb.neighbour_lists(indefinite, 30)
    assert indefinite.held("knn", {"length": 64}) and not indefinite.held("knn", nb.HNSW | {"length": 64})
    monkeypatch.setattr(nb, "APPROXIMATE_ABOVE", 10**9)
    CACHE.clear()
    np.testing.assert_array_equal(nb.neighbour_lists(indefinite, 30)[0], r_ind)


def test_a_projected_graph_keeps_the_lists_and_extremes(tmp_path, monkeypatch):
    """Keys of more than GRAPH_DIM dimensions go into the HNSW graph projected onto their top
    principal directions (the uncentred second moment: the right singular vectors of the keys),
    searched WIDEN times as deep: the lists still hold ≥ 95 % of the exact top L with exact
    scores, the extremes are exact scores never below the true minimum, and the artefacts are
    named apart from an unprojected graph's."""
    import index.rerankers.neighbours as nb

    x, lab, W = features(n=1500, seed=7)
    x[:, 8:] *= 0.3  # as trunk features are, most of the energy in fewer directions than dimensions
    searcher = build(tmp_path / "idx", x, lab, W)
    space = space_for(searcher, "identity", {}, "cosine")  # F: D = 16 columns
    exact_rows, _, _ = nb.neighbour_lists(space, 30)
    exact_ext = nb.row_extremes(space)
    monkeypatch.setattr(nb, "APPROXIMATE_ABOVE", 0)
    monkeypatch.setattr(nb, "GRAPH_DIM", 8)
    F = space.factor()
    G = nb.graph_basis(space, F)
    assert G.shape == (D, 8)
    keys = space.gallery_vectors(np.arange(len(x)))  # every item is in the sample (n < PROJECTION_SAMPLE)
    top = np.linalg.svd(keys @ F, full_matrices=False)[2][:8].T  # in F's coordinates
    basis = np.linalg.lstsq(F, G, rcond=None)[0]
    proj = lambda B: B @ np.linalg.pinv(B)  # noqa: E731  (the projector onto B's columns)
    np.testing.assert_allclose(proj(basis), proj(top), atol=1e-3)
    params, widen = nb.graph_params(F)
    assert widen == nb.WIDEN > 1 and params["dim"] == 8
    rows, sims, _ = nb.neighbour_lists(space, 30)
    assert space.held("knn", params | {"length": 64}) and not space.held("knn", nb.HNSW | {"length": 64})
    assert (rows[:, :, None] == exact_rows[:, None, :]).any(1).mean() >= 0.95
    np.testing.assert_array_equal(sims, space.score(keys, rows.astype(np.int64)))
    assert (np.diff(sims, axis=1) <= 0).all()
    extremes = nb.row_extremes(space)
    assert space.held("extremes", nb.extremes_params(params))
    np.testing.assert_array_equal(extremes["min1"], space.score(keys, extremes["arg1"][:, None])[:, 0])
    assert (extremes["min1"] >= exact_ext["min1"] - 1e-5).all()
    assert (extremes["arg1"] == exact_ext["arg1"]).mean() >= 0.95
    assert nb.graph_basis(space, F[:, :8]) is not None and nb.graph_params(F[:, :8]) == (nb.HNSW, 1)
