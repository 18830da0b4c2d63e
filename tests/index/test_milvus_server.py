"""`index export --to milvus` and `index search --backend milvus --rerank NAME` against a real Milvus
server at its plain address (http://127.0.0.1:PORT, the default database; tests/milvus_server.py):
every registered re-ranker gives the in-RAM index's top k, ids and scores."""
import json
import os
import uuid

import numpy as np
import pytest

pytest.importorskip("pymilvus", reason="the Milvus backend needs pymilvus: pip install -r requirements-milvus.txt")

from index.backends.store import Items, write_index
from index.cli import main
from index.rerankers import RERANKERS

pytestmark = pytest.mark.milvus

N, DIM, K = 120, 16, 5


@pytest.fixture(scope="module")
def exported(milvus_server, tmp_path_factory):
    """A small index directory exported by the CLI to the server's default database, under a
    name no other test process uses there; the collection is dropped at the module's end."""
    from pymilvus import MilvusClient

    t = tmp_path_factory.mktemp("milvus-server-cli")
    rng = np.random.default_rng(11)
    items = Items(np.arange(N) * 5 + 2, rng.integers(0, 6, N), [f"img/{i}.png" for i in range(N)], ["gallery"] * N)
    idx = write_index(t / "idx", rng.standard_normal((N, DIM)).astype(np.float32), items,
                      rng.standard_normal((5, DIM)).astype(np.float32), normalize=True,
                      info={"backbone": "none"}, class_names={c: f"c{c}" for c in range(6)})
    np.save(t / "q.npy", rng.standard_normal((4, DIM)).astype(np.float32))
    name = f"rerank_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    try:
        assert main(["export", "--to", "milvus", "--index", str(idx), "--uri", milvus_server.uri,
                     "--collection", name]) == 0
        yield t, milvus_server.uri, name
    finally:
        client = MilvusClient(uri=milvus_server.uri)
        client.drop_collection(name)
        client.close()


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    """The re-rankers' offline caches (and copied vectors) under the test's folder, never the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.mark.parametrize("rerank", RERANKERS.names())
def test_cli_search_through_the_server_reranks_as_the_index(exported, rerank, capsys):
    t, uri, name = exported
    common = ["search", "--features", str(t / "q.npy"), "--k", str(K), "--rerank", rerank]
    assert main(common + ["--index", str(t / "idx")]) == 0
    want = json.loads(capsys.readouterr().out)
    assert main(common + ["--backend", "milvus", "--uri", uri, "--collection", name]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["backend"] == "milvus" and got["rerank"] == want["rerank"] == rerank
    assert got["rerank_params"] == want["rerank_params"]
    assert len(got["queries"]) == len(want["queries"]) == 4
    for a, b in zip(got["queries"], want["queries"], strict=True):
        assert [r["id"] for r in a["results"]] == [r["id"] for r in b["results"]] and len(a["results"]) == K
        np.testing.assert_allclose([r["score"] for r in a["results"]], [r["score"] for r in b["results"]],
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("index_type,given,want", [
    ("HNSW", [], {"M": "16", "efConstruction": "100"}),
    ("HNSW", ["--index-param", "M=8,efConstruction=40"], {"M": "8", "efConstruction": "40"}),
    ("IVF_FLAT", [], {"nlist": "3"}),  # a power of two near √120 (8), cut to keep ≥ 39 rows a list
])
def test_cli_export_builds_an_approximate_index_with_its_default_or_given_parameters(exported, index_type, given,
                                                                                      want, capsys):
    """A server asks for an index's build parameters (HNSW's M and efConstruction, IVF_FLAT's
    nlist): `export --index-type` gives its defaults, `--index-param` overrides them, and the
    collection searches as the in-RAM index does."""
    from pymilvus import MilvusClient

    t, uri, _ = exported
    name = f"typed_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    client = MilvusClient(uri=uri)
    try:
        assert main(["export", "--to", "milvus", "--index", str(t / "idx"), "--uri", uri, "--collection", name,
                     "--index-type", index_type, "--no-progress", *given]) == 0
        described = client.describe_index(name, "vector")
        assert described["index_type"] == index_type
        assert {k: str(described[k]) for k in want} == want
        capsys.readouterr()
        common = ["search", "--features", str(t / "q.npy"), "--k", str(K)]
        assert main(common + ["--index", str(t / "idx")]) == 0
        ram = json.loads(capsys.readouterr().out)
        assert main(common + ["--backend", "milvus", "--uri", uri, "--collection", name, "--nprobe", "2"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert [[r["id"] for r in q["results"]] for q in got["queries"]] == [
            [r["id"] for r in q["results"]] for q in ram["queries"]]
    finally:
        client.drop_collection(name)
        client.close()


@pytest.mark.parametrize("given,message", [
    (["--index-type", "HNSW", "--index-param", "M=lots"], "--index-param M wants a whole number, got 'lots'"),
    (["--index-type", "HNSW", "--index-param", "M=0"], "--index-param M must be ≥ 1, got 0"),
    (["--index-param", "M=8"], "--index-param: a FLAT index takes no build parameters"),
])
def test_cli_export_refuses_bad_index_parameters_before_it_writes(exported, given, message):
    from core.errors import UserError

    t, uri, _ = exported
    with pytest.raises(UserError, match=f"^{message}$"):
        main(["export", "--to", "milvus", "--index", str(t / "idx"), "--uri", uri, "--collection", "never", *given])
