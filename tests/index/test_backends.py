"""One Gallery interface: the index directory's FAISS index in RAM, the on-disk IVF and Milvus
(Lite) are each a `Gallery`, and `index search` gives the same JSON through any of them, re-rankers
included (tests/index/test_milvus.py runs every re-ranker on Milvus)."""
import importlib.util
import inspect
import json

import numpy as np
import pytest

from core.errors import UserError
from index.backends.gallery import HIT_FIELDS, Gallery, Hits
from index.backends.ondisk import OnDiskIVF, build_for_index, build_ondisk_ivf
from index.backends.search import Searcher
from index.backends.store import Items, read_index, write_index
from index.cli import main
from index.rerankers import RERANKERS, MetricSpace
from index.search_config import SearchConfig

N, DIM, NLIST, K = 500, 16, 8, 6
HAVE_MILVUS = all(importlib.util.find_spec(m) is not None for m in ("pymilvus", "milvus_lite"))
needs_milvus = pytest.mark.skipif(not HAVE_MILVUS, reason="the Milvus backend needs pymilvus and milvus-lite: "
                                                         "pip install -r requirements-milvus.txt")
BACKENDS = ["faiss", "ondisk", pytest.param("milvus", marks=[needs_milvus, pytest.mark.milvus])]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """One index directory, its on-disk IVF, and (with Milvus) its export: the same gallery three times."""
    t = tmp_path_factory.mktemp("backends")
    rng = np.random.default_rng(0)
    X = rng.standard_normal((N, DIM)).astype(np.float32)
    labels = rng.integers(0, 9, N)
    items = Items(np.arange(N) * 5 + 2, labels, [f"img/{i}.png" for i in range(N)], ["test"] * N)
    idx = write_index(t / "idx", X, items, rng.standard_normal((5, DIM)).astype(np.float32), normalize=True,
                      info={"backbone": "none"}, class_names={c: f"class {c}" for c in range(9)})
    build_for_index(idx, nlist=NLIST)
    np.save(t / "q.npy", rng.standard_normal((3, DIM)).astype(np.float32))
    if HAVE_MILVUS:
        from index.backends.milvus_store import export_index

        export_index(idx, str(t / "g.db"), "gal")
    return t


def open_backend(t, backend: str):
    if backend == "faiss":
        return Searcher(read_index(t / "idx"))
    if backend == "ondisk":
        return OnDiskIVF(t / "idx" / "ivf_ondisk")
    from index.backends.milvus_store import MilvusGallery

    return MilvusGallery(str(t / "g.db"), "gal")


# every list probed, every row a candidate: approximate backends must then give the exact top k
BACKEND_FLAGS = {"faiss": ["--index", "{t}/idx"],
                 "ondisk": ["--backend", "ondisk", "--index", "{t}/idx", "--nprobe", str(NLIST)],
                 "milvus": ["--backend", "milvus", "--uri", "{t}/g.db", "--collection", "gal"]}


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_is_a_gallery(built, backend):
    g = open_backend(built, backend)
    assert isinstance(g, Gallery)
    for name in ("search", "resolve_mode", "prepare_queries", "metric_space"):  # the Protocol's own signatures
        want = inspect.signature(getattr(Gallery, name)).parameters
        got = inspect.signature(getattr(type(g), name)).parameters
        assert [(p.name, p.default) for p in got.values()] == [(p.name, p.default) for p in want.values()], name
    assert g.dim == DIM and len(g) == N and g.info["backbone"] == "none"
    hits = g.search(np.load(built / "q.npy"), "trained", {}, "bilinear", K)
    assert isinstance(hits, Hits) and hits.rows.shape == hits.scores.shape == (3, K) and hits.k == K
    data = read_index(built / "idx")
    np.testing.assert_array_equal(hits.ids, data.items.ids[hits.rows])
    np.testing.assert_array_equal(hits.labels, data.items.labels[hits.rows])
    assert [list(r) for r in hits.results()[0]] == [list(HIT_FIELDS)] * K
    assert g.search(np.load(built / "q.npy"), k=N + 3).k == N  # k is capped at the gallery's size
    assert g.resolve_mode("diagonal", {"r": 0.5}, "cosine")[0] == "bilinear"  # indefinite: no cosine


@pytest.mark.parametrize("flags", [
    ["--strategy", "trained"],                                   # cosine, the default
    ["--strategy", "diagonal", "--r", "0.5"],                    # indefinite: cosine falls back, with a note
    ["--strategy", "spectral", "--p", "0.5", "--mode", "bilinear"],
    ["--strategy", "random", "--r", "0.5", "--seed", "3", "--mode", "bilinear"],
])
def test_index_search_gives_the_same_json_on_every_backend(built, flags, capsys):
    t = built
    common = ["search", "--features", str(t / "q.npy"), "--k", str(K), "--rerank-factor", str(N // K), *flags]
    out = {}
    for b in ("faiss", "ondisk", "milvus") if HAVE_MILVUS else ("faiss", "ondisk"):
        assert main(common + [f.format(t=t) for f in BACKEND_FLAGS[b]]) == 0
        captured = capsys.readouterr()
        out[b] = json.loads(captured.out)
        assert out[b].pop("backend") == b
        assert ("note: cosine is undefined" in captured.err) == (flags[1] == "diagonal")
    want = out.pop("faiss")
    assert want["k"] == K and len(want["queries"]) == 3
    for b, got in out.items():
        assert {k: v for k, v in got.items() if k != "queries"} == {k: v for k, v in want.items() if k != "queries"}, b
        for a, w in zip(got["queries"], want["queries"], strict=True):
            assert a["query"] == w["query"]
            assert [list(r) for r in a["results"]] == [list(r) for r in w["results"]] == [list(HIT_FIELDS)] * K
            assert ([{k: v for k, v in r.items() if k != "score"} for r in a["results"]]
                    == [{k: v for k, v in r.items() if k != "score"} for r in w["results"]]), b
            np.testing.assert_allclose([r["score"] for r in a["results"]], [r["score"] for r in w["results"]],
                                       rtol=1e-5, atol=1e-6)
    assert want["queries"][0]["results"][0]["class_name"].startswith("class ")


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    """The re-rankers' offline caches under the test's folder, never the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


# each re-ranker at settings small enough for 500 items (a pool wider than the candidates read)
RERANK_FLAGS = {"aqe": ["n=3,alpha=1"], "dba": ["n=2"], "diffusion": ["k=8,kq=4,truncation=60"],
                "diffusion_offline": ["k=8,kq=4,item_truncation=40"], "kreciprocal": ["k1=6,k2=2,pool=40"]}


def test_every_registered_reranker_is_tried_here():
    assert set(RERANK_FLAGS) == set(RERANKERS.names()) - {"none"}


@pytest.mark.parametrize("mode", ["cosine", "bilinear"])
@pytest.mark.parametrize("rerank", sorted(RERANK_FLAGS))
def test_rerankers_run_on_the_ondisk_backend_as_on_the_index(built, rerank, mode, capsys):
    """The same configuration through `index search` on the index directory and on its on-disk IVF
    (every list probed, every row a candidate): the same re-ranked results."""
    t = built
    common = ["search", "--features", str(t / "q.npy"), "--k", str(K), "--strategy", "spectral", "--p", "0.5",
              "--mode", mode, "--rerank", rerank, "--rerank-param", *RERANK_FLAGS[rerank]]
    out = {}
    for b in ("faiss", "ondisk"):
        assert main(common + [f.format(t=t) for f in BACKEND_FLAGS[b]] + ["--rerank-factor", str(N)]) == 0
        out[b] = json.loads(capsys.readouterr().out)
    want, got = out["faiss"], out["ondisk"]
    assert got["rerank"] == want["rerank"] == rerank and got["rerank_params"] == want["rerank_params"]
    for a, w in zip(got["queries"], want["queries"], strict=True):
        assert [r["id"] for r in a["results"]] == [r["id"] for r in w["results"]] and len(a["results"]) == K
        np.testing.assert_allclose([r["score"] for r in a["results"]], [r["score"] for r in w["results"]],
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_searchconfig_searches_every_backend_through_the_gallery(built, backend):
    """`SearchConfig.search` takes any Gallery: without a re-ranker it is the gallery's own search;
    with one it runs in the gallery's MetricSpace (every backend has one)."""
    g = open_backend(built, backend)
    if backend == "ondisk":
        g.nprobe = NLIST
    q = np.load(built / "q.npy")
    plain = SearchConfig.of("trained", {}, "cosine").search(g, q, K)
    want = g.search(q, "trained", {}, "cosine", K)
    np.testing.assert_array_equal(plain.rows, want.rows)
    np.testing.assert_array_equal(plain.scores, want.scores)
    cfg = SearchConfig.of("trained", {}, "cosine", "aqe", {"n": 2})
    assert isinstance(cfg.space(g), MetricSpace) and cfg.space(g) is cfg.space(g)  # kept per gallery
    exact = cfg.search(Searcher(read_index(built / "idx")), q, K)
    np.testing.assert_array_equal(cfg.search(g, q, K).rows, exact.rows)


def test_an_ondisk_ivf_of_bare_features_refuses_rerankers_in_one_line(built, tmp_path):
    out = build_ondisk_ivf(built / "idx" / "features.npy", tmp_path / "bare", nlist=NLIST, normalize=True)
    with pytest.raises(UserError, match="built from bare features: re-ranked results need its items") as e:
        SearchConfig.of("trained", {}, "cosine", "aqe").search(OnDiskIVF(out), np.load(built / "q.npy"), K)
    assert "\n" not in str(e.value)
