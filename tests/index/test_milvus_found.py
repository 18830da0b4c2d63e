"""A search's and a query's reply read as columns (index/backends/milvus_found.py) hold what
pymilvus's own dicts hold: the same ids, scores and fields (numbers, strings, vectors, ARRAY
cells), query by query; a query with fewer hits than asked is padded; pymilvus's own result is
read where no reply is at hand; an error is pymilvus's."""
import numpy as np
import pytest

pytest.importorskip("pymilvus", reason="the Milvus backend needs pymilvus and milvus-lite: "
                                       "pip install -r requirements-milvus.txt")

from pymilvus import DataType, MilvusClient  # noqa: E402

from index.backends import milvus_found  # noqa: E402

pytestmark = pytest.mark.milvus
N, DIM = 300, 8
FIELDS = ["row", "label", "path", "vector"]
PARAMS = {"metric_type": "IP", "params": {}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    c = MilvusClient(str(tmp_path_factory.mktemp("found") / "f.db"))
    s = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
    s.add_field("id", DataType.INT64, is_primary=True)
    s.add_field("row", DataType.INT64)
    s.add_field("label", DataType.INT64)
    s.add_field("path", DataType.VARCHAR, max_length=64)
    s.add_field("vector", DataType.FLOAT_VECTOR, dim=DIM)
    s.add_field("nb", DataType.ARRAY, element_type=DataType.INT64, max_capacity=4)
    s.add_field("w", DataType.ARRAY, element_type=DataType.FLOAT, max_capacity=4)
    ip = c.prepare_index_params()
    ip.add_index("vector", index_type="FLAT", metric_type="IP")
    c.create_collection("g", schema=s, index_params=ip)
    X = np.random.default_rng(0).standard_normal((N, DIM)).astype(np.float32)
    c.insert("g", [{"id": 11 * i + 5, "row": i, "label": i % 7, "path": f"img/{i}.png", "vector": X[i].tolist(),
                    "nb": list(range(i, i + i % 5)), "w": [0.5 * j for j in range(i % 3)]} for i in range(N)])
    yield c, X
    c.close()


def test_the_columns_hold_what_pymilvus_hit_dicts_hold(client):
    c, X = client
    Q = np.random.default_rng(1).standard_normal((6, DIM)).astype(np.float32).tolist()
    got = milvus_found.search(c, "g", Q, 9, "vector", PARAMS, FIELDS)
    want = c.search("g", data=Q, limit=9, anns_field="vector", search_params=PARAMS, output_fields=FIELDS)
    assert len(got) == 6 and got.counts().tolist() == [9] * 6
    for i, hits in enumerate(want):
        a, b = got.at[i], got.at[i + 1]
        assert got.ids[a:b].tolist() == [h["id"] for h in hits]
        np.testing.assert_allclose(got.scores[a:b], [h["distance"] for h in hits], rtol=1e-6)
        assert got.fields["row"][a:b].tolist() == [h["entity"]["row"] for h in hits]
        assert got.fields["label"][a:b].tolist() == [h["entity"]["label"] for h in hits]
        assert got.fields["path"][a:b] == [h["entity"]["path"] for h in hits]
        np.testing.assert_array_equal(got.fields["vector"][a:b], X[got.fields["row"][a:b]])
    # pymilvus's own result read into the same columns (where its search gives no raw reply)
    again = milvus_found.from_hits(want, FIELDS)
    np.testing.assert_array_equal(again.at, got.at)
    np.testing.assert_array_equal(again.ids, got.ids)
    for f in ("row", "label"):
        np.testing.assert_array_equal(again.fields[f], got.fields[f])
    assert again.fields["path"] == got.fields["path"]
    np.testing.assert_array_equal(again.fields["vector"], got.fields["vector"])
    # and the exact inner products are the scores
    rows = got.padded(got.fields["row"], 9, -1)
    np.testing.assert_allclose(got.padded(got.scores, 9, -np.inf), np.take_along_axis(
        np.asarray(Q, dtype=np.float32) @ X.T, rows, 1), rtol=1e-5)


def test_fewer_hits_than_asked_are_padded(client):
    c, _ = client
    Q = np.random.default_rng(2).standard_normal((3, DIM)).astype(np.float32).tolist()
    got = milvus_found.search(c, "g", Q, N + 50, "vector", PARAMS, ["row"])
    assert got.counts().tolist() == [N] * 3
    rows = got.padded(got.fields["row"], N + 50, -1)
    assert (rows[:, N:] == -1).all()
    assert all(sorted(r[:N].tolist()) == list(range(N)) for r in rows)


def test_pymilvus_own_result_is_read_where_no_reply_is_at_hand(client, monkeypatch):
    c, _ = client

    class Future:  # an asynchronous search with no raw reply in it
        def __init__(self, result):
            self._result = result

        def result(self):
            return self._result

    search = MilvusClient.search

    def without_reply(self, *a, **kw):
        kw.pop("_async")
        return Future(search(self, *a, **kw))
    monkeypatch.setattr(MilvusClient, "search", without_reply)
    Q = np.random.default_rng(3).standard_normal((2, DIM)).astype(np.float32).tolist()
    got = milvus_found.search(c, "g", Q, 5, "vector", PARAMS, ["row", "path"])
    monkeypatch.undo()
    want = milvus_found.search(c, "g", Q, 5, "vector", PARAMS, ["row", "path"])
    np.testing.assert_array_equal(got.fields["row"], want.fields["row"])
    assert got.fields["path"] == want.fields["path"]


def test_a_search_the_server_refuses_raises_pymilvus_error(client):
    from pymilvus.exceptions import MilvusException

    c, _ = client
    with pytest.raises(MilvusException):  # a query of another dimension
        milvus_found.search(c, "g", [[0.0] * (DIM + 1)], 3, "vector", PARAMS, ["row"])


QUERIED = ["row", "id", "label", "path", "vector", "nb", "w"]


def test_a_query_reply_read_as_columns_holds_what_pymilvus_entities_hold(client, monkeypatch):
    c, X = client
    expr = "row in [3, 250, 17, 4, 99]"
    got = milvus_found.query(c, "g", expr, QUERIED, 10)
    want = c.query("g", filter=expr, output_fields=QUERIED, limit=10)
    assert got["row"].tolist() == [e["row"] for e in want] and sorted(got["row"].tolist()) == [3, 4, 17, 99, 250]
    assert got["id"].tolist() == [e["id"] for e in want] == [11 * r + 5 for r in got["row"]]
    assert got["label"].tolist() == [e["label"] for e in want]
    assert got["path"] == [e["path"] for e in want]
    np.testing.assert_array_equal(got["vector"], X[got["row"]])
    for i, r in enumerate(got["row"].tolist()):  # ARRAY cells of their own lengths, empty ones included
        assert got["nb"][i].tolist() == list(range(r, r + r % 5))
        np.testing.assert_allclose(got["w"][i], [0.5 * j for j in range(r % 3)])
    # pymilvus's own entities, where its request-building calls are not there
    def gone(*a, **kw):
        raise AttributeError("_stub")
    monkeypatch.setattr(milvus_found, "_query_parts", gone)
    again = milvus_found.query(c, "g", expr, QUERIED, 10)
    monkeypatch.undo()
    np.testing.assert_array_equal(again["row"], got["row"])
    assert again["path"] == got["path"]
    np.testing.assert_array_equal(np.asarray(again["vector"], dtype=np.float32), got["vector"])
    assert [a.tolist() for a in again["nb"]] == [a.tolist() for a in got["nb"]]
    # no entity matches: empty columns
    none = milvus_found.query(c, "g", "row < 0", ["row", "nb"], 10)
    assert len(none["row"]) == 0 and len(none["nb"]) == 0
