"""The app on every backend: an on-disk IVF (every list probed, so exact) and a Milvus Lite
collection (FLAT) over the tiny index plus synthetic distractors without an image answer the
panels, the Compare tab (whole and sampled), the why panel and both HTTP APIs as the index
directory in RAM does; an item without an image is shown as such."""
import shutil

import numpy as np
import pytest
from PIL import Image

from app.backend import open_served
from app.service import RetrievalService, SearchConfig
from core.errors import UserError
from index.backends.ondisk import build_for_index
from index.build import add_features

SPECS = [SearchConfig("trained", {}, "cosine"), SearchConfig("random", {"r": 0.5, "seed": 1}, "bilinear"),
         SearchConfig("spectral", {"p": 0.5}, "cosine")]
DISTRACTORS = 4


@pytest.fixture(scope="module")
def gallery_dir(tiny_index, tmp_path_factory):
    """The tiny index and DISTRACTORS synthetic items (no image), each near item 0's features."""
    from index.backends.store import read_index

    d = tmp_path_factory.mktemp("backends") / "index"
    shutil.copytree(tiny_index, d)
    data = read_index(d)
    rng = np.random.default_rng(0)
    x = np.asarray(data.features[:1]) + 0.01 * rng.standard_normal((DISTRACTORS, data.dim)).astype(np.float32)
    add_features(d, x, int(data.items.labels[0]), split="distractor")  # no paths: no image
    return d


@pytest.fixture(scope="module")
def ram(gallery_dir):
    return RetrievalService(gallery_dir)


@pytest.fixture(scope="module")
def ondisk(gallery_dir):
    # cosine mode searches a strategy's own cosine lists: the defaults' and those of SPECS
    ivf = build_for_index(gallery_dir, gallery_dir.parent / "ivf", nlist=2,
                          cosine_for=(("trained", {}), ("identity", {}), ("spectral", {"p": 0.5})))
    return RetrievalService(served=open_served("ondisk", ivf=ivf, nprobe=2))  # every list: exact


def item_ids(panel):
    return [r["id"] for r in panel.results]


def assert_same_panels(svc, ram, q_of):
    for spec in SPECS:
        for q_ram, q in q_of():
            a, b = ram.panel(q_ram, spec, 7), svc.panel(q, spec, 7)
            assert item_ids(a) == item_ids(b) and a.title == b.title
            assert [r["score"] for r in a.results] == pytest.approx([r["score"] for r in b.results], rel=1e-5)
            assert a.ap == pytest.approx(b.ap) and a.p_at_k == b.p_at_k


def queries(ram, svc):
    img = str(ram.root / ram.data.items.paths[2])
    return lambda: [(ram.query_from_item(int(i)), svc.query_from_item(int(i))) for i in ram.data.items.ids[[0, 5]]] + [
        (ram.query_from_upload(img), svc.query_from_upload(img))]


def test_ondisk_panels_are_the_index_directorys(ram, ondisk):
    assert ondisk.backend == "ondisk" and len(ondisk.data.items) == len(ram.data.items)
    assert_same_panels(ondisk, ram, queries(ram, ondisk))


def test_ondisk_compares_every_query_as_the_index_directory(ram, ondisk):
    right = SearchConfig("identity", {}, "cosine")
    a, b = ram.comparison(right, k=6), ondisk.comparison(right, k=6)
    assert not ondisk.sampled() and list(a.ids) == list(b.ids)
    np.testing.assert_allclose(b.ap_a, a.ap_a, atol=1e-9)
    np.testing.assert_allclose(b.ap_b, a.ap_b, atol=1e-9)
    np.testing.assert_allclose(b.jaccard, a.jaccard)
    assert b.summary_text().startswith(f"{len(a.ids)} queries")  # every query: no sample named


def test_above_the_size_compare_reads_a_seeded_sample_with_intervals(ondisk, ram):
    from app.handlers import Handlers
    from index.analysis.compare import bootstrap_ci

    svc = RetrievalService(served=open_served("ondisk", ivf=ondisk.served.where, nprobe=2),
                           compare_all_up_to=10, compare_sample=8)
    right = SearchConfig("identity", {}, "cosine")
    whole = ram.comparison(right, k=6)
    s = svc.comparison(right, k=6, seed=3)
    assert svc.sampled() and len(s.ids) == 8 and s.population == len(whole.ids)
    assert list(svc.comparison(right, k=6, seed=3).ids) == list(s.ids)  # the seed fixes the sample
    assert list(svc.comparison(right, k=6, seed=4).ids) != list(s.ids)
    at = np.searchsorted(whole.ids, s.ids)  # each sampled query's AP is its AP in the whole comparison
    assert (whole.ids[at] == s.ids).all()
    np.testing.assert_allclose(s.ap_a, whole.ap_a[at], atol=1e-9)
    np.testing.assert_allclose(s.ap_b, whole.ap_b[at], atol=1e-9)
    iv = s.intervals()
    assert iv["mean_delta"] == bootstrap_ci(s.ap_b - s.ap_a, 3)
    for key, values in (("map_a", s.ap_a), ("map_b", s.ap_b), ("mean_jaccard", s.jaccard)):
        lo, hi = iv[key]
        assert lo <= values.mean() <= hi
    assert len(svc.comparison(right, k=6, seed=3, sample=5).ids) == 5
    text = Handlers(svc).on_compare(None, "all", 6, "outcome", 1.0, 3, 8, progress=None,
                                    **cfg_values(SearchConfig(), right))[0]
    assert f"sample of 8 of {len(whole.ids)} queries (seed 3)" in text and "bootstrap 95% intervals" in text


def cfg_values(left: SearchConfig, right: SearchConfig) -> dict:
    from support import panels

    return panels(left=(left.strategy, left.mode), right=(right.strategy, right.mode))


def test_ondisk_why_is_the_index_directorys(ram, ondisk):
    i = int(ram.data.items.ids[5])
    for left, right in ((SearchConfig(), SearchConfig("identity", {}, "cosine")),
                        (SearchConfig("trained", {}, "bilinear"), SearchConfig("random", {"r": 0.5}, "bilinear"))):
        target = item_ids(ram.panel(ram.query_from_item(i), right, 5))[2]
        a = ram.why(ram.query_from_item(i), target, right, left, k=5)
        b = ondisk.why(ondisk.query_from_item(i), target, right, left, k=5)
        assert (a.left.rank, a.right.rank) == (b.left.rank, b.right.rank)
        assert b.change.delta == pytest.approx(a.change.delta, rel=1e-5)


def post(svc, **fields):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from app.rest import add_rest_routes

    app = FastAPI()
    add_rest_routes(app, svc, 10 << 20)
    with open(svc.root / svc.data.items.paths[2], "rb") as f:
        return TestClient(app).post("/api/search", files={"image": ("q.png", f, "image/png")},
                                    data={k: str(v) for k, v in fields.items()})


def test_ondisk_serves_both_http_apis(ram, ondisk):
    from app.handlers import api_search

    img = str(ram.root / ram.data.items.paths[2])
    want = ram.api_search(img, {"strategy": "spectral", "p": 0.5, "k": 6})
    got = api_search(ondisk)(img, "spectral", p=0.5, k=6)  # Gradio's /search
    assert [r["id"] for r in got["results"]] == [r["id"] for r in want["results"]] and got["metric"] == want["metric"]
    r = post(ondisk, strategy="spectral", p=0.5, k=6)  # POST /api/search
    assert r.status_code == 200 and r.json()["results"] == got["results"]
    reranked = post(ondisk, strategy="trained", rerank="aqe", rerank_params="n=3", k=4)
    assert reranked.status_code == 200 and len(reranked.json()["results"]) == 4


def test_an_item_without_an_image_is_shown_as_such(ondisk):
    from app.handlers import gallery_items

    distractors = [int(i) for i, p in zip(ondisk.data.items.ids, ondisk.data.items.paths, strict=True) if not p]
    assert len(distractors) == DISTRACTORS
    pictured = int(ondisk.data.items.ids[0])
    assert not ondisk.has_image(distractors[0]) and ondisk.has_image(pictured)
    thumb = np.asarray(ondisk.thumbnail(distractors[0], 64))
    assert thumb.shape == (64, 64, 3) and (thumb[0, 0] == (230, 230, 230)).all()  # the grey placeholder
    assert not (np.asarray(ondisk.thumbnail(pictured, 64))[..., 0] == 230).all()
    # item 0's own query: the distractors (near copies of it) come first, each marked as having no image
    panel = ondisk.panel(ondisk.query_from_item(pictured), SearchConfig("identity", {}, "cosine"), 6)
    marked = {r["id"]: r["has_image"] for r in panel.results}
    assert all(not marked[d] for d in distractors) and any(marked.values())
    captions = [c for _, c in gallery_items(ondisk, panel)]
    assert sum(c.endswith("· no image") for c in captions) == DISTRACTORS
    api = ondisk.api_search(Image.open(ondisk.root / ondisk.data.items.paths[0]), {"strategy": "identity", "k": 6})
    assert any(r["has_image"] is False for r in api["results"]) and "has_image" in api["results"][0]


def test_the_app_opens_each_backend_with_the_index_search_flags(ondisk):
    from app.cli import build_parser

    args = build_parser().parse_args(["--backend", "ondisk", "--ivf", str(ondisk.served.where),
                                      "--nprobe", "2", "--rerank-factor", "3"])
    served = open_served(args.backend, None, ivf=args.ivf, nprobe=args.nprobe, rerank_factor=args.rerank_factor)
    assert served.gallery.nprobe == 2 and served.gallery.rerank_factor == 3
    with pytest.raises(UserError, match="--backend ondisk needs --ivf DIR"):
        open_served("ondisk")
    with pytest.raises(UserError, match="--backend milvus needs --uri and --collection"):
        open_served("milvus")


# ---------------------------------------------------------------- Milvus Lite
@pytest.fixture(scope="module")
def milvus(gallery_dir, ram):
    pytest.importorskip("pymilvus", reason="the Milvus backend needs pymilvus and milvus-lite")
    from index.backends.milvus_store import export_index

    uri = str(gallery_dir.parent / "g.db")
    export_index(gallery_dir, uri, "gal")
    svc = RetrievalService(served=open_served("milvus", uri=uri, collection="gal", image_root=ram.root))
    yield svc
    svc.gallery.close()


@pytest.mark.milvus
def test_milvus_panels_compare_and_why_are_the_index_directorys(ram, milvus):
    assert milvus.backend == "milvus" and list(milvus.data.items.ids[:]) == list(ram.data.items.ids)
    assert_same_panels(milvus, ram, queries(ram, milvus))
    right = SearchConfig("identity", {}, "cosine")
    a, b = ram.comparison(right, k=6), milvus.comparison(right, k=6)
    np.testing.assert_allclose(b.ap_b, a.ap_b, atol=1e-6)
    i = int(ram.data.items.ids[5])
    target = item_ids(ram.panel(ram.query_from_item(i), right, 5))[2]
    wa = ram.why(ram.query_from_item(i), target, right, k=5)
    wb = milvus.why(milvus.query_from_item(i), target, right, k=5)
    assert (wa.left.rank, wa.right.rank) == (wb.left.rank, wb.right.rank)
    assert milvus.has_image(int(ram.data.items.ids[0]))  # its paths under --image-root


@pytest.mark.milvus
def test_milvus_serves_both_apis_and_re_ranks_as_the_index_directory(ram, milvus):
    from app.handlers import api_search

    img = str(ram.root / ram.data.items.paths[2])
    got = api_search(milvus)(img, "spectral", p=0.5, k=6)
    want = ram.api_search(img, {"strategy": "spectral", "p": 0.5, "k": 6})
    assert [r["id"] for r in got["results"]] == [r["id"] for r in want["results"]]
    r = post(milvus, strategy="spectral", p=0.5, k=6)
    assert r.status_code == 200 and r.json()["results"] == got["results"]
    reranked = post(milvus, strategy="trained", rerank="aqe", rerank_params="n=3", k=4)
    want = ram.api_search(img, {"strategy": "trained", "rerank": "aqe", "rerank_params": "n=3", "k": 4})
    assert reranked.status_code == 200 and milvus.rerank_refusal is None
    assert [x["id"] for x in reranked.json()["results"]] == [x["id"] for x in want["results"]]
    spec = SearchConfig(rerank="kreciprocal")   # a gallery item as the query: left out of its own re-ranking
    i = int(ram.data.items.ids[0])
    a, b = ram.panel(ram.query_from_item(i), spec, 4), milvus.panel(milvus.query_from_item(i), spec, 4)
    assert item_ids(a) == item_ids(b) and i not in item_ids(b)
    assert [x["score"] for x in a.results] == pytest.approx([x["score"] for x in b.results], rel=1e-5)


def test_an_ondisk_ivf_of_bare_features_is_refused_in_one_line(tmp_path):
    from index.backends.ondisk import build_ondisk_ivf

    np.save(tmp_path / "f.npy", np.random.default_rng(0).standard_normal((300, 8)).astype(np.float32))
    ivf = build_ondisk_ivf(tmp_path / "f.npy", tmp_path / "ivf", nlist=2)
    with pytest.raises(UserError, match=r"built from bare features: the app needs its items; build it from an index "
                                        r"directory \(ivf-build --index\)$"):
        open_served("ondisk", ivf=ivf)
