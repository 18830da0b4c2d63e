"""The app's results in the process's one memory cache, and its one 2-D projection."""
import sys
import threading

import numpy as np
import pytest
from PIL import Image

from app.cache import held, keep, keep_image
from app.compare_view import project_2d
from app.service import SearchConfig
from core.memory import nbytes
from index.space import CACHE


def test_a_value_is_built_once_however_many_requests_ask_at_once():
    made, start = [], threading.Barrier(4)

    def make():
        made.append(1)
        return np.arange(1000, dtype=np.float32)

    def ask(out):
        start.wait()
        out.append(keep("test-value", "built once", 1, build=make))

    got: list = []
    threads = [threading.Thread(target=ask, args=(got,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and len(got) == 4 and all(g is got[0] for g in got)
    assert held("test-value", "built once", 1) and not held("test-value", "built once", 2)


def test_a_picture_is_kept_as_pixels_the_budget_counts():
    img = Image.new("RGB", (40, 30), (10, 20, 30))
    before = CACHE.used
    out = keep_image("test-picture", "pixels", draw=lambda: img)
    assert out.size == (40, 30) and np.array_equal(np.asarray(out), np.asarray(img))
    assert CACHE.used - before == 40 * 30 * 3 == nbytes(np.asarray(img))
    out.putpixel((0, 0), (0, 0, 0))  # a request's copy: the kept pixels stay as drawn
    again = keep_image("test-picture", "pixels", draw=lambda: Image.new("RGB", (1, 1)))
    assert np.array_equal(np.asarray(again), np.asarray(img))


def test_one_projection_umap_where_installed_else_pca(monkeypatch):
    X = np.random.default_rng(0).standard_normal((60, 8)).astype(np.float32)
    monkeypatch.setitem(sys.modules, "umap", None)  # not installed
    xy, place, used = project_2d(X, "UMAP")
    assert used == "PCA" and xy.shape == (60, 2)
    np.testing.assert_allclose(place(X[:3]), xy[:3], atol=1e-5)  # new rows land where the map put them
    xy_pca, _, used_pca = project_2d(X, "PCA")
    np.testing.assert_allclose(xy, xy_pca)
    _, none, used_tsne = project_2d(X, "t-SNE")
    assert none is None and used_tsne == "t-SNE"


def test_the_map_says_when_umap_is_not_installed(svc, monkeypatch):
    monkeypatch.setitem(sys.modules, "umap", None)
    html = svc.map_html(SearchConfig("shrink", {"alpha": 0.3}, "cosine"), "UMAP", "M′")
    assert "UMAP is not installed: PCA" in html
    with pytest.raises(Exception, match="map method must be one of"):
        project_2d(np.zeros((4, 2)), "MDS")


def test_a_whole_gallery_size_reads_all_in_the_api(svc):
    from app.handlers import api_search

    img = str(svc.root / svc.data.items.paths[2])
    got = api_search(svc)(img, "trained", rerank="kreciprocal", k=4)  # pool=auto: the whole gallery here
    assert "pool=auto" in got["metric"] and "1000000001" not in got["metric"]
    q = svc.query_from_item(int(svc.data.items.ids[1]))
    export = svc.export(q, SearchConfig.of("trained", rerank="kreciprocal", rerank_params={"pool": "all"}), 4)
    assert export["right"]["rerank_params"]["pool"] == "all" and "pool=all" in export["right"]["label"]
