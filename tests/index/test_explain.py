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


def test_why_ranks_and_scores_match_the_search(data):
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
    assert len(ex._spaces) == 1  # one eigendecomposition for the pair
