"""The app's one cache (a byte budget, least recently used out) and its one 2-D projection."""
import sys

import numpy as np
import pytest

from app.cache import AppCache, size_of
from app.compare_view import project_2d
from app.service import SearchConfig


def test_the_cache_keeps_what_fits_its_budget_least_recently_used_out():
    c = AppCache(budget=3000)
    made = []

    def make(i):
        made.append(i)
        return np.zeros(1000, dtype=np.uint8) + i

    for i in (0, 1, 2):
        c.get(i, lambda i=i: make(i))
    assert c.bytes == 3000 and len(c) == 3
    c.get(0, lambda: make(0))  # a hit: 0 is now the most recently used
    c.get(3, lambda: make(3))  # over budget: 1, the least recently used, goes
    assert made == [0, 1, 2, 3] and c.bytes <= 3000
    c.get(1, lambda: make(1))
    assert made[-1] == 1  # made again
    big = c.get("big", lambda: np.zeros(4000, dtype=np.uint8))
    assert len(big) == 4000 and c.bytes <= 3000  # larger than the budget: returned, not kept
    assert size_of((np.zeros(10, np.float32), np.zeros(5, np.float64))) >= 80


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
    got = api_search(svc)(img, "trained", rerank="kreciprocal", k=4)
    assert "pool=all" in got["metric"] and "1000000000" not in got["metric"]
    q = svc.query_from_item(int(svc.data.items.ids[1]))
    export = svc.export(q, SearchConfig.of("trained", rerank="kreciprocal"), 4)
    assert export["right"]["rerank_params"]["pool"] == "all" and "pool=all" in export["right"]["label"]
