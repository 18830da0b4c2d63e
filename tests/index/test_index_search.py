"""Search under refined metrics returns exactly the brute-force top-k, for every strategy."""
import numpy as np
import pytest
from dense_reference import m_norms

from core.errors import UserError
from index.backends.search import Searcher
from index.backends.store import Items, read_index, write_index
from index.metric import matrix_report
from index.refinements import REFINEMENTS, refine

D, K_EMB, N = 24, 6, 300


def make_index(tmp_path, factory=None, normalize=True, seed=0, n=N):
    rng = np.random.default_rng(seed)
    feats = np.abs(rng.normal(size=(n, D))).astype(np.float32)  # ReLU-like trunk features
    W = rng.normal(size=(K_EMB, D)).astype(np.float32)
    items = Items(np.arange(100, 100 + n), rng.integers(0, 20, n), [f"img/{i}.png" for i in range(n)],
                  ["test"] * n)
    write_index(tmp_path / "idx", feats, items, W, factory=factory, normalize=normalize,
                info={"backbone": "synthetic", "checkpoint_sha256": None})
    return read_index(tmp_path / "idx"), feats, W


def bilinear_scores(Q, X, M):
    """The reference similarity Q M′ Xᵀ, in float64."""
    return (Q.astype(np.float64) @ M) @ X.astype(np.float64).T


def brute_force(feats, q, M, mode, normalize):
    if normalize:
        feats = feats / np.linalg.norm(feats, axis=1, keepdims=True)
        q = q / np.linalg.norm(q, axis=1, keepdims=True)
    s = bilinear_scores(q, feats, M)
    if mode == "cosine":
        s = s / m_norms(q, M)[:, None] / m_norms(feats, M)[None, :]
    return s


def assert_topk_exact(res, S, k):
    """Returned rows are a true top-k (ties allowed) and carry their true scores."""
    for i in range(len(S)):
        rows = res.rows[i]
        np.testing.assert_allclose(res.scores[i], S[i, rows], rtol=1e-4, atol=1e-4)
        kth = np.sort(S[i])[::-1][k - 1]
        assert S[i, rows].min() >= kth - 1e-4 * max(1.0, abs(kth))
        assert np.all(np.diff(res.scores[i]) <= 1e-5)  # best first


STRATEGY_CASES = [("trained", {}), ("identity", {}), ("diagonal", {"r": 0.5, "seed": 1}),
                  ("diagonal", {"r": 1.0}), ("random", {"r": 0.3, "seed": 2}), ("random", {"r": 1.0}),
                  ("shrink", {"alpha": 0.3}), ("spectral", {"p": 0.5}), ("spectral", {"p": 0.0})]


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("strategy,params", STRATEGY_CASES)
def test_flat_bilinear_is_exact_for_psd_and_indefinite(tmp_path, strategy, params, normalize):
    data, feats, W = make_index(tmp_path, normalize=normalize)
    s = Searcher(data)
    q = np.abs(np.random.default_rng(9).normal(size=(15, D))).astype(np.float32)
    M = refine(strategy, W.T.astype(np.float64) @ W, params)
    res = s.search(q, strategy, params, mode="bilinear", k=10)
    assert_topk_exact(res, brute_force(feats, q, M, "bilinear", normalize), 10)


@pytest.mark.parametrize("strategy,params", [c for c in STRATEGY_CASES if c[0] in
                                             ("trained", "identity", "shrink", "spectral")])
def test_flat_cosine_is_exact_for_psd(tmp_path, strategy, params):
    data, feats, W = make_index(tmp_path)
    s = Searcher(data)
    q = np.abs(np.random.default_rng(4).normal(size=(12, D))).astype(np.float32)
    M = refine(strategy, W.T.astype(np.float64) @ W, params)
    res = s.search(q, strategy, params, mode="cosine", k=7)
    assert_topk_exact(res, brute_force(feats, q, M, "cosine", True), 7)


def test_trained_cosine_is_cosine_of_embeddings(tmp_path):
    data, feats, W = make_index(tmp_path)
    q = np.abs(np.random.default_rng(2).normal(size=(3, D))).astype(np.float32)
    res = Searcher(data).search(q, "trained", mode="cosine", k=5)
    fn = feats / np.linalg.norm(feats, axis=1, keepdims=True)
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    e, eq = fn @ W.T, qn @ W.T
    cos = (eq / np.linalg.norm(eq, axis=1, keepdims=True)) @ (e / np.linalg.norm(e, axis=1, keepdims=True)).T
    for i in range(3):
        np.testing.assert_allclose(res.scores[i], np.sort(cos[i])[::-1][:5], rtol=1e-4, atol=1e-5)


def test_cosine_refuses_indefinite(tmp_path):
    data, _, W = make_index(tmp_path)
    M = refine("diagonal", W.T.astype(np.float64) @ W, {"r": 1.0})
    assert not matrix_report(M)["psd"]
    with pytest.raises(UserError, match="positive semi-definite"):
        Searcher(data).search(np.ones((1, D)), "diagonal", {"r": 1.0}, mode="cosine")


@pytest.mark.parametrize("mode", ["bilinear", "cosine"])
def test_hnsw_rerank_is_exact_on_its_candidates_and_high_recall(tmp_path, mode):
    data, feats, W = make_index(tmp_path, factory="HNSW16", n=2000)
    assert data.manifest["index_type"] == "approximate"
    s = Searcher(data)
    q = np.abs(np.random.default_rng(5).normal(size=(20, D))).astype(np.float32)
    M = refine("shrink", W.T.astype(np.float64) @ W, {"alpha": 0.5})
    res = s.search(q, "shrink", {"alpha": 0.5}, mode=mode, k=10)
    S = brute_force(feats, q, M, mode, True)
    recall = np.mean([len(set(res.rows[i]) & set(np.argsort(-S[i])[:10])) / 10 for i in range(20)])
    assert recall >= 0.9
    for i in range(20):  # scores are the exact ones
        np.testing.assert_allclose(res.scores[i], S[i, res.rows[i]], rtol=1e-4, atol=1e-4)


def test_bad_queries_and_k(tmp_path):
    data, _, _ = make_index(tmp_path)
    s = Searcher(data)
    with pytest.raises(UserError, match="dimension 5"):
        s.search(np.ones((1, 5)))
    with pytest.raises(UserError, match="k must be"):
        s.search(np.ones((1, D)), k=0)
    with pytest.raises(UserError, match="unknown refinement strategy 'magic'"):
        s.search(np.ones((1, D)), "magic")
    res = s.search(np.ones((1, D)), k=N + 5)  # more than the index holds: padded, not an error
    assert (res.rows[0, :N] >= 0).all() and (res.rows[0, N:] == -1).all()


def test_strategy_registry_is_complete():
    assert {"trained", "identity", "diagonal", "random", "custom", "shrink", "spectral"} <= set(REFINEMENTS.names())


def test_metric_cache_churn_and_concurrency(tmp_path):
    """Many strategies (more than the cache holds), from several threads: always the right M′."""
    import threading

    data, feats, W = make_index(tmp_path)
    s = Searcher(data)
    q = np.abs(np.random.default_rng(1).normal(size=(2, D))).astype(np.float32)
    errors = []

    def work(t):
        try:
            for seed in range(12):
                params = {"r": 0.3, "seed": seed + 100 * t}
                res = s.search(q, "random", params, k=5)
                M = refine("random", W.T.astype(np.float64) @ W, params)
                assert_topk_exact(res, brute_force(feats, q, M, "bilinear", True), 5)
        except Exception as e:
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert errors == []


@pytest.mark.parametrize("name, params", [("trained", {}), ("identity", {}), ("shrink", {"alpha": 0.4}),
                                          ("spectral", {"p": 0.5}), ("random", {"r": 0.0, "seed": 1})])
def test_operator_m_norms_equal_the_dense_ones(tmp_path, name, params):
    data, feats, _ = make_index(tmp_path)
    rm = Searcher(data).metric(name, params)
    X = np.asarray(data.features)
    assert np.allclose(rm.op.m_norms(X), m_norms(X, rm.M), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["trained", "identity"])
def test_operator_eigenvalues_give_the_same_matrix_report(tmp_path, name):
    """trained's eigenvalues come from W's singular values, identity's are ones: the report
    (PSD, rank, min eigenvalue) equals the one from an eigvalsh of M′."""
    data, _, _ = make_index(tmp_path)
    rm = Searcher(data).metric(name, {})
    assert rm.op.eigenvalues is not None
    fast, ref = rm.report, matrix_report(rm.M)
    assert fast["psd"] == ref["psd"] and fast["rank"] == ref["rank"]
    assert fast["min_eigenvalue"] == pytest.approx(ref["min_eigenvalue"], abs=1e-9)
    assert np.allclose(np.sort(rm.op.eigenvalues), np.linalg.eigvalsh(rm.M), atol=1e-9)
