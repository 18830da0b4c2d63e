"""The app's configurations with a re-ranker: each panel, its AP and the Compare tab search
through `SearchConfig.search`, a gallery query's own item left out of its own re-ranking."""
import numpy as np
import pytest
from support import blocks_by_label

from app.service import Query
from evaluation.evaluator import per_query_metrics
from index.backends.search import Searcher
from index.backends.store import in_memory_index
from index.rerankers import WHOLE_GALLERY
from index.search_config import SearchConfig

RERANKED = [SearchConfig("trained", {}, "cosine", "aqe", {"n": 2, "alpha": 3.0}),
            SearchConfig("identity", {}, "bilinear", "dba", {"n": 2}),
            SearchConfig("trained", {}, "cosine", "diffusion", {"k": 5, "kq": 3, "truncation": 20}),
            SearchConfig("spectral", {"p": 0.5}, "cosine", "kreciprocal", {"k1": 4, "k2": 2, "pool": 20})]
IDS = [s.rerank for s in RERANKED]


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
    for spec in (SearchConfig("trained", {}, "cosine"), SearchConfig("random", {"r": 0.5, "seed": 1}, "bilinear")):
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
    cmp = svc.comparison(spec, SearchConfig("trained", {}, "cosine"), k=4)
    assert cmp.label_b == SearchConfig.of(spec.strategy, spec.params, spec.mode, spec.rerank,
                                          spec.rerank_params).label()
    np.testing.assert_array_equal(cmp.ap_b, ap[~np.isnan(ap)])


# ---------------------------------------------------------------- the UI's handlers
def with_rerank(values: dict, side: str, name: str, **params) -> dict:
    """The handlers' keyword values with `side`'s re-ranker control set, and its parameter controls."""
    from app.controls import rerank_key

    return values | {f"{side}_rerank": name} | {rerank_key(side, name, p): v for p, v in params.items()}


def test_search_handler_runs_each_panels_reranker_and_links_it(svc):
    import urllib.parse

    from support import panels

    from app.compare_view import parse_state
    from app.handlers import Handlers

    item = int(svc.data.items.ids[4])
    values = with_rerank(panels(), "right", "aqe", n=3, alpha=1.0)
    out = Handlers(svc).on_search({"kind": "item", "id": item}, None, 5, **values)
    right = SearchConfig("identity", {}, "cosine", "aqe", {"n": 3, "alpha": 1.0})
    want = svc.panel(svc.query_from_item(item), right, k=5)
    assert out[2].startswith("### Right: identity · cosine · aqe(n=3, alpha=1.0)")
    assert out[5]["right"] == [r["id"] for r in want.results] and item not in out[5]["right"]
    assert out[5]["left"] == [r["id"] for r in svc.panel(svc.query_from_item(item), SearchConfig(), k=5).results]
    assert "&rerank=aqe&rerank_n=3&rerank_alpha=1.0&" in out[-1]
    st = parse_state(dict(urllib.parse.parse_qsl(out[-1][1:])))
    assert st["right"] == right and st["left"] == SearchConfig()
    # another re-ranker's controls are not read; a bad value of the chosen one's is a visible message
    other = with_rerank(values, "right", "aqe", n=3, alpha=1.0) | {"right_rerank_dba__n": 7}
    assert Handlers(svc).on_search({"kind": "item", "id": item}, None, 5, **other)[5]["right"] == out[5]["right"]
    bad = Handlers(svc).on_search({"kind": "item", "id": item}, None, 5, **with_rerank(panels(), "left", "aqe", n=0))
    assert bad[4] == "⚠️ re-ranker 'aqe': n must be ≥ 1, got 0"


def test_compare_why_and_export_handlers_with_a_reranker(svc, tmp_path):
    import csv
    import json

    from support import panels

    from app.handlers import Handlers

    h = Handlers(svc)
    values = with_rerank(panels(right=("trained", "cosine")), "right", "dba", n=2, alpha=3.0)
    right = SearchConfig("trained", {}, "cosine", "dba", {"n": 2, "alpha": 3.0})
    calls = []

    def progress(frac, desc=None, unit=None):  # what gr.Progress is called with
        calls.append((frac, desc, unit))

    item = int(svc.data.items.ids[6])
    summary, _, rows, ids, _, _ = h.on_compare({"kind": "item", "id": item}, "all", 4, "outcome", 1.0,
                                               progress=progress, **values)
    assert summary.startswith("**trained · cosine** (x) vs **trained · cosine · dba(n=2, alpha=3.0)** (y)")
    cmp = svc.comparison(right, SearchConfig(), k=4)
    assert ids == [r["id"] for r in cmp.disagreements("all")]
    assert calls and calls[-1][0][0] == calls[-1][0][1] and "dba" in calls[-1][1] and calls[-1][2] == "queries"
    # why: the re-ranked side placed in its list, no eigen-directions, the neighbourhood instead
    q = svc.query_from_item(item)
    shown = [r["id"] for r in svc.panel(q, right, k=4).results]
    html_out, _ = h.on_why({"kind": "item", "id": item}, None, shown[1], 4, **values)
    why = svc.why(q, shown[1], right, SearchConfig(), k=4)
    assert why.change is None and why.right.rank == 2 and why.right.reranked and not why.right.beyond
    assert "does not apply" in html_out and "why-strip" not in html_out
    assert html_out.count('class="why-support"') == 1 and "nearest items" in html_out
    # the export carries the re-ranker (JSON and CSV)
    files = h.on_export({"kind": "item", "id": item}, None, 4, **values)["value"]
    payload = json.loads(open(files[0]).read())
    assert payload["right"]["rerank"] == "dba" and payload["right"]["rerank_params"] == {"n": 2, "alpha": 3.0}
    assert [r["id"] for r in payload["panels"][1]["results"]] == shown
    with open(files[1], newline="") as f:
        got = {(r["side"], r["rerank"], r["rerank_params"]) for r in csv.DictReader(f)}
    assert got == {("left", "none", "{}"), ("right", "dba", json.dumps({"alpha": 3.0, "n": 2}))}


def test_reranker_controls_show_only_the_chosen_ones(svc):
    from app.controls import rerank_controls
    from app.handlers import on_rerank
    from app.ui import build_ui
    from index.rerankers import RERANKERS

    keys = [(name, sp.name) for name, sp in rerank_controls()]
    assert keys == [(e.name, p) for e in RERANKERS.entries() for p in e.param_defaults()]
    for name in RERANKERS.names():
        group, *shown = on_rerank(name)
        assert group == {"__type__": "update", "visible": bool(RERANKERS.get(name).param_defaults())}
        assert [u["visible"] for u in shown] == [r == name for r, _ in keys]
    demo = build_ui(svc)
    by_label = blocks_by_label(demo)
    for side in ("Left", "Right"):
        (dd,) = by_label[f"{side} re-ranker"]
        assert [v for _, v in dd.choices] == RERANKERS.names() and dd.value == "none"
        (group,) = [b for b in demo.blocks.values() if getattr(b, "label", None) == f"{side} re-ranker parameters"]
        assert group.visible is False  # none takes no parameter
    pools = [b for label, bs in by_label.items() if str(label).startswith("pool: the query's first-search") for b in bs]
    # a size that depends on the gallery reads "auto" in the control; "all" searches the whole gallery
    assert len(pools) == 2 and all(p.visible is False and p.value == "auto" and "('all', 'auto' or a number)"
                                   in p.label for p in pools)
    from app.params import spec_from

    cfg = spec_from("trained", "cosine", {}, "kreciprocal", {"pool": "all"})
    assert cfg.rerank_params["pool"] == WHOLE_GALLERY  # every item
    assert "pool=all" in cfg.label() and "1000000000" not in cfg.label()
    # a size that depends on the gallery's reads "auto" in its control and is taken back as typed
    cuts = [b for label, bs in by_label.items() if str(label).startswith("truncation: ") for b in bs]
    assert len(cuts) == 2 and all(b.value == "auto" and "('all', 'auto' or a number)" in b.label for b in cuts)
    assert "1000000001" not in cuts[0].label and "(diffusion; default: auto)" in cuts[0].label
    cfg = spec_from("trained", "cosine", {}, "diffusion", {"truncation": "auto"})
    assert cfg.rerank_params["truncation"] == RERANKERS.params("diffusion", {}).truncation
    assert "truncation=auto" in cfg.label() and "1000000001" not in cfg.label()
    assert spec_from("trained", "cosine", {}, "diffusion", {"truncation": "all"}).rerank_params["truncation"] \
        == 1_000_000_000


# ---------------------------------------------------------------- the HTTP APIs
def test_gradio_api_takes_an_optional_reranker(svc):
    import gradio as gr

    from app.handlers import api_search
    from app.ui import build_ui

    search = api_search(svc)
    img = str(svc.root / svc.data.items.paths[2])
    q = svc.query_from_upload(img)
    plain = search(img, "trained", mode="cosine", k=4)  # an old call: no re-ranker
    assert plain["results"] == [{f: r[f] for f in plain["results"][0]} for r in svc.panel(q, SearchConfig(), 4).results]
    got = search(img, "identity", mode="bilinear", k=4, rerank="aqe", rerank_params="n=3, alpha=1")
    want = svc.panel(q, SearchConfig("identity", {}, "bilinear", "aqe", {"n": 3, "alpha": 1.0}), 4)
    assert got["metric"] == want.title == "identity · bilinear · aqe(n=3, alpha=1.0)"
    assert [r["id"] for r in got["results"]] == [r["id"] for r in want.results]
    assert search(img, "identity", mode="bilinear", k=4, rerank="aqe", rerank_params='{"n": 3, "alpha": 1}') == got
    for rerank, params, message in (("nope", "", "unknown re-ranker 'nope'; choose from aqe, dba"),
                                    ("aqe", "x=1", "re-ranker 'aqe': no parameter 'x'"),
                                    ("aqe", "n", "rerank_params: want key=value, got 'n'"),
                                    ("aqe", "[1]", "want key=value"), ("aqe", "{1", "not a JSON object")):
        with pytest.raises(gr.Error, match=message):
            search(img, "trained", mode="cosine", k=4, rerank=rerank, rerank_params=params)
    api = build_ui(svc).get_api_info()["named_endpoints"]["/search"]["parameters"]
    names = [p["parameter_name"] for p in api]
    assert names[-2:] == ["rerank", "rerank_params"]  # after every earlier parameter (tests/app/test_app_api.py)
    assert all(p["parameter_has_default"] for p in api[-2:])


@pytest.fixture(scope="module")
def rest(svc):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from app.rest import add_rest_routes

    app = FastAPI()
    add_rest_routes(app, svc, 10 << 20)
    return TestClient(app)


def test_rest_search_takes_an_optional_reranker(svc, rest):
    path = svc.root / svc.data.items.paths[2]
    q = svc.query_from_upload(str(path))

    def post(**fields):
        with open(path, "rb") as f:
            return rest.post("/api/search", files={"image": ("q.png", f, "image/png")},
                             data={k: str(v) for k, v in fields.items()})

    old = post(strategy="random", r=0.4, seed=2, mode="bilinear", k=5)  # as before: no re-ranker
    assert old.status_code == 200 and old.json()["metric"] == "random(r=0.4, seed=2) · bilinear"
    r = post(strategy="random", r=0.4, seed=2, mode="bilinear", k=5, rerank="kreciprocal",
             rerank_params="k1=4 k2=2 pool=20")
    want = svc.panel(q, SearchConfig.of("random", {"r": 0.4, "seed": 2}, "bilinear", "kreciprocal",
                                        {"k1": 4, "k2": 2, "pool": 20}), 5)
    assert r.status_code == 200, r.text
    assert r.json()["metric"] == want.title and [x["id"] for x in r.json()["results"]] == [x["id"] for x in
                                                                                            want.results]
    for fields, message in (({"rerank": "nope"}, "unknown re-ranker 'nope'; choose from"),
                            ({"rerank": "aqe", "rerank_params": "alpha=-1"}, "re-ranker 'aqe': alpha must be ≥ 0"),
                            ({"rerank_params": "n=2"}, "re-ranker 'none': no parameter 'n'")):
        bad = post(**fields)
        assert bad.status_code == 400 and message in bad.json()["error"], bad.text
