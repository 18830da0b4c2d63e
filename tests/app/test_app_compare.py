"""The Compare tab's handlers and the share/export pieces (no browser)."""
import csv
import json
import re
import urllib.parse

import numpy as np
import pytest
from support import run_module

from app.compare_view import parse_state, state_query, tick_label, write_exports
from app.service import RetrievalService, Spec
from core.arrays import l2_normalize
from core.errors import UserError
from evaluation.evaluator import evaluate_ranking
from evaluation.knn import flat_index
from index.backends.gallery import RESULT_FIELDS

CONTROLS = {"r": 0.5, "seed": 0, "alpha": 0.5, "p": 0.5, "path": None}  # every parameter control


@pytest.fixture(scope="module")
def svc(tiny_index):
    return RetrievalService(tiny_index)


def evaluator_ap(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-query MAP@R from the evaluator on its own exact cosine index over X."""
    X = l2_normalize(np.asarray(X, dtype=np.float32))
    return evaluate_ranking(flat_index(X, "ip"), X, y, y, same_set=True, ks=(1,), return_per_query=True)[
        "per_query"]["map@r"]


def test_scatter_points_are_the_evaluators_per_query_ap(svc):
    cmp = svc.comparison(Spec("identity", {}, "cosine"), left_mode="cosine")
    X, y = np.asarray(svc.data.features), svc.data.items.labels
    # trained cosine = cosine of the embeddings Wφ; identity cosine = cosine of φ
    np.testing.assert_allclose(cmp.ap_a, evaluator_ap(X @ svc.data.W.T, y), atol=1e-6)
    np.testing.assert_allclose(cmp.ap_b, evaluator_ap(X, y), atol=1e-6)
    c = cmp.counts()
    assert c["improved"] + c["worsened"] + c["tied"] == c["queries"] == len(y)
    svg = svc.scatter_html(cmp, q_id=int(cmp.ids[3]))
    pts = re.findall(r'<circle cx="([\d.]+)" cy="([\d.]+)"[^>]*data-id="(\d+)"', svg)
    assert [int(p[2]) for p in pts] == cmp.ids.tolist()
    # pixel positions are the APs on [0, 1] axes: x (trained) from 52 px, 406 wide; y (M′) up from 386, 356 high
    px = np.array([[float(a), float(b)] for a, b, _ in pts])
    np.testing.assert_allclose(px[:, 0], 52 + 406 * cmp.ap_a, atol=0.051)
    np.testing.assert_allclose(px[:, 1], 386 - 356 * cmp.ap_b, atol=0.051)
    assert svg.count("★") == 1


def test_compare_handler_counts_filters_classes_and_steps(svc):
    from app.ui import Handlers

    h = Handlers(svc)
    summary, svg, rows, ids, cursor, classes = h.on_compare(None, "random", "bilinear", "all", **CONTROLS)
    cmp = svc.comparison(Spec("random", {"r": 0.5, "seed": 0}, "bilinear"), left_mode="bilinear")
    c = cmp.counts()
    assert f"{c['improved']:,} improved, {c['worsened']:,} worsened, {c['tied']:,} tied" in summary
    assert "sign test" in summary and "95% CI" in summary and svg.startswith("<svg")
    assert len(rows) == len(ids) == c["improved"] + c["worsened"] and cursor == -1
    assert sum(r[2] for r in classes) == c["queries"]
    worse, wids, _ = h.on_filter("random", "bilinear", "worsened", **CONTROLS)
    assert len(worse) == c["worsened"] and all(r[4] < 0 for r in worse)
    # next from the start opens the first, previous from the start the last
    q, _, _, cur = h.on_step(ids, -1, 1)
    assert q == {"kind": "item", "id": ids[0]} and cur == 0
    q, _, _, cur = h.on_step(ids, -1, -1)
    assert q["id"] == ids[-1] and cur == len(ids) - 1
    out = h.on_compare(None, "custom", "bilinear", "all", **CONTROLS)
    assert out[0].startswith("⚠️") and "upload" in out[0]


def test_maps_are_cached_and_mark_the_query(svc, monkeypatch):
    import app.service as service

    q_id = int(svc.data.items.ids[4])
    a = svc.map_html(Spec("trained", {}, "cosine"), "PCA", "M*", q_id)
    assert a.count("<circle") == len(svc.data.items) and "★" in a
    first = svc.map_coords("spectral", {"p": 0.5}, "cosine", "t-SNE")
    assert svc.map_coords("spectral", {"p": 0.5}, "cosine", "t-SNE") is first  # once per strategy
    monkeypatch.setattr(service, "subsample", lambda n: np.arange(min(n, 10)))
    b = svc.map_html(Spec("identity", {}, "bilinear"), "PCA", "M′", None)
    assert b.count("<circle") == 10 and f"sub-sampled: 10 of {len(svc.data.items)} points" in b
    with pytest.raises(UserError, match="map method must be one of"):
        svc.map_html(Spec("identity", {}, "cosine"), "MDS", "M′")


def test_url_state_round_trips_and_refuses_bad_values():
    qs = state_query(17, "random", {"r": 0.3, "seed": 4, "alpha": 0.9, "p": None}, "bilinear", 8)
    assert qs == "?q=17&strategy=random&r=0.3&seed=4&mode=bilinear&k=8"  # only the strategy's own parameters
    parsed = dict(urllib.parse.parse_qsl(qs[1:]))
    assert parse_state(parsed) == {"q": 17, "strategy": "random", "params": {"r": 0.3, "seed": 4},
                                   "mode": "bilinear", "k": 8}
    st = parse_state({"q": "5"})
    assert (st["strategy"], st["mode"], st["k"]) == ("identity", "cosine", 12)
    assert parse_state({}) is None
    for bad, msg in (({"q": "x"}, "must be integers"), ({"q": "1", "k": "99"}, "k must be between"),
                     ({"q": "1", "mode": "l3"}, "mode must be one of"), ({"q": "1", "strategy": "nope"}, "nope"),
                     ({"q": "1", "strategy": "custom"}, "cannot carry it")):
        with pytest.raises(UserError, match=msg):
            parse_state(bad)
    with pytest.raises(UserError, match="cannot be shared"):
        state_query(1, "custom", {"path": "m.npy"}, "bilinear", 4)


def test_on_load_opens_a_shared_link(svc):
    from app.ui import Handlers

    class Req:  # what gr.Request gives the handler
        query_params = {"q": str(int(svc.data.items.ids[2])), "strategy": "shrink", "alpha": "0.25", "k": "6"}

    out = Handlers(svc).on_load(Req())
    assert out[0] == {"kind": "item", "id": int(svc.data.items.ids[2])}
    assert out[2:5] == ("shrink", "cosine", 6) and 0.25 in out[5:-1]
    Req.query_params = {"q": "123456789"}
    assert "no item with id 123456789" in Handlers(svc).on_load(Req())[-1]


def test_share_link_of_an_item_and_of_an_upload(svc, tmp_path):
    from app.ui import Handlers

    h = Handlers(svc)
    item = {"kind": "item", "id": int(svc.data.items.ids[1])}
    out = h.on_search(item, None, "spectral", "cosine", 5, **CONTROLS)
    assert out[-1] == f"?q={item['id']}&strategy=spectral&p=0.5&mode=cosine&k=5"
    img = svc.root / svc.data.items.paths[1]
    assert "uploaded query cannot be in a link" in h.on_search({"kind": "upload"}, str(img), "identity", "cosine", 5,
                                                               **CONTROLS)[-1]


def test_export_equals_cli_search(svc, tmp_path):
    """The exported result lists are `python -m index search`'s for the same (uploaded) query."""
    img = svc.root / svc.data.items.paths[7]
    q = svc.query_from_upload(str(img))
    payload = svc.export(q, Spec("random", {"r": 0.4, "seed": 2}, "bilinear"), k=6, left_mode="bilinear")
    j, c = write_exports(payload, str(tmp_path))
    exported = json.loads(open(j).read())
    for side, args in (("left", ["--strategy", "trained"]), ("right", ["--strategy", "random", "--r", "0.4",
                                                                     "--seed", "2"])):
        out = tmp_path / f"{side}.json"
        r = run_module("index", "search", "--index", str(svc.index_dir), "--image", str(img), "--k", "6",
                       "--mode", "bilinear", "--json", str(out), *args, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        cli = json.loads(out.read_text())["queries"][0]["results"]
        panel = next(p for p in exported["panels"] if p["side"] == side)
        got = [{f: x[f] for f in RESULT_FIELDS} for x in panel["results"]]
        assert [{k: v for k, v in x.items() if k != "score"} for x in got] == \
               [{k: v for k, v in x.items() if k != "score"} for x in cli]
        assert [x["score"] for x in got] == pytest.approx([x["score"] for x in cli], rel=1e-5)
    with open(c, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and {r["side"] for r in rows} == {"left", "right"}
    assert rows[0]["relative_path"] == exported["panels"][0]["results"][0]["relative_path"]


def test_export_of_an_item_query_carries_p_at_k_and_ap(svc, tmp_path):
    from app.ui import Handlers

    item = {"kind": "item", "id": int(svc.data.items.ids[3])}
    files = Handlers(svc).on_export(item, None, "identity", "cosine", 4, **CONTROLS)
    payload = json.loads(open(files[0]).read())
    assert payload["query"]["id"] == item["id"] and all(p["ap"] is not None and p["p_at_k"] is not None
                                                         for p in payload["panels"])
    assert all(not str(f).startswith(str(svc.index_dir)) for f in files)


def test_tick_labels_are_readable():
    assert tick_label(-0.0216746) == "-0.0217" and tick_label(0.5) == "0.5" and tick_label(1234.5) == "1230"
