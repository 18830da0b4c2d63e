"""The Milvus backend (index/backends/milvus_store.py) on Milvus Lite and on a real Milvus server
(tests/milvus_server.py; each module fixture its own database there): the same top-k as FAISS Flat
under every strategy, metric type IP only, the export/search CLI, and every re-ranker with the
results it gives on the in-RAM index."""
import json

import numpy as np
import pytest

pytest.importorskip("pymilvus", reason="the Milvus backend needs pymilvus and milvus-lite: "
                                       "pip install -r requirements-milvus.txt")

from core.errors import UserError
from index.backends.milvus_space import MilvusSpace
from index.backends.milvus_store import MilvusGallery, export_features, export_index
from index.backends.search import Searcher
from index.backends.store import Items, read_index, write_index
from index.cli import main
from index.rerankers import RERANKERS
from index.search_config import SearchConfig

pytestmark = pytest.mark.milvus

N, DIM, K = 400, 16, 10
BACKENDS = ["lite", "server"]
STRATEGIES = [("trained", {}), ("identity", {}), ("diagonal", {"r": 0.5, "seed": 0}), ("random", {"r": 0.5, "seed": 1})]


@pytest.fixture(scope="module", params=BACKENDS)
def milvus_at(request):
    """Where a module fixture's collections go: `at(folder, name)` is a Milvus Lite file in the
    folder, or a new database on the server (dropped, collections and all, at the module's end)."""
    if request.param == "lite":
        yield lambda t, name: str(t / f"{name}.db")
        return
    server = request.getfixturevalue("milvus_server")
    made: list[str] = []

    def at(t, name):
        made.append(server.database(name))
        return made[-1]
    yield at
    for uri in made:
        server.drop_database(uri)


@pytest.fixture(scope="module")
def gallery(tmp_path_factory, milvus_at):
    t = tmp_path_factory.mktemp("milvus")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((N, DIM)).astype(np.float32)
    items = Items(np.arange(N) * 7 + 3, rng.integers(0, 9, N), [f"img/{i}.png" for i in range(N)], ["gallery"] * N)
    idx = write_index(t / "idx", X, items, rng.standard_normal((5, DIM)).astype(np.float32), normalize=True,
                      info={"backbone": "none"})
    uri = milvus_at(t, "g")
    assert export_index(idx, uri, "gal") == N
    g = MilvusGallery(uri, "gal")
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
    export_index(t / "idx", g.uri, "cos")
    g.client.release_collection("cos")
    g.client.drop_index("cos", "vector")
    ip = g.client.prepare_index_params()
    ip.add_index("vector", index_type="FLAT", metric_type="COSINE")
    g.client.create_index("cos", ip)
    with pytest.raises(UserError, match="indexes with metric COSINE; searching under M′ needs IP"):
        MilvusGallery(g.uri, "cos")


def test_cli_export_and_search_match_faiss(gallery, capsys):
    t, _, g, Q = gallery
    np.save(t / "q.npy", Q[:3])
    uri = g.uri  # the fixture's open database (on Lite: its server in this process is running already)
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


# ---------------------------------------------------------------- re-rankers on Milvus
SMALL = 120  # the gallery×gallery passes search Milvus once per item: a small gallery keeps them fast


@pytest.fixture(scope="module")
def small(tmp_path_factory, milvus_at):
    """A small index directory, its export (whose source feature store is still there), and an
    export of the same rows without a source (its vectors are copied from the collection)."""
    t = tmp_path_factory.mktemp("milvus-rerank")
    uri = milvus_at(t, "r")
    rng = np.random.default_rng(5)
    X = rng.standard_normal((SMALL, DIM)).astype(np.float32)
    items = Items(np.arange(SMALL) * 3 + 1, rng.integers(0, 6, SMALL), [f"img/{i}.png" for i in range(SMALL)],
                  ["gallery"] * SMALL)
    idx = write_index(t / "idx", X, items, rng.standard_normal((5, DIM)).astype(np.float32), normalize=True,
                      info={"backbone": "none"}, class_names={c: f"c{c}" for c in range(6)})
    export_index(idx, uri, "src")
    data = read_index(idx)
    export_features(uri, "bare", data.features, data.items, data.W, normalize=True,
                    class_names=data.class_names)
    export_features(uri, "hnsw", data.features, data.items, data.W, normalize=True,
                    class_names=data.class_names, index_type="HNSW", index_params={"M": 8, "efConstruction": 64})
    return t, Searcher(data), rng.standard_normal((4, DIM)).astype(np.float32), uri


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    """The re-rankers' offline caches (and copied vectors) under the test's folder, never the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def assert_same_hits(got, want):
    np.testing.assert_array_equal(got.rows, want.rows)
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode,strategy,params", [("cosine", "trained", {}), ("bilinear", "spectral", {"p": 0.5})])
@pytest.mark.parametrize("rerank", RERANKERS.names())
def test_every_reranker_on_milvus_equals_the_index(small, rerank, mode, strategy, params):
    """Each registered re-ranker (its defaults) on a FLAT collection: the rows and scores of the
    same re-ranker on the in-RAM index of the same items, leave-one-out queries included."""
    t, s, Q, uri = small
    g = MilvusGallery(uri, "src")
    try:
        cfg = SearchConfig.of(strategy, params, mode, rerank)
        assert_same_hits(cfg.search(g, Q, K), cfg.search(s, Q, K))
        own = np.array([7, 50])  # gallery items as queries: their own rows neither returned nor used
        fq = np.asarray(s.data.features[own])
        assert_same_hits(cfg.search(g, fq, K, self_ids=own), cfg.search(s, fq, K, self_ids=own))
        space = cfg.space(g)
        if RERANKERS.get(rerank).spec.by_row:  # read by row from the collection: no copy at all
            assert isinstance(space, MilvusSpace)
        else:  # the source index's features.npy, memory-mapped: no copy of the vectors was made
            data = space.searcher.data
            assert isinstance(data.features, np.memmap) and data.path == (t / "idx").resolve()
    finally:
        g.close()


def test_an_hnsw_collection_gives_rerankers_its_own_candidates(small, monkeypatch):
    """A collection that is not FLAT proposes the re-rankers' candidates itself (Milvus's search,
    with ef = the pool, which holds the whole small gallery here), re-ranked exactly: every
    re-ranker as on the in-RAM index."""
    from index.backends import milvus_store
    from index.space import CACHE

    _, s, Q, uri = small
    CACHE.clear()  # the other backend's run of this test: the same content, so the same keys
    asked = []
    search_ip = milvus_store.MilvusGallery.search_ip
    monkeypatch.setattr(milvus_store.MilvusGallery, "search_ip", lambda g, qt, *a, **kw: asked.append(len(qt))
                        or search_ip(g, qt, *a, **kw))
    g = MilvusGallery(uri, "hnsw")
    try:
        for rerank in RERANKERS.names():
            cfg = SearchConfig.of("trained", {}, "cosine", rerank)
            assert_same_hits(cfg.search(g, Q, K), cfg.search(s, Q, K))
        assert SMALL in asked   # the gallery×gallery pass searched the collection
    finally:
        g.close()


def test_a_bilinear_search_of_an_hnsw_collection_takes_milvus_scores_without_vectors(small, monkeypatch):
    """HNSW scores the stored float vectors: bilinear hits need no re-scoring, only a search as wide
    as the candidate pool (ef); cosine still re-scores the pool with its vectors."""
    from index.backends import milvus_store

    _, s, Q, uri = small
    asked = []
    search_ip = milvus_store.MilvusGallery.search_ip
    monkeypatch.setattr(milvus_store.MilvusGallery, "search_ip",
                        lambda g, qt, limit, fields, *a, **kw: asked.append((limit, "vector" in fields, kw, a))
                        or search_ip(g, qt, limit, fields, *a, **kw))
    g = MilvusGallery(uri, "hnsw")
    try:
        res = g.search_metric(Q, g.strategy_metric("trained", {}), K)
        assert_same_top_k(s.search(Q, "trained", {}, "bilinear", K), res.rows, res.scores)
        assert asked[-1][:2] == (K, False) and g.search_params(K, None, asked[-1][3][1])["params"]["ef"] >= 10 * K
        g.search_metric(Q, g.strategy_metric("trained", {}, "cosine"), K)
        assert asked[-1][1]  # cosine: the pool with its vectors
    finally:
        g.close()


def test_without_its_source_index_milvus_copies_the_vectors_once(small):
    """A collection with no source feature store (or one that changed) re-ranks over its own
    vectors, copied once into the cache folder, keyed by the collection's content."""
    t, s, Q, uri = small
    cfg = SearchConfig.of("trained", {}, "cosine", "kreciprocal", {"sets": "gallery"})  # reads the gallery whole
    g = MilvusGallery(uri, "bare")
    try:
        assert_same_hits(cfg.search(g, Q, K), cfg.search(s, Q, K))
        data = cfg.space(g).searcher.data
        copy = data.path / "features.npy"
        assert isinstance(data.features, np.memmap) and copy.is_file() and data.path.parent.name == "rerank"
        np.testing.assert_array_equal(np.load(copy), s.data.features)
        before = copy.stat().st_mtime_ns
    finally:
        g.close()
    g = MilvusGallery(uri, "bare")   # a new process's view: the copy is read, not made again
    try:
        assert_same_hits(cfg.search(g, Q, K), cfg.search(s, Q, K))
        assert cfg.space(g).searcher.data.path / "features.npy" == copy and copy.stat().st_mtime_ns == before
        # the same content: the same key as the collection with a source index
        assert g.content_key == MilvusGallery(uri, "src").content_key
    finally:
        g.close()


def test_a_changed_source_index_is_not_read(small):
    """A source index whose features no longer hold the collection's vectors is passed over; a
    collection without a recorded checksum is keyed by a sample of its rows."""
    t, s, Q, uri = small
    g = MilvusGallery(uri, "src")
    try:
        g.info["source_index"]["features_sha256"] = "0" * 64   # as if the index were rebuilt since
        recorded = g.info.pop("content_sha256")
        assert len(g.content_key) == 64 and g.content_key != recorded
        cfg = SearchConfig.of("trained", {}, "cosine", "kreciprocal", {"sets": "gallery"})
        data = cfg.space(g).searcher.data
        assert data.path.name == f"milvus-{g.content_key[:32]}" and data.path.parent.name == "rerank"
        assert_same_hits(cfg.search(g, Q, K), cfg.search(s, Q, K))
    finally:
        g.close()


def test_copying_the_vectors_without_disk_space_is_refused_in_one_line(small, monkeypatch):
    import shutil
    from collections import namedtuple

    t, _, Q, uri = small
    monkeypatch.setattr(shutil, "disk_usage", lambda p: namedtuple("U", "total used free")(10**6, 10**6 - 100, 100))
    g = MilvusGallery(uri, "bare")
    try:
        with pytest.raises(UserError, match=r"re-ranking on Milvus collection 'bare' copies its vectors \(0\.00 GiB\) "
                                            r"to .*; free space there or set XDG_CACHE_HOME to a larger disk$") as e:
            SearchConfig.of("trained", {}, "cosine", "kreciprocal", {"sets": "gallery"}).search(g, Q, K)
        assert "\n" not in str(e.value)
    finally:
        g.close()


def test_cli_search_reranks_on_milvus_as_on_the_index(small, capsys):
    t, _, Q, uri = small
    np.save(t / "q.npy", Q)
    common = ["search", "--features", str(t / "q.npy"), "--k", "5", "--rerank", "dba", "--rerank-param", "n=3"]
    assert main(common + ["--index", str(t / "idx")]) == 0
    want = json.loads(capsys.readouterr().out)
    assert main(common + ["--backend", "milvus", "--uri", uri, "--collection", "bare"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["rerank"] == want["rerank"] == "dba" and got["rerank_params"] == want["rerank_params"]
    for a, b in zip(got["queries"], want["queries"], strict=True):
        assert [r["id"] for r in a["results"]] == [r["id"] for r in b["results"]]
        np.testing.assert_allclose([r["score"] for r in a["results"]], [r["score"] for r in b["results"]], rtol=1e-5)
