"""The app's configurations with a re-ranker: each panel, its AP and the Compare tab search
through `SearchConfig.search`, a gallery query's own item left out of its own re-ranking."""
import numpy as np
import pytest

from app.service import Query, RetrievalService, Spec
from evaluation.evaluator import per_query_metrics
from index.backends.search import Searcher
from index.backends.store import in_memory_index
from index.search_config import SearchConfig

RERANKED = [Spec("trained", {}, "cosine", "aqe", {"n": 2, "alpha": 3.0}),
            Spec("identity", {}, "bilinear", "dba", {"n": 2}),
            Spec("trained", {}, "cosine", "diffusion", {"k": 5, "kq": 3, "truncation": 20}),
            Spec("spectral", {"p": 0.5}, "cosine", "kreciprocal", {"k1": 4, "k2": 2, "pool": 20})]
IDS = [s.rerank for s in RERANKED]


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    """The re-rankers' offline caches under the test's folder, never the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


@pytest.fixture(scope="module")
def svc(tiny_index):
    return RetrievalService(tiny_index)


def ids_of(svc, rows) -> list[int]:
    return [int(svc.data.items.ids[r]) for r in rows if r >= 0]


@pytest.mark.parametrize("spec", RERANKED, ids=IDS)
def test_a_panel_with_a_reranker_is_searchconfig_search(svc, spec):
    row = 5
    item = svc.query_from_item(int(svc.data.items.ids[row]))
    upload = Query(item.feats)  # the same features, as an upload: no class, no own row
    for q, self_ids in ((item, [row]), (upload, None)):
        panel = svc.panel(q, spec, k=6)
        want = spec.search(svc.searcher, q.feats, 6, self_ids=self_ids)
        assert [r["id"] for r in panel.results] == ids_of(svc, want.rows[0])
        np.testing.assert_array_equal([r["score"] for r in panel.results], want.scores[0][: len(panel.results)])
        assert panel.title == spec.label() and spec.rerank in panel.title
    assert svc.panel(upload, spec, k=6).ap is None


@pytest.mark.parametrize("spec", RERANKED, ids=IDS)
def test_a_gallery_query_never_helps_its_own_reranking(svc, spec):
    """A gallery item as the query: its panel and its AP are those of the same features searched,
    as an upload, in the gallery without that item (its own item neither shown nor used)."""
    data = svc.data
    y = data.items.labels
    for row in (0, 9, 17):
        q = svc.query_from_item(int(data.items.ids[row]))
        panel = svc.panel(q, spec, k=8)
        keep = np.arange(len(y)) != row
        alone = Searcher(in_memory_index(np.asarray(data.features)[keep], y[keep], data.W,
                                         normalize=data.manifest.get("normalize", True)))
        want = spec.search(alone, q.feats, 8)
        back = np.nonzero(keep)[0][want.rows[0][want.rows[0] >= 0]]  # the smaller gallery's rows as the full one's
        assert [r["id"] for r in panel.results] == ids_of(svc, back)
        assert q.self_id not in [r["id"] for r in panel.results]
        np.testing.assert_allclose([r["score"] for r in panel.results], want.scores[0][: len(back)], rtol=1e-4,
                                   atol=1e-5)
        R = int((y == q.label).sum()) - 1
        top = spec.search(alone, q.feats, R).rows[0]
        ap = per_query_metrics(y[keep][top][None, :], np.array([q.label]), np.array([R]), ks=(1,))["map@r"][0]
        assert panel.ap == pytest.approx(ap)


def test_without_a_reranker_the_panel_is_the_plain_search(svc):
    """No re-ranker: an upload's panel is the strategy's search itself, bit for bit, and an item's
    its search with the item left out."""
    q = svc.query_from_item(int(svc.data.items.ids[3]))
    for spec in (Spec("trained", {}, "cosine"), Spec("random", {"r": 0.5, "seed": 1}, "bilinear")):
        plain = svc.searcher.search(q.feats, spec.strategy, spec.params, spec.mode, 7)
        got = svc.panel(Query(q.feats), spec, k=7)
        assert [r["id"] for r in got.results] == ids_of(svc, plain.rows[0])
        assert [r["score"] for r in got.results] == plain.scores[0].tolist()
        own = svc.panel(q, spec, k=6)
        kept = [i for i in ids_of(svc, plain.rows[0]) if i != q.self_id][:6]
        assert [r["id"] for r in own.results] == kept


@pytest.mark.parametrize("spec", RERANKED[:2], ids=IDS[:2])
def test_the_compare_tab_reranks_every_query_as_its_panel_does(svc, spec):
    """Per-query AP with a re-ranker: each item's panel AP (k = R, itself left out)."""
    ap = svc.per_query_ap(spec)
    for row in range(len(svc.data.items)):
        q = svc.query_from_item(int(svc.data.items.ids[row]))
        assert ap[row] == pytest.approx(svc.panel(q, spec, k=3).ap)
    cmp = svc.comparison(spec, Spec("trained", {}, "cosine"), k=4)
    assert cmp.label_b == SearchConfig.of(spec.strategy, spec.params, spec.mode, spec.rerank,
                                          spec.rerank_params).label()
    np.testing.assert_array_equal(cmp.ap_b, ap[~np.isnan(ap)])
