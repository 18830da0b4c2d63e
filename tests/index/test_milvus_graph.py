"""The neighbour graph in the engine (index/backends/milvus_space.py) on Milvus Lite and on a real
Milvus server: every item's lists built through the collection's own search into a collection
beside it, a build cut short resumed to the lists built in one go (and to the in-RAM index's),
and the re-rankers that read by row (diffusion on each query's cut graph, αQE, k-reciprocal within
each query's pool, αDBA searching its augmented gallery in the engine, none) giving the in-RAM
index's answer while no N-sized read of the collection happens."""
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("pymilvus", reason="the Milvus backend needs pymilvus and milvus-lite: "
                                       "pip install -r requirements-milvus.txt")

import pymilvus  # noqa: E402  (skipped above where it is missing)

from core.errors import UserError
from index.backends import milvus_space
from index.backends.milvus_space import MilvusSpace
from index.backends.milvus_store import MilvusGallery, export_index
from index.backends.search import Searcher
from index.backends.store import Items, read_index, write_index
from index.cli import main
from index.rerankers import RERANKERS, rerank
from index.rerankers.diffusion import TOPN
from index.rerankers.neighbours import neighbour_lists
from index.rerankers.registry import resolved
from index.search_config import SearchConfig
from index.space import CACHE, SearcherSpace

pytestmark = pytest.mark.milvus

N, DIM, L = 160, 12, 64


@pytest.fixture(scope="module", params=["lite", "server"])
def engine(request, tmp_path_factory):
    """(folder, in-RAM searcher, URI of a collection "g" exported from the same index, "lite" or "server")."""
    t = tmp_path_factory.mktemp("milvus-graph")
    if request.param == "lite":
        uri = str(t / "g.db")
    else:
        server = request.getfixturevalue("milvus_server")
        uri = server.database("graph")
    rng = np.random.default_rng(3)
    X = rng.standard_normal((N, DIM)).astype(np.float32)
    items = Items(np.arange(N) * 5 + 2, rng.integers(0, 8, N), [f"img/{i}.png" for i in range(N)], ["gallery"] * N)
    idx = write_index(t / "idx", X, items, rng.standard_normal((6, DIM)).astype(np.float32), normalize=True,
                      info={"backbone": "none"})
    export_index(idx, uri, "g")
    yield t, Searcher(read_index(idx)), uri, request.param
    if request.param == "server":
        server.drop_database(uri)


@pytest.fixture
def gallery(engine, monkeypatch):
    """The collection, its whole-gallery reads (the items' metadata, a copy of the vectors, the
    source index's features) made to fail, and every read by row recorded."""
    _, _, uri, _ = engine
    CACHE.clear()
    g = MilvusGallery(uri, "g")

    def whole(*a, **kw):
        raise AssertionError("the whole collection was read")
    for name in ("_read_items", "_copied_features", "_source_features"):
        monkeypatch.setattr(g, name, whole)
    reads: list[int] = []
    query_rows = g.query_rows
    monkeypatch.setattr(g, "query_rows", lambda uniq, *a, **kw: reads.append(len(uniq)) or query_rows(uniq, *a, **kw))
    g.reads = reads  # type: ignore[attr-defined]
    yield g
    g.close()


def drop_lists(g: MilvusGallery) -> None:
    for c in g.client.list_collections():
        if c.startswith("g__"):
            g.client.drop_collection(c)


def test_the_lists_built_in_the_engine_killed_and_resumed_equal_one_build_and_the_index(engine, gallery, monkeypatch):
    _, s, _, backend = engine
    mode = "cosine" if backend == "lite" else "bilinear"  # the exact IP scores, and candidates re-scored
    drop_lists(gallery)
    monkeypatch.setattr(milvus_space, "BLOCK", 64)
    blocks = -(-N // 64)
    space = MilvusSpace(gallery, "trained", {}, mode)
    calls = []
    real = space.item_neighbours
    asked: list[list[str]] = []  # each search's output fields
    search_ip = gallery.search_ip
    monkeypatch.setattr(gallery, "search_ip", lambda qt, limit, fields, *a, **kw: asked.append(fields) or search_ip(
        qt, limit, fields, *a, **kw))

    def cut(rows, k):
        calls.append(len(rows))
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C in the third block
        return real(rows, k)
    monkeypatch.setattr(space, "item_neighbours", cut)
    with pytest.raises(KeyboardInterrupt):
        neighbour_lists(space, L)
    stored = [c for c in gallery.client.list_collections() if c.startswith("g__knn_")]
    assert len(stored) == 1
    CACHE.clear()
    monkeypatch.setattr(space, "item_neighbours", lambda rows, k: calls.append(len(rows)) or real(rows, k))
    resumed = neighbour_lists(space, L, progress=True)
    assert len(calls) == 3 + blocks - 2  # the blocks from the third on: the first two were stored
    if mode == "bilinear":  # Milvus's scores are the lists': each hit's row alone comes back, no metadata
        assert asked and all(fields == ["row"] for fields in asked)
    rows = np.arange(N)
    got = resumed.rows[rows], resumed.sims[rows]
    # built in one go, under another collection name (the same digest would find the stored one)
    drop_lists(gallery)
    CACHE.clear()
    again = neighbour_lists(MilvusSpace(gallery, "trained", {}, mode), L)
    np.testing.assert_array_equal(got[0], again.rows[rows])
    if mode == "bilinear":  # Milvus's own scores
        np.testing.assert_array_equal(got[1], again.sims[rows])
    else:  # scored here from keys normalised in whichever block first fetched them: BLAS rounds by shape
        np.testing.assert_allclose(got[1], again.sims[rows], rtol=0, atol=1e-6)
    # and the in-RAM index's exact lists (ties apart: equal similarities)
    want = neighbour_lists(SearcherSpace(s, "trained", {}, mode, cache_dir=engine[0] / f"cache-{mode}"), L)
    np.testing.assert_allclose(got[1], want.sims, rtol=1e-5, atol=1e-6)
    assert (got[0] == want.rows).mean() > 0.99
    with pytest.raises(UserError, match="read by row"):
        np.asarray(resumed.rows)


@pytest.mark.parametrize("engine", ["server"], indirect=True)  # Milvus Lite is one process's
def test_the_lists_built_by_three_parts_one_cut_short_and_run_again_equal_one_build(engine, gallery, monkeypatch):
    """`index graph --part I/N`: N processes (threads here, each with its own connection) build one
    artefact together, each its own blocks; a part cut short resumes from its last block while the
    others wait for it, and whichever sees every part stored seals the collection."""
    _, _, uri, _ = engine
    drop_lists(gallery)
    monkeypatch.setattr(milvus_space, "BLOCK", 32)  # 5 blocks: parts [0, 1), [1, 3), [3, 5)
    monkeypatch.setattr(milvus_space, "PART_POLL_S", 0.05)
    monkeypatch.setattr(milvus_space, "PART_WAIT_S", 60)  # a failure below never leaves a part waiting
    filled: dict[int, list[int]] = {0: [], 1: [], 2: []}

    def worker(i: int, cut_at: int = 0):
        g = MilvusGallery(uri, "g")
        try:
            space = MilvusSpace(g, "trained", {}, "bilinear")
            real = space.item_neighbours

            def counted(rows, k):
                filled[i].append(int(rows[0]))
                if cut_at and len(filled[i]) == cut_at:
                    raise KeyboardInterrupt  # Ctrl-C in this part's second block
                return real(rows, k)
            space.item_neighbours = counted  # type: ignore[method-assign]
            with milvus_space.building_part(i, 3):
                lists = neighbour_lists(space, L)
                return lists.rows[np.arange(N)], lists.sims[np.arange(N)]
        except KeyboardInterrupt:
            return "cut"
        finally:
            g.close()

    flushed: list[str] = []
    flush = pymilvus.MilvusClient.flush
    monkeypatch.setattr(pymilvus.MilvusClient, "flush", lambda self, name, *a, **kw: flushed.append(name) or flush(
        self, name, *a, **kw))
    with ThreadPoolExecutor(3) as pool:
        first = [pool.submit(worker, 0), pool.submit(worker, 1, 2), pool.submit(worker, 2)]
        assert first[1].result(timeout=120) == "cut"
        assert not first[0].done() and not first[2].done()  # waiting for part 1
        again = pool.submit(worker, 1)
        got = [first[0].result(timeout=120), again.result(timeout=120), first[2].result(timeout=120)]
    assert filled == {0: [0], 1: [32, 64, 64], 2: [96, 128]}  # part 1 went on from its second block
    made = [c for c in gallery.client.list_collections() if c.startswith("g__knn_")]
    assert len(made) == 1 and json.loads(gallery.client.describe_collection(made[0])["properties"][
        milvus_space.ARTEFACT])["whole"] is True
    assert flushed == made  # sealed once, by the last part
    drop_lists(gallery)
    CACHE.clear()
    one = neighbour_lists(MilvusSpace(gallery, "trained", {}, "bilinear"), L)
    for rows, sims in got:
        np.testing.assert_array_equal(rows, one.rows[np.arange(N)])
        np.testing.assert_array_equal(sims, one.sims[np.arange(N)])


@pytest.mark.parametrize("engine", ["server"], indirect=True)
def test_progress_recorded_by_parts_never_counts_in_one_process_and_back(engine, gallery, monkeypatch):
    """One process cut short, then part 0 of 2 (which deletes and stores its own blocks) cut short,
    then one process again: each layout starts over, so no row is lost, and the lists equal one
    build's; part keys of an earlier layout of the same N do not count either."""
    drop_lists(gallery)
    monkeypatch.setattr(milvus_space, "BLOCK", 32)  # 5 blocks
    space = MilvusSpace(gallery, "trained", {}, "bilinear")
    real = space.item_neighbours
    calls: list[int] = []

    def cut_at(n):
        def f(rows, k):
            calls.append(int(rows[0]))
            if n and len(calls) == n:
                raise KeyboardInterrupt
            return real(rows, k)
        return f
    monkeypatch.setattr(space, "item_neighbours", cut_at(3))
    with pytest.raises(KeyboardInterrupt):
        neighbour_lists(space, L)  # blocks 0 and 1 stored
    calls.clear()
    monkeypatch.setattr(space, "item_neighbours", cut_at(2))
    with pytest.raises(KeyboardInterrupt), milvus_space.building_part(0, 2):
        neighbour_lists(space, L)  # its blocks [0, 2): rows 0–63 deleted, block 0 stored again
    assert calls == [0, 32]
    calls.clear()
    monkeypatch.setattr(space, "item_neighbours", cut_at(0))
    got = neighbour_lists(space, L)
    assert calls == [0, 32, 64, 96, 128]  # started over: part 0's block does not count here
    rows = np.arange(N)
    got_rows, got_sims = got.rows[rows], got.sims[rows]
    drop_lists(gallery)
    CACHE.clear()
    one = neighbour_lists(MilvusSpace(gallery, "trained", {}, "bilinear"), L)
    np.testing.assert_array_equal(got_rows, one.rows[rows])
    np.testing.assert_array_equal(got_sims, one.sims[rows])


def test_a_part_is_refused_in_one_line_before_anything_is_written(engine, gallery, tmp_path):
    t, _, uri, _ = engine
    drop_lists(gallery)
    where = ["--backend", "milvus", "--uri", uri, "--collection", "g"]
    for bad in ("3/3", "1", "a/b", "0/0"):
        with pytest.raises(UserError, match=r"^--part wants I/N"):
            main(["graph", *where, "--part", bad])
    with pytest.raises(UserError, match=r"^--part splits a build in an engine"):
        main(["graph", "--index", str(t / "idx"), "--part", "0/2"])
    assert not [c for c in gallery.client.list_collections() if c.startswith("g__")]


@pytest.mark.parametrize("engine", ["lite"], indirect=True)
def test_parts_on_milvus_lite_are_refused(engine, gallery):
    _, _, uri, _ = engine
    drop_lists(gallery)
    with pytest.raises(UserError, match=r"^--part needs a Milvus server: Milvus Lite \(a \.db file\) is one"):
        main(["graph", "--backend", "milvus", "--uri", uri, "--collection", "g", "--part", "0/2"])
    assert not [c for c in gallery.client.list_collections() if c.startswith("g__")]


# (each by-row re-ranker at its defaults, in both modes: tests/index/test_milvus.py)
@pytest.mark.parametrize("rerank_name,params,mode,strategy,bound", [
    ("diffusion", {"truncation": 40, "k": 8, "kq": 4}, "cosine", "trained", 64),
    ("diffusion", {"truncation": 40, "k": 8, "kq": 4}, "bilinear", "identity", 64),
    ("aqe", {"n": 3}, "bilinear", "trained", 64),
    ("kreciprocal", {"sets": "pool", "pool": 40, "k1": 10, "k2": 3}, "bilinear", "trained", 64),
    ("dba", {"n": 3}, "bilinear", "trained", 64 * 4)])  # a block's items and their 3 neighbours each
def test_rerankers_by_row_give_the_index_answer_reading_only_what_a_query_touches(engine, gallery, mode, strategy,
                                                                                   rerank_name, params, bound,
                                                                                   monkeypatch):
    _, s, _, _ = engine
    monkeypatch.setattr(milvus_space, "BLOCK", 64)  # the lists' offline pass reads 64 rows at a time
    assert RERANKERS.get(rerank_name).spec.by_row
    rng = np.random.default_rng(1)
    Q = rng.standard_normal((5, DIM)).astype(np.float32)
    own = np.array([4, 77])
    cfg = SearchConfig.of(strategy, {}, mode, rerank_name, params)
    for q, ids in ((Q, None), (np.asarray(s.data.features[own]), own)):
        got, want = cfg.search(gallery, q, 10, self_ids=ids), cfg.search(s, q, 10, self_ids=ids)
        np.testing.assert_array_equal(got.rows, want.rows)
        np.testing.assert_array_equal(got.ids, want.ids)
        np.testing.assert_allclose(got.scores, want.scores, rtol=1e-4, atol=1e-5)
    assert isinstance(cfg.space(gallery), MilvusSpace)
    # no read of every row: each read by row is bounded by a block of the offline pass (64 rows,
    # and αDBA's their neighbours) or by a query's pool (diffusion's and k-reciprocal's 40
    # candidates, diffusion's their lists), never by the gallery (cosine mode re-scores candidate
    # pools, which cover all 160 items of this small gallery)
    assert gallery.reads
    if mode == "bilinear":
        assert max(gallery.reads) <= bound


def test_diffusion_on_a_gallery_read_by_row_cuts_each_query_graph_at_any_size(engine, gallery):
    """`truncation=auto` is the plain search's top 10,000 on an engine's gallery whatever its size
    (no process builds the whole graph there); clipped to this gallery, every item once."""
    _, s, _, _ = engine
    assert resolved("diffusion", {}, 10, whole=False).truncation == TOPN
    assert resolved("diffusion", {}, 10).truncation > N  # in a process that holds the gallery: the whole graph
    q = np.random.default_rng(2).standard_normal((3, DIM)).astype(np.float32)
    space = MilvusSpace(gallery, "trained", {}, "cosine")
    got = rerank("diffusion", space, q, 10, params={"k": 8, "kq": 4})
    want = rerank("diffusion", SearcherSpace(s, "trained", {}, "cosine", cache_dir=engine[0] / "cache-auto"), q, 10,
                  params={"k": 8, "kq": 4, "truncation": N})
    np.testing.assert_array_equal(got.rows, want.rows)
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-4, atol=1e-6)


def test_index_graph_builds_the_lists_and_dbas_gallery_in_the_engine_once(engine, gallery, capsys):
    t, _, uri, _ = engine
    drop_lists(gallery)
    where = ["--backend", "milvus", "--uri", uri, "--collection", "g", "--strategy", "trained", "--mode", "bilinear"]
    args = ["graph", *where, "--no-progress", "--dba-param", "n=3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"neighbour lists: {N:,} items × 64" in out and "in the engine" in out
    assert f"αDBA's augmented gallery (n=3, alpha=3): {N:,} items in the engine (g__dba_" in out
    made = sorted(c for c in gallery.client.list_collections() if c.startswith("g__"))
    assert [c.split("_")[2] for c in made] == ["dba", "knn"]
    assert main(args) == 0  # found whole: nothing is built again
    assert sorted(c for c in gallery.client.list_collections() if c.startswith("g__")) == made
    # αDBA's search at the same parameters reads that collection: it builds none of its own
    np.save(t / "graph-q.npy", np.random.default_rng(5).standard_normal((2, DIM)).astype(np.float32))
    assert main(["search", *where, "--features", str(t / "graph-q.npy"), "--rerank", "dba", "--rerank-param",
                 "n=3"]) == 0
    assert sorted(c for c in gallery.client.list_collections() if c.startswith("g__")) == made
    with pytest.raises(UserError, match=r"^--dba-param wants KEY=VALUE, got 'n'$"):
        main(["graph", *where, "--dba-param", "n"])


def test_index_graph_refuses_a_bad_dba_parameter_before_it_writes(engine, gallery):
    _, _, uri, _ = engine
    drop_lists(gallery)
    with pytest.raises(UserError, match="n"):
        main(["graph", "--backend", "milvus", "--uri", uri, "--collection", "g", "--dba-param", "n=0"])
    assert not [c for c in gallery.client.list_collections() if c.startswith("g__")]


def test_a_list_wider_than_milvus_arrays_is_refused_before_anything_is_written(gallery):
    before = sorted(gallery.client.list_collections())  # in no set order on a server
    with pytest.raises(UserError, match=r"^Milvus keeps at most 4,096 entries in an ARRAY field: neighbour lists "
                                        r"of 5,000 a row cannot be stored there \(give a length ≤ 4,096\)$"):
        milvus_space.EngineTable(gallery, "knn", "0" * 64, {"rows": (5000, "int64"), "sims": (5000, "float32")},
                                 "neighbour lists")
    assert sorted(gallery.client.list_collections()) == before


def test_replacing_a_gallery_drops_the_artefacts_built_from_it_and_no_other_collection(engine):
    t, _, uri, _ = engine
    export_index(t / "idx", uri, "h")
    h = MilvusGallery(uri, "h")
    try:
        neighbour_lists(MilvusSpace(h, "trained", {}, "bilinear"), L)
        built = [c for c in h.client.list_collections() if c.startswith("h__knn_")]
        assert len(built) == 1 and milvus_space.artefacts_of(h.client, "h") == built
        schema = h.client.create_schema(auto_id=False)  # another's collection under a name like an artefact's
        schema.add_field("pk", h.pm.DataType.INT64, is_primary=True)
        schema.add_field("v", h.pm.DataType.FLOAT_VECTOR, dim=2)
        h.client.create_collection("h__theirs", schema=schema)
        with pytest.raises(UserError, match="already exists"):
            export_index(t / "idx", uri, "h")
        assert built[0] in h.client.list_collections()
        export_index(t / "idx", uri, "h", overwrite=True)
        left = sorted(c for c in h.client.list_collections() if c.startswith("h"))
        assert left == ["h", "h__theirs"]
    finally:
        for c in [c for c in h.client.list_collections() if c.startswith("h")]:
            h.client.drop_collection(c)
        h.close()


@pytest.mark.parametrize("engine", ["lite"], indirect=True)  # what is written: the client's calls, either engine
def test_a_restart_of_a_milvus_2_3_5_server_keeps_the_gallery_and_its_lists_whole(engine, monkeypatch):
    """Milvus 2.3.5 (the `milvus` package's server) reloads each collection, after a restart, with
    the properties it had before its last alter (milvus-io/milvus#30144): a gallery written with one
    alter would lose its description, and a build its last mark.  Every alter is recorded here, and
    the properties that server would reload must be those the collection ends with."""
    t, _, uri, _ = engine
    alters: dict[str, list[dict]] = {}
    real = pymilvus.MilvusClient.alter_collection_properties

    def recorded(self, collection_name, properties, *a, **kw):
        alters.setdefault(collection_name, []).append(dict(properties))
        return real(self, collection_name, properties, *a, **kw)
    monkeypatch.setattr(pymilvus.MilvusClient, "alter_collection_properties", recorded)
    export_index(t / "idx", uri, "r")
    h = MilvusGallery(uri, "r")
    try:
        neighbour_lists(MilvusSpace(h, "trained", {}, "bilinear"), L)
        lists = [c for c in h.client.list_collections() if c.startswith("r__knn_")]
        assert len(lists) == 1 and sorted(alters) == sorted(["r", *lists])
        for c, seq in alters.items():
            final = {k: v for a in seq for k, v in a.items()}
            reloaded = {k: v for a in seq[:-1] for k, v in a.items()}
            assert reloaded == final == h.client.describe_collection(c)["properties"], c
        assert json.loads(alters[lists[0]][-1][milvus_space.ARTEFACT])["whole"] is True
        assert "dml.info" in alters["r"][-1] and "dml.neck" in alters["r"][-1]
    finally:
        for c in [c for c in h.client.list_collections() if c.startswith("r")]:
            h.client.drop_collection(c)
        h.close()


def test_decoupled_diffusion_stores_its_rows_in_the_engine_and_gives_the_index_answer(engine, gallery, capsys,
                                                                                       monkeypatch):
    """diffusion_offline on an engine's gallery: `index graph --rerank diffusion_offline` builds
    every item's row into a collection beside the gallery's (reading the lists a block at a time,
    never the whole collection at once), and searches read that collection, by row, to the in-RAM
    index's answer."""
    from index.rerankers import diffusion_offline

    t, s, uri, _ = engine
    drop_lists(gallery)
    monkeypatch.setattr(milvus_space, "BLOCK", 64)
    monkeypatch.setattr(diffusion_offline, "COPY_BLOCK", 64)
    reads: list[int] = []  # by every gallery object, the command's own included
    query_rows = MilvusGallery.query_rows
    monkeypatch.setattr(MilvusGallery, "query_rows", lambda g, uniq, *a, **kw: reads.append(len(uniq))
                        or query_rows(g, uniq, *a, **kw))
    where = ["--backend", "milvus", "--uri", uri, "--collection", "g", "--strategy", "trained", "--mode", "bilinear"]
    params = "k=8,kq=4,item_truncation=40"
    args = ["graph", *where, "--no-progress", "--no-dba", "--rerank", "diffusion_offline", "--rerank-param", params]
    assert main(args) == 0
    assert "diffusion_offline's offline part (k=8, kq=4, item_truncation=40" in capsys.readouterr().out
    made = sorted(c for c in gallery.client.list_collections() if c.startswith("g__"))
    assert [c.split("__")[1].rsplit("_", 1)[0] for c in made] == ["diffusion_offline", "knn"]
    assert reads and max(reads) <= 64
    cfg = SearchConfig.of("trained", {}, "bilinear", "diffusion_offline", {"k": 8, "kq": 4, "item_truncation": 40})
    rng = np.random.default_rng(4)
    own = np.array([9, 100])
    for q, ids in ((rng.standard_normal((4, DIM)).astype(np.float32), None), (np.asarray(s.data.features[own]), own)):
        got, want = cfg.search(gallery, q, 10, self_ids=ids), cfg.search(s, q, 10, self_ids=ids)
        np.testing.assert_array_equal(got.rows, want.rows)
        np.testing.assert_allclose(got.scores, want.scores, rtol=1e-4, atol=1e-6)
    assert sorted(c for c in gallery.client.list_collections() if c.startswith("g__")) == made  # read, not rebuilt
    with pytest.raises(UserError, match="has no offline part beyond the neighbour lists"):
        main(["graph", *where, "--rerank", "aqe"])
