"""The app on a Milvus collection reads the metadata of the items it shows by id or by row, never
the whole collection's: with every whole read of the items refused, it starts (the Gradio page
included), searches, scores AP, picks examples, draws its maps, explains a result and compares a
seeded sample of the queries, each as the index directory in RAM does.  On Milvus Lite and on a
real server, each twice: on a collection that holds its per-class counts, and on one exported
without them (class sizes counted in it)."""
import numpy as np
import pytest
from support import panels

from app.backend import open_served
from app.service import RetrievalService, SearchConfig
from core.errors import UserError

pytest.importorskip("pymilvus", reason="the Milvus backend needs pymilvus and milvus-lite: "
                                       "pip install -r requirements-milvus.txt")
from index.backends import milvus_store  # noqa: E402
from index.backends.milvus_store import MilvusGallery, export_index  # noqa: E402

pytestmark = pytest.mark.milvus

SPECS = [SearchConfig("trained", {}, "cosine"), SearchConfig("identity", {}, "cosine"),
         SearchConfig("random", {"r": 0.5, "seed": 1}, "bilinear")]
RIGHT = SearchConfig("identity", {}, "cosine")


@pytest.fixture(scope="module")
def ram(tiny_index):
    return RetrievalService(tiny_index, compare_all_up_to=10, compare_sample=8)


@pytest.fixture(scope="module", params=["lite", "server"])
def uri(request, tiny_index, tmp_path_factory):
    """A Milvus Lite database, or a new database on a real Milvus server, with the tiny index
    twice: "counted" (its per-class counts stored) and "uncounted" (exported without them)."""
    server = request.getfixturevalue("milvus_server") if request.param == "server" else None
    uri = server.database("by_row") if server else str(tmp_path_factory.mktemp("by-row") / "g.db")
    export_index(tiny_index, uri, "counted")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(milvus_store, "CLASS_COUNTS_MAX", 0)
        export_index(tiny_index, uri, "uncounted")
    yield uri
    if server:
        server.drop_database(uri)


@pytest.fixture(params=["counted", "uncounted"])
def milvus(request, uri, ram, monkeypatch):
    """The collection served, every read of all its items' metadata refused from start-up on."""
    def whole_read(*_a, **_k):
        raise AssertionError("the app read every item's metadata from the collection")

    monkeypatch.setattr(MilvusGallery, "items", property(whole_read))
    monkeypatch.setattr(MilvusGallery, "_read_items", whole_read)
    svc = RetrievalService(served=open_served("milvus", uri=uri, collection=request.param, image_root=ram.root),
                           compare_all_up_to=10, compare_sample=8)
    assert (svc.gallery.class_counts is None) == (request.param == "uncounted")
    yield svc
    svc.gallery.close()


def ids(panel):
    return [r["id"] for r in panel.results]


def test_the_item_columns_are_read_by_row_only(ram, milvus):
    items, want = milvus.data.items, ram.data.items
    assert len(items) == len(want)
    for col in (items.ids, items.labels, items.paths, items.splits):
        with pytest.raises(UserError, match="reads its items by row, not the whole collection at once"):
            np.asarray(col)
        with pytest.raises(UserError, match="by row"):
            list(col)
    rows = np.array([5, 0, 5, len(want) - 1])
    np.testing.assert_array_equal(items.ids[rows], want.ids[rows])
    np.testing.assert_array_equal(items.labels[rows[None, :]], want.labels[rows][None, :])
    np.testing.assert_array_equal(items.labels[1:4], want.labels[1:4])
    assert items.paths[3] == want.paths[3] and items.splits[[2, 1]] == [want.splits[2], want.splits[1]]
    assert int(items.ids[-1]) == int(want.ids[-1])
    with pytest.raises(IndexError):
        items.ids[[len(want)]]


def test_start_up_queries_and_panels_are_the_index_directorys(ram, milvus):
    from app.ui import build_ui, header_md

    milvus.warm()
    build_ui(milvus)  # the page: its header, examples and their thumbnails
    assert header_md(milvus, None, ()).split("searched in")[0] == header_md(ram, None, ()).split("searched in")[0]
    assert milvus.data.class_names == ram.data.class_names
    chosen = [int(i) for i in ram.data.items.ids[[0, 7, 13]]]
    for i in chosen:
        q, qr = milvus.query_from_item(i), ram.query_from_item(i)
        assert q.label == qr.label and q.self_id == i
        np.testing.assert_array_equal(q.feats, qr.feats)
        assert milvus.item_class(i) == ram.item_class(i) and milvus.has_image(i)
        np.testing.assert_array_equal(np.asarray(milvus.thumbnail(i, 64)), np.asarray(ram.thumbnail(i, 64)))
        for spec in SPECS:
            for a, b in zip(ram.compare(qr, spec, 7), milvus.compare(q, spec, 7), strict=True):
                assert ids(a) == ids(b) and a.title == b.title and a.p_at_k == b.p_at_k
                assert [r["score"] for r in a.results] == pytest.approx([r["score"] for r in b.results], rel=1e-5)
                assert b.ap == pytest.approx(a.ap)
            assert milvus.query_ap(q, spec) == pytest.approx(ram.query_ap(qr, spec))
    upload = str(ram.root / ram.data.items.paths[2])
    a, b = ram.panel(ram.query_from_upload(upload), RIGHT, 5), milvus.panel(milvus.query_from_upload(upload), RIGHT, 5)
    assert ids(a) == ids(b) and b.ap is None
    with pytest.raises(UserError, match=r"^no item with id 987654321 in this index$"):
        milvus.query_from_item(987654321)


def test_examples_maps_and_why_read_only_the_rows_they_show(ram, milvus):
    from app.why_view import why_html

    ex = milvus.examples()
    assert ex == milvus.examples() and len(ex) == len(set(ex)) > 1  # seeded, distinct
    known = {int(i): int(lab) for i, lab in zip(ram.data.items.ids, ram.data.items.labels, strict=True)}
    assert all(i in known for i in ex) and len({known[i] for i in ex}) == len(ex)  # one per class
    i = int(ram.data.items.ids[4])
    q = milvus.query_from_item(i)
    assert milvus.gallery_map(q).size == ram.gallery_map(ram.query_from_item(i)).size
    html = milvus.map_html(RIGHT, "PCA", "right", q_id=i)
    assert html == ram.map_html(RIGHT, "PCA", "right", q_id=i)
    target = ids(milvus.panel(q, RIGHT, 5))[2]
    why = milvus.why(q, target, RIGHT, k=5)
    want = ram.why(ram.query_from_item(i), target, RIGHT, k=5)
    assert (why.left.rank, why.right.rank) == (want.left.rank, want.right.rank)
    assert f"id {target}" in why_html(milvus, why)


def test_a_sampled_comparison_is_the_whole_comparisons_at_its_queries(ram, milvus):
    from app.handlers import Handlers

    whole = ram.per_query_ap(RIGHT)
    every = ram.comparer.compare(SearchConfig(), RIGHT, k=6)
    s = milvus.comparison(RIGHT, k=6, seed=3)
    assert milvus.sampled() and len(s.ids) == 8 and s.population == len(every.ids)
    assert list(milvus.comparison(RIGHT, k=6, seed=3).ids) == list(s.ids)  # the seed fixes the sample
    at = np.searchsorted(every.ids, s.ids)
    assert (every.ids[at] == s.ids).all() and list(s.labels) == list(every.labels[at])
    np.testing.assert_allclose(s.ap_a, every.ap_a[at], atol=1e-6)
    np.testing.assert_allclose(s.ap_b, every.ap_b[at], atol=1e-6)
    np.testing.assert_allclose(s.ap_b, whole[np.searchsorted(ram.data.items.ids, s.ids)], atol=1e-6)
    text = Handlers(milvus).on_compare(None, "all", 6, "outcome", 1.0, 3, 8, progress=None,
                                       **panels(left=("trained", "cosine"), right=("identity", "cosine")))[0]
    assert f"sample of 8 of {len(every.ids)} queries (seed 3)" in text


@pytest.mark.parametrize("spec", [SearchConfig("trained", {}, "cosine", "diffusion", {"truncation": 30, "k": 8}),
                                  SearchConfig("identity", {}, "cosine", "aqe", {"n": 3})])
def test_a_search_reranked_by_row_copies_no_vector(ram, milvus, monkeypatch, spec):
    """Every re-ranker reads by row: the app's re-ranked search on the collection makes no copy of
    its vectors (nor maps its source index's) and answers as the index directory does."""
    searched_by_row(ram, milvus, monkeypatch, spec)


# the re-ranking path is the same on both collections (they differ in how AP counts a class)
@pytest.mark.parametrize("milvus", ["counted"], indirect=True)
@pytest.mark.parametrize("spec", [SearchConfig("trained", {}, "bilinear", "dba", {"n": 2}),
                                  SearchConfig("identity", {}, "cosine", "kreciprocal",
                                               {"sets": "pool", "pool": 30, "k1": 8, "k2": 3})])
def test_dba_and_kreciprocal_search_by_row_too(ram, milvus, monkeypatch, spec):
    searched_by_row(ram, milvus, monkeypatch, spec)


def searched_by_row(ram, milvus, monkeypatch, spec):
    """The app's search under `spec` on the collection, with any copy of its vectors refused,
    equals the index directory's: rows, P@k and scores."""
    def whole(*_a, **_k):
        raise AssertionError("the collection's vectors were copied or mapped whole")

    monkeypatch.setattr(MilvusGallery, "_copied_features", whole)
    monkeypatch.setattr(MilvusGallery, "_source_features", whole)
    for i in [int(x) for x in ram.data.items.ids[[3, 11]]]:
        q, qr = milvus.query_from_item(i), ram.query_from_item(i)
        for a, b in zip(ram.compare(qr, spec, 7), milvus.compare(q, spec, 7), strict=True):
            assert ids(a) == ids(b) and a.p_at_k == b.p_at_k
            assert [r["score"] for r in a.results] == pytest.approx([r["score"] for r in b.results], rel=1e-4)
