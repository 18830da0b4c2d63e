"""index/analysis/sweep.py: the batched sweep ranks exactly like the search path, for every strategy and mode."""
import numpy as np
import pytest
import torch

from evaluation.evaluator import evaluate_ranking
from index.analysis.sweep import GramSweep, symmetric_product
from index.backends.search import Searcher
from index.backends.store import in_memory_index
from index.refinements import refine
from index.refinements.paper import R_GRID

SETTINGS = [("trained", {}), ("identity", {}), ("diagonal", {"r": 0.3, "seed": 1}), ("diagonal", {"r": 1.0}),
            ("random", {"r": 0.6, "seed": 2}), ("shrink", {"alpha": 0.3}), ("spectral", {"p": 0.5})]


@pytest.fixture(scope="module")
def split():
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(12), 5)
    X = rng.normal(size=(12, 24))[y] + 0.8 * rng.normal(size=(60, 24))
    W = rng.normal(size=(6, 24))  # k = 6 < d / 2: trained and diagonal take their low-rank forms
    return X, y, W


@pytest.mark.parametrize("name, params", SETTINGS)
@pytest.mark.parametrize("mode", ["bilinear", "cosine"])
def test_sweep_equals_search_path(split, name, params, mode):
    X, y, W = split
    s = Searcher(in_memory_index(X, y, W, normalize=True))
    rm = s.metric(name, params)
    if mode == "cosine" and not rm.report["psd"]:
        pytest.skip("cosine needs a PSD M′ (diagonal restraint is indefinite here)")
    transform, index, _ = s.query_view(name, params, mode)
    q = np.asarray(s.data.features)
    ref = evaluate_ranking(index, transform(q), y, y, same_set=True)
    sweep = GramSweep(q, y, s.data.W)
    got = sweep.evaluate(sweep.scores(rm.M, rm.op), mode)
    for key in ("map@r", "precision@1", "r_precision", "recall@1", "recall@4", "n_queries"):
        assert got[key] == pytest.approx(ref[key], abs=1e-9), key


def test_structured_scores_equal_the_dense_product(split):
    X, y, W = split
    s = Searcher(in_memory_index(X, y, W, normalize=True))
    q = np.asarray(s.data.features, dtype=np.float64)
    sweep = GramSweep(q, y, s.data.W)
    for name, params in SETTINGS:
        rm = s.metric(name, params)
        S = sweep.scores(rm.M, rm.op).numpy()
        assert np.allclose(S, q @ rm.M @ q.T, atol=1e-4), (name, rm.op.kind)
    assert {s.metric(n, p).op.kind for n, p in SETTINGS} >= {"identity", "lowrank", "lowrank-diag", "spectral",
                                                             "dense"}


def test_nested_diagonal_restraint_equals_each_setting_computed_alone(split):
    """One seed's draws are nested in r: each S is built from the previous one's, and must
    equal the product computed from scratch, in either order of r."""
    X, y, W = split
    s = Searcher(in_memory_index(X, y, W, normalize=True))
    q = np.asarray(s.data.features, dtype=np.float64)
    for rs in (R_GRID, R_GRID[::-1]):
        sweep = GramSweep(q, y, s.data.W)
        for r in rs:
            rm = s.metric("diagonal", {"r": r, "seed": 3})
            assert np.allclose(sweep.scores(rm.M, rm.op).numpy(), q @ rm.M @ q.T, atol=1e-4), r


def test_evaluation_leaves_the_score_matrix_as_it_was(split):
    X, y, W = split
    s = Searcher(in_memory_index(X, y, W, normalize=True))
    sweep = GramSweep(np.asarray(s.data.features), y, s.data.W)
    rm = s.metric("spectral", {"p": 0.5})
    S = sweep.scores(rm.M, rm.op)
    before = S.clone()
    a = sweep.evaluate(S, "cosine")
    assert torch.equal(S, before)
    assert sweep.evaluate(S, "cosine") == a


def test_symmetric_product_equals_the_full_product():
    rng = np.random.default_rng(1)
    A = rng.normal(size=(37, 5)).astype(np.float32)
    C = rng.normal(size=(5, 5)).astype(np.float32)
    C = C + C.T
    for blocks in (1, 4, 10, 50):
        assert np.allclose(symmetric_product(A @ C, A, blocks), (A @ C) @ A.T, atol=1e-4), blocks


@pytest.mark.parametrize("name, params", [("spectral", {"p": 0.0}), ("spectral", {"p": 1.5}),
                                          ("shrink", {"alpha": 0.0}), ("shrink", {"alpha": 0.7}),
                                          ("shrink", {"alpha": 1.0})])
def test_spectral_operator_applies_m_prime_exactly(split, name, params):
    """M′ = cI + UΛUᵀ found from the eigendecomposition; applying it equals M′q, and its
    eigenvalues are M′'s (they feed the matrix report)."""
    X, y, W = split
    s = Searcher(in_memory_index(X, y, W, normalize=True))
    rm = s.metric(name, params)
    assert rm.op.kind == "spectral"
    assert rm.op.spectral[2].shape[1] <= W.shape[0]  # the low-rank part lives in M*'s range
    # the identity part: α/d for shrinkage, exactly 0 otherwise (no Φ Φᵀ term in a sweep)
    c = params.get("alpha", 0.0) / X.shape[1] if name == "shrink" else 0.0
    assert rm.op.spectral[0] == pytest.approx(c, rel=1e-9, abs=0)
    q = np.asarray(s.data.features[:7], dtype=np.float64)
    assert np.allclose(rm.op.apply(q), q @ refine(name, s.data.M_star, params), atol=1e-5)
    assert np.allclose(np.sort(rm.op.eigenvalues), np.linalg.eigvalsh(rm.M), atol=1e-10)



def test_spectral_operator_falls_back_to_dense_without_low_rank_structure(split):
    X, y, _ = split
    W = np.random.default_rng(5).normal(size=(24, 24))  # M* of full rank: no cI + low-rank form
    s = Searcher(in_memory_index(X, y, W, normalize=True))
    rm = s.metric("spectral", {"p": 0.5})
    assert rm.op.kind == "dense"
    q = np.asarray(s.data.features[:5], dtype=np.float64)
    assert np.allclose(rm.op.apply(q), q @ rm.M, atol=1e-5)
    assert rm.report["min_eigenvalue"] == pytest.approx(np.linalg.eigvalsh(rm.M).min(), abs=1e-10)
