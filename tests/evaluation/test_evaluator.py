"""The evaluator against a brute-force computation written here, independently."""
import numpy as np
import pytest

from evaluation import evaluate
from evaluation.clustering import pairwise_f1


def brute_force(q, ql, g, gl, same_set, ks, cosine=True):
    if cosine:
        q = q / np.linalg.norm(q, axis=1, keepdims=True)
        g = g / np.linalg.norm(g, axis=1, keepdims=True)
        sim = q @ g.T
    else:
        sim = -((q[:, None, :] - g[None, :, :]) ** 2).sum(-1)
    res = {f"recall@{k}": [] for k in ks} | {"precision@1": [], "r_precision": [], "map@r": []}
    skipped = 0
    for i in range(len(q)):
        cand = [j for j in range(len(g)) if not (same_set and j == i)]
        order = sorted(cand, key=lambda j: -sim[i, j])
        rel = [gl[j] == ql[i] for j in order]
        R = sum(rel)
        if R == 0:
            skipped += 1
            continue
        for k in ks:
            res[f"recall@{k}"].append(float(any(rel[:k])))
        res["precision@1"].append(float(rel[0]))
        res["r_precision"].append(sum(rel[:R]) / R)
        hits, ap = 0, 0.0
        for pos in range(R):
            if rel[pos]:
                hits += 1
                ap += hits / (pos + 1)
        res["map@r"].append(ap / R)
    out = {k: float(np.mean(v)) for k, v in res.items()}
    out["n_queries"] = len(q) - skipped
    out["n_skipped_queries"] = skipped
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_set_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, d, c = 120, 8, 9
    labels = rng.integers(0, c, n)
    centers = rng.normal(size=(c, d))
    x = centers[labels] + 0.9 * rng.normal(size=(n, d))
    labels[0] = 99  # a lone query: nothing to retrieve
    ks = (1, 2, 4, 8, 16)
    got = evaluate(x, labels, ks=ks, clustering=False, chunk=17)  # small chunks on purpose
    want = brute_force(x, labels, x, labels, True, ks)
    assert got["n_skipped_queries"] == 1 and got["n_queries"] == n - 1
    for key, v in want.items():
        assert got[key] == pytest.approx(v, abs=1e-9), key


def test_separate_query_gallery_matches_brute_force():
    rng = np.random.default_rng(5)
    q, g = rng.normal(size=(40, 6)), rng.normal(size=(90, 6))
    ql, gl = rng.integers(0, 7, 40), rng.integers(0, 6, 90)  # label 6 only in queries
    got = evaluate(q, ql, g, gl, ks=(1, 4), clustering=False)
    want = brute_force(q, ql, g, gl, False, (1, 4))
    assert got["n_skipped_queries"] == int((ql == 6).sum()) > 0
    for key, v in want.items():
        assert got[key] == pytest.approx(v, abs=1e-9), key


def test_euclidean_without_normalization_matches_brute_force():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(60, 5)) * rng.uniform(0.1, 5, size=(60, 1))  # norms matter here
    y = rng.integers(0, 5, 60)
    got = evaluate(x, y, normalize=False, ks=(1, 2), clustering=False)
    want = brute_force(x, y, x, y, True, (1, 2), cosine=False)
    for key, v in want.items():
        assert got[key] == pytest.approx(v, abs=1e-9), key


def test_self_is_excluded_by_id_even_with_duplicates():
    # Many exact duplicates: FAISS may rank a twin before the query itself, so a
    # position-based "drop the first neighbour" would keep self.  Ours never does.
    from evaluation.knn import knn_search

    rng = np.random.default_rng(0)
    base = rng.normal(size=(10, 4)).astype(np.float32)
    x = np.repeat(base, 5, axis=0)  # every vector five times
    _, ids = knn_search(x, x, k=6, metric="l2", exclude_self=True, chunk=7)
    assert ids.shape == (50, 6)
    assert not (ids == np.arange(50)[:, None]).any()
    # all four twins come before anything else
    for i in range(50):
        assert set(ids[i, :4]) == {j for j in range(i - i % 5, i - i % 5 + 5) if j != i}


def test_clustering_scores_are_nmi_and_f1_of_kmeans():
    from sklearn.metrics import normalized_mutual_info_score

    from evaluation.clustering import kmeans_labels

    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(6), 10)
    x = (np.eye(6) * 10)[y] + 0.01 * rng.normal(size=(60, 6))
    got = evaluate(x, y)
    assert got["map@r"] == pytest.approx(1.0) and got["recall@1"] == 1.0
    xn = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    clusters = kmeans_labels(xn, 6)
    assert got["nmi"] == pytest.approx(normalized_mutual_info_score(y, clusters))
    assert got["f1"] == pytest.approx(pairwise_f1(y, clusters))
    assert got["nmi"] > 0.8  # k-means may merge two blobs (one init, as in PML), not more


def test_pairwise_f1_against_counting():
    rng = np.random.default_rng(1)
    y, c = rng.integers(0, 4, 50), rng.integers(0, 5, 50)
    tp = fp = fn = 0
    for i in range(50):
        for j in range(i + 1, 50):
            same_c, same_y = c[i] == c[j], y[i] == y[j]
            tp += same_c and same_y
            fp += same_c and not same_y
            fn += same_y and not same_c
    p, r = tp / (tp + fp), tp / (tp + fn)
    assert pairwise_f1(y, c) == pytest.approx(2 * p * r / (p + r))


def test_rejects_nan_and_mismatched_dims():
    from core.errors import UserError

    with pytest.raises(UserError, match="NaN"):
        evaluate(np.array([[np.nan, 1.0], [1.0, 0.0]]), [0, 0])
    with pytest.raises(UserError, match="query dimension 2 differs from gallery dimension 4"):
        evaluate(np.ones((3, 2)), [0, 0, 1], np.ones((3, 4)), [0, 1, 1])


@pytest.mark.parametrize("labels, message", [
    (np.array([0.0, 0.5, 1.0, 1.0]), r"integer class ids; found \[0.5\]"),
    (np.array(["a", "b", "a", "b"]), "integer class ids, got dtype <U1"),
    (np.array([0, 1, 2, 3]), "no query has a positive"),
    (np.array([[0, 0], [1, 1]]).reshape(4, 1), "must be 1-D"),
    (np.array([7, 7, 7, 7]), "need at least 2 classes"),
])
def test_degenerate_inputs_are_refused_not_nan(labels, message):
    from core.errors import UserError

    x = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    with pytest.raises(UserError, match=message):
        evaluate(x, labels)


def test_empty_and_single_row_are_refused_integral_floats_accepted():
    from core.errors import UserError

    with pytest.raises(UserError, match="empty input"):
        evaluate(np.zeros((0, 3), np.float32), np.zeros(0, np.int64))
    with pytest.raises(UserError, match="no query has a positive"):
        evaluate(np.ones((1, 3), np.float32), np.array([0]))
    x = np.eye(4, dtype=np.float32)
    res = evaluate(x, np.array([0.0, 0.0, 1.0, 1.0]), clustering=False)  # integral floats are class ids
    assert res["n_queries"] == 4 and np.isfinite(res["map@r"])
