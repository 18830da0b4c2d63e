"""Decoupled diffusion (Yang et al. AAAI 2019) against a transcription of its official code
(fyang93/diffusion: diffusion.py `get_offline_results`, `get_laplacian`, `get_affinity`;
rank.py `search_old`), written here on dense numpy arrays and scipy's own `cg`."""
import json

import numpy as np
import pytest
from scipy import sparse
from scipy.sparse import linalg

from index.backends.search import Searcher
from index.backends.store import Items, read_index, write_index
from index.rerankers import SearcherSpace, rerank, reranker_params
from index.rerankers.diffusion_offline import batched_cg, offline_rows


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def official(G: np.ndarray, Q: np.ndarray, n_trunc: int, kd: int, kq: int, gamma=3.0, alpha=0.99):
    """fyang93/diffusion on L2-normalised features G (gallery) and Q (queries), exact k-NN (its
    `KNN` below 10⁵ items): the offline N × N matrix and each query's scores over the gallery."""
    N = len(G)
    sims = G @ G.T
    ids = np.argsort(-sims, axis=1, kind="stable")
    sims = np.take_along_axis(sims, ids, 1)
    trunc_ids = ids[:, :n_trunc]
    s, i = sims[:, :kd].copy(), ids[:, :kd]
    s[s < 0] = 0
    s = s ** gamma
    vec, mut, val = [], [], []
    for r in range(N):  # get_affinity
        ismutual = np.isin(i[i[r]], r).any(axis=1)
        ismutual[0] = False
        vec.append(np.full(ismutual.sum(), r))
        mut.append(i[r, ismutual])
        val.append(s[r, ismutual])
    A = sparse.csc_matrix((np.concatenate(val), (np.concatenate(vec), np.concatenate(mut))), shape=(N, N))
    degrees = A @ np.ones(N) + 1e-12  # get_laplacian
    D = sparse.dia_matrix((degrees ** -0.5, [0]), shape=(N, N))
    lap = sparse.eye(N) - alpha * (D @ A @ D)
    lap = sparse.csr_matrix(lap)
    init = np.zeros(n_trunc)
    init[0] = 1
    offline = np.zeros((N, N))
    for r in range(N):  # get_offline_result
        t = trunc_ids[r]
        f, _ = linalg.cg(lap[t][:, t], init, rtol=1e-6, maxiter=20)
        offline[r, t] = f
    qs = Q @ G.T  # search_old
    qi = np.argsort(-qs, axis=1, kind="stable")[:, :kq]
    w = np.take_along_axis(qs, qi, 1) ** gamma
    return offline, np.stack([w[b] @ offline[qi[b]] for b in range(len(Q))])


def gallery(tmp_path, n=240, d=12, seed=0):
    rng = np.random.default_rng(seed)
    centres = 3 * rng.normal(size=(8, d))
    x = (centres[np.arange(n) % 8] + rng.normal(size=(n, d))).astype(np.float32)
    items = Items(np.arange(n), (np.arange(n) % 8).astype(np.int64), [f"{i}.png" for i in range(n)], ["test"] * n)
    write_index(tmp_path / "idx", x, items, np.eye(d, dtype=np.float32), normalize=True, info={"backbone": "t"})
    searcher = Searcher(read_index(tmp_path / "idx"))
    G = np.asarray(searcher.data.features, dtype=np.float64)
    return SearcherSpace(searcher, "identity", {}, "bilinear"), G, rng


def test_batched_cg_is_scipys_cg_system_by_system():
    rng = np.random.default_rng(1)
    B, T = 5, 40
    blocks = []
    for b in range(B):
        M = rng.normal(size=(T, T))
        blocks.append(np.eye(T) * (1 + b) + 0.05 * (M @ M.T))  # SPD, conditioned differently: stops differ
    y = rng.normal(size=(B, T))
    y[3] = 0.0  # a zero right-hand side: x = 0
    for steps, tol in ((3, 1e-6), (20, 1e-6), (200, 1e-9), (200, 1e-2)):
        got = batched_cg(lambda P: np.stack([blocks[b] @ P[b] for b in range(B)]), y, tol, steps)
        for b in range(B):
            want, _ = linalg.cg(blocks[b], y[b], rtol=tol, maxiter=steps)
            np.testing.assert_allclose(got[b], want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("n_trunc,kd", [(60, 10), (240, 50)])
def test_offline_rows_and_query_scores_equal_the_official_code(tmp_path, n_trunc, kd):
    space, G, rng = gallery(tmp_path)
    p = {"item_truncation": n_trunc, "k": kd, "kq": 10}
    F = offline_rows(space, reranker_params("diffusion_offline", p))
    Q = G[:6] + 0.3 * rng.normal(size=(6, G.shape[1]))
    Q /= np.linalg.norm(Q, axis=1, keepdims=True)
    off, want = official(G, Q, n_trunc, kd, 10)
    n = len(G)
    dense = np.zeros((n, n))
    rows, f = np.asarray(F["rows"]), np.asarray(F["f"], dtype=np.float64)
    np.put_along_axis(dense, rows.astype(np.int64), f, 1)
    np.testing.assert_allclose(dense, off, rtol=1e-4, atol=1e-6)  # float32 rows
    assert np.median(np.count_nonzero(off, axis=1)) > kd  # the diffusion reaches beyond an item's own list
    got = rerank("diffusion_offline", space, Q.astype(np.float32), 30, params=p)
    for b in range(len(Q)):
        reached = np.flatnonzero(want[b] != 0)
        order = reached[np.lexsort((reached, -want[b][reached]))][:30]
        # float32 rows: equal to rank.py's scores within their rounding, and the same items on top
        np.testing.assert_allclose(got.scores[b][: len(order)], want[b][order], rtol=1e-4, atol=1e-7)
        assert len(set(got.rows[b][:10]) & set(order[:10])) >= 9


def test_the_graph_command_builds_the_rows_that_searches_read(tmp_path, capsys, monkeypatch):
    """`index graph --rerank diffusion_offline` stores every item's row beside the index (memory-
    mapped blocks); a search at the same parameters reads them, builds nothing, and answers as the
    re-ranker built on its own does.  A re-ranker with no offline part of its own is refused."""
    from core.errors import UserError
    from index.cli import main
    from index.rerankers import diffusion_offline

    space, G, _ = gallery(tmp_path)
    idx = ["--index", str(tmp_path / "idx"), "--strategy", "identity", "--mode", "bilinear"]
    params = ["--rerank", "diffusion_offline", "--rerank-param", "k=10,item_truncation=48"]
    assert main(["graph", *idx, "--no-progress", *params]) == 0
    assert "diffusion_offline's offline part (k=10, kq=10, item_truncation=48" in capsys.readouterr().out
    stored = list((tmp_path / "xdg" / "dml-retrieval" / "rerank").glob("*/diffusion-offline-*.blocks"))
    assert len(stored) == 1
    built = []
    monkeypatch.setattr(diffusion_offline, "offline_block", lambda *a: built.append(1))
    np.save(tmp_path / "q.npy", G[:3].astype(np.float32))
    assert main(["search", *idx, "--features", str(tmp_path / "q.npy"), *params, "--k", "5",
                 "--json", str(tmp_path / "out.json")]) == 0
    assert not built  # read from the stored rows
    monkeypatch.undo()
    got = rerank("diffusion_offline", space, G[:3].astype(np.float32), 5, params={"k": 10, "item_truncation": 48})
    answer = json.loads((tmp_path / "out.json").read_text())["queries"]
    assert [[r["id"] for r in q["results"]] for q in answer] == got.rows.tolist()  # the items' ids are their rows
    np.testing.assert_allclose([[r["score"] for r in q["results"]] for q in answer], got.scores, rtol=1e-6)
    with pytest.raises(UserError, match="re-ranker 'aqe' has no offline part beyond the neighbour lists"):
        main(["graph", *idx, "--rerank", "aqe"])
