"""index/analysis/explain.py: the score difference of two configurations splits over the
eigen-directions of M_B − M_A (and, in cosine mode, the change of the norms) exactly."""
import numpy as np
import pytest

from index.analysis.explain import Eigenspaces, Explainer, explain_change
from index.backends.search import Searcher
from index.backends.store import in_memory_index
from index.search_config import SearchConfig

# one setting per kind of strategy (its operator): low-rank, spectral, low-rank minus a diagonal, dense
KINDS = [("trained", {}), ("identity", {}), ("shrink", {"alpha": 0.3}), ("spectral", {"p": 0.5}),
         ("diagonal", {"r": 0.4, "seed": 1}), ("random", {"r": 0.6, "seed": 2}),
         ("diagonal-psd", {"r": 0.4, "seed": 1, "psd": "clip"})]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(8), 5)
    X = rng.normal(size=(8, 24))[y] + 0.8 * rng.normal(size=(40, 24))
    return in_memory_index(X, y, rng.normal(size=(6, 24)), normalize=True)


@pytest.fixture(scope="module")
def custom(tmp_path_factory):
    """A dense symmetric matrix file (PSD: it has a cosine too) for the custom strategy."""
    rng = np.random.default_rng(5)
    A = rng.normal(size=(24, 24))
    p = tmp_path_factory.mktemp("custom") / "M.npy"
    np.save(p, A @ A.T / 24)
    return "custom", {"path": str(p)}


def settings(custom):
    return KINDS + [custom]


def check_parts(ch, q, x, Ma, Mb):
    """The directions' terms and the norms' term sum to the score difference; each score is the
    configuration's own, computed directly."""
    def direct(M, mode):
        s = q @ M @ x
        return s / np.sqrt((q @ M @ q) * (x @ M @ x)) if mode == "cosine" else s
    assert ch.score_a == pytest.approx(direct(Ma, ch.mode_a), rel=1e-12, abs=1e-12)
    assert ch.score_b == pytest.approx(direct(Mb, ch.mode_b), rel=1e-12, abs=1e-12)
    scale = max(1.0, abs(ch.score_a), abs(ch.score_b), float(np.abs(Mb - Ma).max()))
    assert abs(ch.parts_sum - ch.delta) <= 1e-10 * scale
    head, rest = ch.top(3)
    assert abs(sum(d.term for d in head) + rest + ch.norm_term - ch.delta) <= 1e-10 * scale
    assert [abs(d.term) for d in ch.directions] == sorted((abs(d.term) for d in ch.directions), reverse=True)
    assert sum(d.dim for d in ch.directions) == len(q)  # every eigen-direction is counted once


@pytest.mark.parametrize("other", ["trained", "identity"])
def test_bilinear_terms_sum_to_the_score_difference_for_every_kind(data, custom, other):
    s = Searcher(data)
    q, x = np.asarray(data.features[0], np.float64), np.asarray(data.features[7], np.float64)
    Ma = s.metric(other, {}).M
    for name, params in settings(custom):
        Mb = s.metric(name, params).M
        ch = explain_change(q, x, Ma, "bilinear", Mb, "bilinear")
        check_parts(ch, q, x, Ma, Mb)
        assert ch.norm_term == 0.0 and ch.bilinear_term == pytest.approx(q @ (Mb - Ma) @ x, abs=1e-10)
        # and the other way round: A and B swapped negate every term
        back = explain_change(q, x, Mb, "bilinear", Ma, "bilinear")
        assert back.delta == pytest.approx(-ch.delta, abs=1e-12)
        check_parts(back, q, x, Mb, Ma)


def test_cosine_parts_sum_to_the_cosine_difference(data, custom):
    s = Searcher(data)
    q, x = np.asarray(data.features[3], np.float64), np.asarray(data.features[21], np.float64)
    psd = [(n, p) for n, p in settings(custom) if s.metric(n, p).report["psd"]]
    assert {n for n, _ in psd} >= {"trained", "identity", "shrink", "spectral", "diagonal-psd", "custom"}
    for (na, pa) in psd:
        for (nb, pb) in psd:
            Ma, Mb = s.metric(na, pa).M, s.metric(nb, pb).M
            for ma, mb in (("cosine", "cosine"), ("cosine", "bilinear"), ("bilinear", "cosine")):
                ch = explain_change(q, x, Ma, ma, Mb, mb)
                check_parts(ch, q, x, Ma, Mb)
                if ma == mb == "cosine" and not np.allclose(Ma, Mb):
                    # the norms' term is A's bilinear score moved from A's norms to B's
                    assert ch.norm_term == pytest.approx(ch.bilinear_a * (1 / ch.norm_b - 1 / ch.norm_a))
    # the same metric in both modes: no direction moves it, the norms do all of it
    M = s.metric("trained", {}).M
    ch = explain_change(q, x, M, "bilinear", M, "cosine")
    assert ch.bilinear_term == 0.0 and ch.norm_term == pytest.approx(ch.delta)


def test_a_degenerate_eigenspace_is_one_direction(data):
    """identity − M*: the null space of the rank-6 M* is one eigenspace of eigenvalue 1, reported
    once along the query's component in it."""
    s = Searcher(data)
    Ma, Mb = s.metric("trained", {}).M, s.metric("identity", {}).M
    sp = Eigenspaces.of(Ma, Mb)
    assert len(sp.starts) == 1 + 6  # 24 − 6 directions share μ = 1; M*'s 6 eigenvalues are distinct
    q, x = np.asarray(data.features[1], np.float64), np.asarray(data.features[2], np.float64)
    ch = explain_change(q, x, Ma, "bilinear", Mb, "bilinear", sp)
    null = next(d for d in ch.directions if d.dim == 18)
    assert null.eigenvalue == pytest.approx(1.0)
    P = np.eye(24) - np.linalg.pinv(Ma) @ Ma  # the projector onto M*'s null space
    assert null.term == pytest.approx(q @ P @ x, abs=1e-10)
    assert np.linalg.norm(null.vector) == pytest.approx(1.0)
    assert null.term == pytest.approx(null.eigenvalue * null.q_proj * null.x_proj, abs=1e-10)


def test_why_ranks_and_scores_match_the_search(data, monkeypatch):
    from index.analysis import explain
    from index.space import CACHE

    CACHE.clear()
    made = []
    of = explain.Eigenspaces.of.__func__
    monkeypatch.setattr(explain.Eigenspaces, "of",
                        classmethod(lambda cls, *a, **kw: made.append(1) or of(cls, *a, **kw)))
    s = Searcher(data)
    ex = Explainer(s)
    left, right = SearchConfig("trained", {}, "cosine"), SearchConfig("random", {"r": 0.6, "seed": 2}, "bilinear")
    qrow = 4
    hits = {c.strategy: s.search(data.features[qrow: qrow + 1], c.strategy, c.params, c.mode, 40)
            for c in (left, right)}
    ranked = {n: [r for r in h.rows[0] if r != qrow] for n, h in hits.items()}
    scores = {n: {int(r): float(v) for r, v in zip(h.rows[0], h.scores[0], strict=True)} for n, h in hits.items()}
    k = 5
    for row in (ranked["trained"][0], ranked["random"][2], ranked["trained"][30]):
        w = ex.why(np.asarray(data.features[qrow: qrow + 1]), row, left, right, self_row=qrow, k=k, top=3)
        assert w.left.rank == ranked["trained"].index(row) + 1 and w.right.rank == ranked["random"].index(row) + 1
        assert w.left.in_top_k == (w.left.rank <= k) and w.right.in_top_k == (w.right.rank <= k)
        assert w.left.score == pytest.approx(scores["trained"][row], abs=1e-5)
        assert w.right.score == pytest.approx(scores["random"][row], abs=1e-5)
        assert "random(r=0.6, seed=2) · bilinear" == w.right.label
        assert len(w.shown) == len(w.strips) == 3 and all(len(st) == 8 for st in w.strips)
        assert sum(d.term for d in w.shown) + w.rest + w.change.norm_term == pytest.approx(w.change.delta, abs=1e-9)
        for d, st in zip(w.shown, w.strips, strict=True):  # the strip: the largest |vᵀx| over the gallery
            proj = np.asarray(data.features, np.float64) @ d.vector
            assert [r for r, _ in st] == list(np.argsort(-np.abs(proj), kind="stable")[:8])
            assert [p for _, p in st] == pytest.approx(proj[[r for r, _ in st]].tolist(), abs=1e-5)
    assert len(made) == 1  # one eigendecomposition for the pair


# ---------------------------------------------------------------- configurations with a re-ranker
def test_why_with_a_reranker_places_the_item_in_the_reranked_list(data, tmp_path, monkeypatch):
    """A re-ranked side: x's rank and score are its position in `SearchConfig.search`'s list (the
    query's own row left out), to the re-ranker's pool; beyond it, the strategy alone's rank,
    marked.  The decomposition is not given; the neighbourhood is, computed by hand here."""
    from index.rerankers import RERANKERS

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    s = Searcher(data)
    ex = Explainer(s)
    qrow, k = 4, 5
    q = np.asarray(data.features[qrow: qrow + 1])
    plain = SearchConfig("trained", {}, "cosine")
    kr = SearchConfig.of("trained", {}, "cosine", "kreciprocal", {"k1": 4, "k2": 2, "pool": 12})
    listed = kr.search(s, q, 12, self_ids=[qrow])
    strategy_alone = [r for r in s.search(q, "trained", {}, "cosine", 40).rows[0] if r != qrow]
    outside = next(r for r in strategy_alone if r not in listed.rows[0])
    for row in (int(listed.rows[0][0]), int(listed.rows[0][7]), int(outside)):
        w = ex.why(q, row, plain, kr, self_row=qrow, k=k)
        assert w.change is None and w.shown == [] and w.strips == []
        assert "does not apply" in w.note and "right side's (kreciprocal)" in w.note
        assert w.left.rank == strategy_alone.index(row) + 1 and not w.left.reranked  # the plain side as before
        assert w.right.reranked
        if row in listed.rows[0]:
            at = list(listed.rows[0]).index(row)
            assert (w.right.rank, w.right.beyond) == (at + 1, 0) and w.right.in_top_k == (at < k)
            assert w.right.score == pytest.approx(float(listed.scores[0][at]))
        else:
            assert w.right.beyond == 12 and w.right.pool and not w.right.in_top_k
            assert w.right.rank == w.left.rank  # the same strategy alone
            assert w.right.rank_text() == ("beyond the re-ranker's candidate pool (rank under the strategy alone: "
                                           f"{w.left.rank})")
        (sup,) = w.support
        assert (sup.side, sup.rerank, sup.rerank_doc) == ("right", "kreciprocal", RERANKERS.get("kreciprocal").doc)
        # by hand: cosine under M*, the query's own row out of every list
        X = np.asarray(data.features, np.float64)
        M = s.metric("trained", {}).M
        S = X @ M @ X.T / np.outer(np.sqrt(np.diag(X @ M @ X.T)), np.sqrt(np.diag(X @ M @ X.T)))
        S[:, qrow] = -np.inf
        sq = S[qrow].copy()
        near = [r for r in np.argsort(-sq, kind="stable") if r != row][:8]
        assert [n.row for n in sup.of_query] == near
        for n in sup.of_query:
            sy = S[n.row].copy()
            sy[n.row] = -np.inf
            assert n.far_rank == int((sy > sy[row]).sum()) + 1 and n.far_score == pytest.approx(sy[row], abs=1e-5)
            assert n.near_rank == int((sq > sq[n.row]).sum()) + 1
        sx = S[row].copy()
        sx[row] = -np.inf
        assert [n.row for n in sup.of_item] == list(np.argsort(-sx, kind="stable")[:8])
        assert all(n.far_rank == int((sq > sq[n.row]).sum()) + 1 for n in sup.of_item)
        assert qrow not in [n.row for n in sup.of_query + sup.of_item]


def test_why_with_a_reranker_that_ranks_the_whole_gallery(data, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    s = Searcher(data)
    ex = Explainer(s)
    q = np.asarray(data.features[7:8])
    aqe = SearchConfig.of("identity", {}, "cosine", "aqe", {"n": 2})
    full = aqe.search(s, q, 39, self_ids=[7])  # every other item: aqe's list covers the gallery
    row = int(full.rows[0][30])
    w = ex.why(q, row, aqe, SearchConfig("trained", {}, "bilinear"), self_row=7, k=5)
    assert (w.left.rank, w.left.beyond, w.left.reranked) == (31, 0, True)
    assert [sup.side for sup in w.support] == ["left"]
    both = ex.why(q, row, aqe, SearchConfig.of("trained", {}, "cosine", "dba", {"n": 2}), self_row=7, k=5)
    assert [sup.side for sup in both.support] == ["left", "right"] and both.change is None
