"""The Milvus backend (index/backends/milvus_store.py) on Milvus Lite: the same top-k as FAISS Flat under
every strategy, metric type IP only, and the export/search CLI."""
import json

import numpy as np
import pytest

pytest.importorskip("pymilvus", reason="the Milvus backend needs pymilvus and milvus-lite: "
                                       "pip install -r requirements-milvus.txt")

from core.errors import UserError
from index.backends.milvus_store import MilvusGallery, export_index
from index.backends.search import Searcher
from index.backends.store import Items, read_index, write_index
from index.cli import main

pytestmark = pytest.mark.milvus

N, DIM, K = 400, 16, 10
STRATEGIES = [("trained", {}), ("identity", {}), ("diagonal", {"r": 0.5, "seed": 0}), ("random", {"r": 0.5, "seed": 1})]


@pytest.fixture(scope="module")
def gallery(tmp_path_factory):
    t = tmp_path_factory.mktemp("milvus")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((N, DIM)).astype(np.float32)
    items = Items(np.arange(N) * 7 + 3, rng.integers(0, 9, N), [f"img/{i}.png" for i in range(N)], ["gallery"] * N)
    idx = write_index(t / "idx", X, items, rng.standard_normal((5, DIM)).astype(np.float32), normalize=True,
                      info={"backbone": "none"})
    assert export_index(idx, str(t / "g.db"), "gal") == N
    g = MilvusGallery(str(t / "g.db"), "gal")
    yield t, Searcher(read_index(idx)), g, rng.standard_normal((12, DIM)).astype(np.float32)
    g.close()


def assert_same_top_k(faiss_res, rows, scores):
    """The same rows, in the same order, up to ties: equal scores, and any row that differs
    scores the same as the one FAISS put there."""
    np.testing.assert_allclose(scores, faiss_res.scores, rtol=1e-5, atol=1e-5)
    differ = rows != faiss_res.rows
    assert differ.mean() < 0.05
    np.testing.assert_allclose(scores[differ], faiss_res.scores[differ], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name,params", STRATEGIES)
def test_top_k_equals_faiss_flat(gallery, name, params):
    _, s, g, Q = gallery
    res = g.search_metric(Q, g.strategy_metric(name, params), K)
    assert_same_top_k(s.search(Q, name, params, "bilinear", K), res.rows, res.scores)
    # metadata comes back with each hit
    h = res.results()[0][0]
    r = int(res.rows[0, 0])
    assert h["id"] == res.ids[0, 0] == int(s.data.items.ids[r]) and h["relative_path"] == f"img/{r}.png"
    np.testing.assert_array_equal(res.labels, s.data.items.labels[res.rows])


def test_cosine_under_psd_metric_re_ranks_exactly(gallery):
    _, s, g, Q = gallery
    res = g.search_metric(Q, g.strategy_metric("trained", {}, "cosine"), K)
    assert_same_top_k(s.search(Q, "trained", {}, "cosine", K), res.rows, res.scores)
    with pytest.raises(UserError, match="cosine mode needs a positive semi-definite M′"):
        g.strategy_metric("diagonal", {"r": 0.5}, "cosine")


def test_collection_uses_inner_product_never_cosine(gallery):
    t, _, g, _ = gallery
    assert g.client.describe_index("gal", "vector")["metric_type"] == "IP"
    # a collection re-indexed with COSINE would normalise M′q: opening it is refused
    export_index(t / "idx", str(t / "g.db"), "cos")
    g.client.release_collection("cos")
    g.client.drop_index("cos", "vector")
    ip = g.client.prepare_index_params()
    ip.add_index("vector", index_type="FLAT", metric_type="COSINE")
    g.client.create_index("cos", ip)
    with pytest.raises(UserError, match="indexes with metric COSINE; searching under M′ needs IP"):
        MilvusGallery(str(t / "g.db"), "cos")


def test_cli_export_and_search_match_faiss(gallery, capsys):
    t, _, g, Q = gallery
    np.save(t / "q.npy", Q[:3])
    uri = str(t / "g.db")  # the fixture's open database: its Milvus Lite server is running already
    assert main(["export", "--to", "milvus", "--index", str(t / "idx"), "--uri", uri, "--collection", "c"]) == 0
    assert json.loads(capsys.readouterr().out)["exported"] == N
    with pytest.raises(UserError, match="already exists"):
        main(["export", "--to", "milvus", "--index", str(t / "idx"), "--uri", uri, "--collection", "c"])
    common = ["search", "--features", str(t / "q.npy"), "--strategy", "diagonal", "--r", "0.5", "--k", "5"]
    assert main(common + ["--index", str(t / "idx")]) == 0
    want = json.loads(capsys.readouterr().out)
    assert main(common + ["--backend", "milvus", "--uri", uri, "--collection", "c"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["backend"] == "milvus" and got["params"] == want["params"] == {"r": 0.5}
    for a, b in zip(got["queries"], want["queries"], strict=True):
        assert [r["id"] for r in a["results"]] == [r["id"] for r in b["results"]]
        np.testing.assert_allclose([r["score"] for r in a["results"]], [r["score"] for r in b["results"]], rtol=1e-5)
    with pytest.raises(UserError, match="--backend milvus needs --uri and --collection"):
        main(common + ["--backend", "milvus"])
    with pytest.raises(UserError, match="a file path ending in .db for Milvus Lite"):
        main(common + ["--backend", "milvus", "--uri", str(t / "x.sqlite"), "--collection", "c"])
