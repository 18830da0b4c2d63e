"""index/analysis/compare.py: per-query AP of a whole index in one pass, and the paired statistics."""
import math

import numpy as np
import pytest

import index.analysis.compare as compare
from evaluation.evaluator import per_query_metrics
from index.analysis.compare import Comparer, Comparison, bootstrap_ci, jaccard_at_k, sign_test
from index.backends.search import Searcher
from index.backends.store import in_memory_index
from index.search_config import SearchConfig

SETTINGS = [("trained", {}, "cosine"), ("identity", {}, "cosine"), ("spectral", {"p": 0.5}, "cosine"),
            ("random", {"r": 0.6, "seed": 2}, "bilinear"), ("diagonal", {"r": 0.3, "seed": 1}, "bilinear")]


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(12), 5)
    y = np.concatenate([y, [99]])  # a class of one: no relevant item, no query
    X = rng.normal(size=(13, 24))[np.minimum(y, 12)] + 0.8 * rng.normal(size=(61, 24))
    return in_memory_index(X, y, rng.normal(size=(6, 24)), normalize=True)


def reference_ap(data, M: np.ndarray, mode: str) -> np.ndarray:
    """Brute force in float64: S = Φ M′ Φᵀ (cosine: over ‖·‖_M′), argsort, the evaluator's MAP@R."""
    X = np.asarray(data.features, dtype=np.float64)
    S = X @ M @ X.T
    if mode == "cosine":
        n = np.sqrt(np.diag(S))
        S = S / n[:, None] / n[None, :]
    np.fill_diagonal(S, -np.inf)
    y = data.items.labels
    R = np.array([(y == c).sum() - 1 for c in y])
    nbr = y[np.argsort(-S, axis=1, kind="stable")[:, : R.max()]]
    ap = per_query_metrics(nbr, y, R, ks=(1,))["map@r"]
    return np.where(R > 0, ap, np.nan)


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("name, params, mode", SETTINGS)
def test_per_query_ap_equals_brute_force(data, monkeypatch, batched, name, params, mode):
    if not batched:  # above MAX_N the comparer searches through the search path instead
        monkeypatch.setattr(compare, "MAX_N", 0)
    c = Comparer(data)
    got = c.per_query_ap(name, params, mode)
    ref = reference_ap(data, c.searcher.metric(name, params).M, mode)
    assert np.isnan(got[-1]) and np.isnan(ref[-1])
    np.testing.assert_allclose(got[:-1], ref[:-1], atol=1e-9)
    assert c.per_query_ap(name, params, mode) is got  # cached


def test_comparison_counts_classes_and_disagreements(data):
    cmp = Comparer(data).compare(SearchConfig("trained", {}, "bilinear"), SearchConfig("random", {"r": 0.6, "seed": 2},
                                                                                        "bilinear"))
    c = cmp.counts()
    assert c["queries"] == 60 == c["improved"] + c["worsened"] + c["tied"]  # the class of one is no query
    assert c["improved"] > 0 and c["worsened"] > 0
    worse = cmp.disagreements("worsened")
    assert len(worse) == c["worsened"] and all(r["delta"] < 0 for r in worse)
    assert len(cmp.disagreements("improved")) == c["improved"]
    every = cmp.disagreements("all")
    assert len(every) == c["improved"] + c["worsened"]
    assert [abs(r["delta"]) for r in every] == sorted((abs(r["delta"]) for r in every), reverse=True)
    assert len(cmp.disagreements("all", top=3)) == 3
    per_class = cmp.per_class()
    assert [r["n"] for r in per_class] == [5] * 12
    r3 = per_class[3]
    mask = cmp.labels == 3
    assert r3["ap_a"] == pytest.approx(cmp.ap_a[mask].mean()) and r3["delta"] == pytest.approx(
        cmp.ap_b[mask].mean() - cmp.ap_a[mask].mean())
    assert {r["id"] for r in cmp.class_queries(3)} == set(cmp.ids[mask].tolist())
    assert cmp.jaccard is not None and 0 < r3["jaccard"] < 1
    assert r3["jaccard"] == pytest.approx(cmp.jaccard[mask].mean())  # the class's mean top-k overlap
    with pytest.raises(ValueError, match="filter must be one of"):
        cmp.disagreements("better")


@pytest.mark.parametrize("batched", [True, False])
def test_any_two_configurations_compare(data, monkeypatch, batched):
    """Neither side need be trained: each side's AP is its own per-query AP, and Jaccard@k is the
    overlap of the two leave-one-out top-k lists (batched and searched alike)."""
    if not batched:
        monkeypatch.setattr(compare, "MAX_N", 0)
    c = Comparer(data)
    left, right = SearchConfig("spectral", {"p": 0.5}, "cosine"), SearchConfig("diagonal", {"r": 0.3, "seed": 1},
                                                                                "cosine")
    cmp = c.compare(left, right, k=5)
    assert cmp.label_a == "spectral(p=0.5) · cosine"
    assert cmp.label_b == "diagonal(r=0.3, seed=1) · bilinear"  # indefinite: no cosine, as the search says
    ok = ~np.isnan(c.per_query_ap("spectral", {"p": 0.5}, "cosine"))
    np.testing.assert_array_equal(cmp.ap_a, c.per_query_ap("spectral", {"p": 0.5}, "cosine")[ok])
    np.testing.assert_array_equal(cmp.ap_b, c.per_query_ap("diagonal", {"r": 0.3, "seed": 1}, "bilinear")[ok])
    s = Searcher(data)
    for i in np.nonzero(ok)[0][:10]:
        tops = []
        for cfg, mode in ((left, "cosine"), (right, "bilinear")):
            res = s.search(data.features[i: i + 1], cfg.strategy, cfg.params, mode, 6)
            tops.append({int(r) for r in res.rows[0] if r != i} if i in res.rows[0] else set(res.rows[0][:5]))
        j = cmp.jaccard[int(np.nonzero(np.nonzero(ok)[0] == i)[0][0])]
        assert j == pytest.approx(len(tops[0] & tops[1]) / len(tops[0] | tops[1]))
    assert cmp.k == 5 and "Jaccard@5" in cmp.summary_text()
    low = cmp.disagreements("all", max_jaccard=0.5)
    assert low and all(r["jaccard"] <= 0.5 for r in low)
    assert {r["id"] for r in low} <= {r["id"] for r in cmp.disagreements("all")}


def test_identical_metrics_tie_everywhere(data):
    cmp = Comparer(data).compare(SearchConfig(), SearchConfig())
    s = cmp.summary()
    assert s["mean_jaccard"] == 1.0 and (cmp.jaccard == 1.0).all()
    assert s["tied"] == s["queries"] == 60 and s["mean_delta"] == 0.0 and s["sign_test_p"] == 1.0
    assert s["ci95"] == (0.0, 0.0) and cmp.disagreements() == []


def test_sign_test_and_bootstrap_against_hand_computation():
    # 7 improved, 2 worsened: P(X ≤ 2 | n=9, ½) doubled
    assert sign_test(7, 2) == pytest.approx(2 * (1 + 9 + 36) / 512)
    assert sign_test(0, 0) == 1.0
    d = np.array([0.5, -0.25, 0.0, 1.0])
    cmp = Comparison("a", "b", np.arange(4), np.zeros(4, dtype=int), np.zeros(4), d, seed=3)
    s = cmp.summary()
    assert (s["improved"], s["worsened"], s["tied"]) == (2, 1, 1) and s["mean_delta"] == pytest.approx(0.3125)
    assert s["sign_test_p"] == pytest.approx(1.0)  # 2 vs 1 of 3: two-sided p = 1
    # the bootstrap by hand: the same Generator draws, resampled means, percentiles
    rng = np.random.default_rng(3)
    means = np.concatenate([d[rng.integers(0, 4, size=(250, 4))].mean(1) for _ in range(8)])
    assert s["ci95"] == pytest.approx(tuple(np.percentile(means, [2.5, 97.5])))
    assert bootstrap_ci(np.array([]))[0] != bootstrap_ci(np.array([]))[0]  # NaN: nothing to resample
    assert math.isclose(bootstrap_ci(np.full(10, 0.2))[1], 0.2)


def test_indefinite_cosine_is_refused_like_search(data):
    from core.errors import UserError

    c = Comparer(data, Searcher(data))
    with pytest.raises(UserError, match="cosine mode needs a positive semi-definite"):
        c.per_query_ap("diagonal", {"r": 0.3, "seed": 1}, "cosine")
    assert c.resolve("diagonal", {"r": 0.3, "seed": 1}, "cosine") == "bilinear"


def test_jaccard_at_k_is_the_set_overlap():
    rng = np.random.default_rng(1)
    a = np.stack([rng.permutation(30)[:12] for _ in range(50)])
    b = np.stack([rng.permutation(30)[:12] for _ in range(50)])
    b[0] = a[0][::-1]  # the same set in another order
    a[1, 8:] = -1      # a shorter list (fewer items than k)
    for k in (1, 5, 12):
        got = jaccard_at_k(a, b, k)
        want = []
        for ra, rb in zip(a, b, strict=True):
            sa, sb = {int(v) for v in ra[:k] if v >= 0}, {int(v) for v in rb[:k] if v >= 0}
            want.append(len(sa & sb) / len(sa | sb))
        np.testing.assert_allclose(got, want)
    assert jaccard_at_k(a, b, 12)[0] == 1.0
    assert jaccard_at_k(np.full((1, 3), -1), np.full((1, 3), -1), 3)[0] == 1.0  # both empty: identical


# ---------------------------------------------------------------- configurations with a re-ranker
RERANKED = [SearchConfig("trained", {}, "cosine", "aqe", {"n": 3}),
            SearchConfig("identity", {}, "bilinear", "dba", {"n": 2, "alpha": 1.0}),
            SearchConfig("trained", {}, "cosine", "diffusion", {"k": 6, "kq": 3, "truncation": 30}),
            SearchConfig("spectral", {"p": 0.5}, "cosine", "kreciprocal", {"k1": 5, "k2": 2, "pool": 40}),
            SearchConfig("identity", {}, "cosine", "kreciprocal", {"k1": 2, "k2": 1, "pool": 3})]
# passes over the 60 queries: one at k = max(R, NEIGHBOURS) within the candidate pool; a pool below NEIGHBOURS
# (diffusion's truncation 30, kreciprocal's pool 40) adds one for the top lists; a pool below R (3 < 4) one at R
PASSES = [1, 1, 2, 2, 3]


@pytest.mark.parametrize("cfg, passes", list(zip(RERANKED, PASSES, strict=True)),
                         ids=[f"{c.rerank}-{i}" for i, c in enumerate(RERANKED)])
def test_reranked_per_query_ap_is_each_query_reranked_alone(data, cfg, passes, tmp_path, monkeypatch):
    """Every item as a query through `SearchConfig.search`, one at a time, itself left out: MAP@R
    from the first R of its re-ranked list, the top lists its first NEIGHBOURS (or fewer)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(compare, "RERANK_CHUNK", 7)  # several chunks, one of them short
    c = Comparer(data)
    seen = []
    ap = c.ap(cfg, progress=lambda done, total, what: seen.append((done, total)))
    top = c.top(cfg)
    y = data.items.labels
    n = len(y)
    for i in range(n):
        R = int((y == y[i]).sum()) - 1
        if R == 0:
            assert np.isnan(ap[i]) and (top[i] == -1).all()  # no relevant item: no query
            continue
        alone = cfg.search(c.searcher, np.asarray(data.features[i: i + 1]), R, self_ids=[i])
        want = per_query_metrics(y[alone.rows[:, :R]], y[i: i + 1], np.array([R]), ks=(1,))["map@r"][0]
        assert ap[i] == pytest.approx(want, abs=1e-12)
        deep = cfg.search(c.searcher, np.asarray(data.features[i: i + 1]), compare.NEIGHBOURS, self_ids=[i])
        m = min(compare.NEIGHBOURS, n - 1)
        np.testing.assert_array_equal(top[i, :m], deep.rows[0, :m])
        assert i not in top[i]
    assert seen[0] == (0, 60 * passes) and seen[-1] == (60 * passes, 60 * passes)
    assert len(seen) == 1 + passes * math.ceil(60 / 7)
    assert c.ap(cfg) is ap  # cached per configuration, re-ranker included
    assert c.holds(SearchConfig.of(cfg.strategy, cfg.params, cfg.mode, cfg.rerank, cfg.rerank_params))


def test_a_reranker_is_its_own_cache_entry_and_changes_the_comparison(data, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    c = Comparer(data)
    plain, aqe = SearchConfig("trained", {}, "cosine"), SearchConfig("trained", {}, "cosine", "aqe", {"n": 1})
    cmp = c.compare(plain, aqe, k=5)
    assert cmp.label_b == "trained · cosine · aqe(n=1, alpha=3.0)"
    ok = ~np.isnan(c.per_query_ap("trained", {}, "cosine"))
    np.testing.assert_array_equal(cmp.ap_a, c.per_query_ap("trained", {}, "cosine")[ok])  # the batched path
    np.testing.assert_array_equal(cmp.ap_b, c.ap(aqe)[ok])
    assert not np.array_equal(cmp.ap_a, cmp.ap_b)
    # "none" named explicitly is the plain configuration: the batched path, the same entry
    np.testing.assert_array_equal(c.ap(SearchConfig("trained", {}, "cosine", "none")), c.ap(plain))
    with pytest.raises(Exception, match="unknown re-ranker 'nope'"):
        c.compare(plain, SearchConfig("trained", {}, "cosine", "nope"))
