"""index/sweep.py: the batched sweep ranks exactly like the search path, for every strategy and mode."""
import numpy as np
import pytest

from evaluation.evaluator import evaluate_ranking
from index.search import Searcher
from index.store import in_memory_index
from index.sweep import GramSweep

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
    got = sweep.evaluate(sweep.scores(rm.M, rm.op.kind, rm.op.diag_removed), mode)
    for key in ("map@r", "precision@1", "r_precision", "recall@1", "recall@4", "n_queries"):
        assert got[key] == pytest.approx(ref[key], abs=1e-9), key


def test_structured_scores_equal_the_dense_product(split):
    X, y, W = split
    s = Searcher(in_memory_index(X, y, W, normalize=True))
    q = np.asarray(s.data.features, dtype=np.float64)
    sweep = GramSweep(q, y, s.data.W)
    for name, params in SETTINGS:
        rm = s.metric(name, params)
        S = sweep.scores(rm.M, rm.op.kind, rm.op.diag_removed).numpy()
        assert np.allclose(S, q @ rm.M @ q.T, atol=1e-4), (name, rm.op.kind)
    assert {s.metric(n, p).op.kind for n, p in SETTINGS} >= {"identity", "lowrank", "lowrank-diag", "dense"}
