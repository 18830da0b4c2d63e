"""The Compare tab's handlers and the share/export pieces (no browser)."""
import csv
import json
import re
import urllib.parse

import numpy as np
import pytest
from support import panels, run_command

from app.compare_view import parse_state, state_query, tick_label, write_exports
from core.arrays import l2_normalize
from core.errors import UserError
from evaluation.evaluator import evaluate_ranking
from evaluation.knn import flat_index
from index.backends.gallery import HIT_FIELDS
from index.refinements import REFINEMENTS, shared_params
from index.search_config import SearchConfig


def evaluator_ap(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-query MAP@R from the evaluator on its own exact cosine index over X."""
    X = l2_normalize(np.asarray(X, dtype=np.float32))
    return evaluate_ranking(flat_index(X, "ip"), X, y, y, same_set=True, ks=(1,), return_per_query=True)[
        "per_query"]["map@r"]


def test_scatter_points_are_the_evaluators_per_query_ap(svc):
    cmp = svc.comparison(SearchConfig("identity", {}, "cosine"))  # the left side: trained, cosine
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
    from app.handlers import Handlers

    h = Handlers(svc)
    cfg = panels(left=("trained", "bilinear"), right=("random", "bilinear"))
    summary, svg, rows, ids, cursor, classes = h.on_compare(None, "all", 12, "outcome", 1.0, **cfg)
    cmp = svc.comparison(SearchConfig("random", {"r": 0.5, "seed": 0}, "bilinear"),
                         SearchConfig("trained", {}, "bilinear"))
    c = cmp.counts()
    assert f"{c['improved']:,} improved, {c['worsened']:,} worsened, {c['tied']:,} tied" in summary
    assert "sign test" in summary and "95% CI" in summary and svg.startswith("<svg") and "Jaccard@12" in summary
    assert len(rows) == len(ids) == c["improved"] + c["worsened"] and cursor == -1
    assert sum(r[2] for r in classes) == c["queries"]
    worse, wids, _ = h.on_filter("worsened", 12, 1.0, **cfg)
    assert len(worse) == c["worsened"] and all(r[4] < 0 for r in worse)
    # next from the start opens the first, previous from the start the last
    q, _, _, cur = h.on_step(ids, -1, 1)
    assert q == {"kind": "item", "id": ids[0]} and cur == 0
    q, _, _, cur = h.on_step(ids, -1, -1)
    assert q["id"] == ids[-1] and cur == len(ids) - 1
    out = h.on_compare(None, "all", 12, "outcome", 1.0, **panels(right=("custom", "bilinear")))
    assert out[0].startswith("⚠️") and "upload" in out[0]


def test_maps_are_cached_and_mark_the_query(svc, monkeypatch):
    import app.service as service

    q_id = int(svc.data.items.ids[4])
    a = svc.map_html(SearchConfig("trained", {}, "cosine"), "PCA", "M*", q_id)
    assert a.count("<circle") == len(svc.data.items) and "★" in a
    first = svc.map_coords("spectral", {"p": 0.5}, "cosine", "t-SNE")
    assert svc.map_coords("spectral", {"p": 0.5}, "cosine", "t-SNE") is first  # once per strategy
    monkeypatch.setattr(service, "subsample", lambda n: np.arange(min(n, 10)))
    b = svc.map_html(SearchConfig("identity", {}, "bilinear"), "PCA", "M′", None)
    assert b.count("<circle") == 10 and f"sub-sampled: 10 of {len(svc.data.items)} points" in b
    with pytest.raises(UserError, match="map method must be one of"):
        svc.map_html(SearchConfig("identity", {}, "cosine"), "MDS", "M′")


def test_url_state_round_trips_and_refuses_bad_values():
    left = SearchConfig("spectral", {"p": 0.25}, "bilinear")
    right = SearchConfig("random", {"r": 0.3, "seed": 4}, "bilinear")
    qs = state_query(17, left, right, 8)
    # only each strategy's own parameters; the left side's keys prefixed
    assert qs == "?q=17&left_strategy=spectral&left_p=0.25&left_mode=bilinear&strategy=random&r=0.3&seed=4" \
                 "&mode=bilinear&k=8"
    parsed = dict(urllib.parse.parse_qsl(qs[1:]))
    assert parse_state(parsed) == {"q": 17, "left": left, "right": right, "k": 8}
    st = parse_state({"q": "5"})
    assert (st["left"], st["right"], st["k"]) == (SearchConfig(), SearchConfig("identity"), 12)
    assert parse_state({}) is None
    for bad, msg in (({"q": "x"}, "must be integers"), ({"q": "1", "k": "99"}, "k must be between"),
                     ({"q": "1", "mode": "l3"}, "mode must be one of"), ({"q": "1", "strategy": "nope"}, "nope"),
                     ({"q": "1", "strategy": "custom"}, "cannot carry it"),
                     ({"q": "1", "left_strategy": "nope"}, "the link's left strategy: unknown"),
                     ({"q": "1", "left_mode": "l3"}, "the link's left mode must be one of"),
                     ({"q": "1", "left_strategy": "custom"}, "cannot carry it"),
                     ({"q": "1", "left_strategy": "random", "left_r": "7"}, r"r must be in \[0, 1\]"),
                     ({"q": "1", "rerank": "nope"}, "the link's re-ranker: unknown re-ranker 'nope'; choose from"),
                     ({"q": "1", "left_rerank": "aqe", "left_rerank_n": "0"},
                      "the link's left re-ranker: re-ranker 'aqe': n must be ≥ 1")):
        with pytest.raises(UserError, match=msg):
            parse_state(bad)
    with pytest.raises(UserError, match="cannot be shared"):
        state_query(1, SearchConfig(), SearchConfig("custom", {"path": "m.npy"}, "bilinear"), 4)
    with pytest.raises(UserError, match="cannot be shared"):
        state_query(1, SearchConfig("custom", {"path": "m.npy"}, "bilinear"), SearchConfig(), 4)
    # each side's re-ranker and its parameters travel in links, and come back as they went
    rr = SearchConfig("identity", {}, "cosine", "aqe", {"n": 3, "alpha": 1.0})
    lr = SearchConfig("spectral", {"p": 0.25}, "bilinear", "kreciprocal", {"k1": 10, "k2": 3, "lambda_value": 0.2,
                                                                   "pool": 50, "sets": "pool"})
    qs = state_query(1, lr, rr, 4)
    assert "&rerank=aqe&rerank_n=3&rerank_alpha=1.0&" in qs and "&left_rerank=kreciprocal&left_rerank_k1=10&" in qs
    assert parse_state(dict(urllib.parse.parse_qsl(qs[1:]))) == {"q": 1, "left": lr, "right": rr, "k": 4}
    # a link naming only some of its parameters: the re-ranker's defaults for the rest
    st = parse_state({"q": "2", "rerank": "aqe", "rerank_n": "5"})
    assert (st["right"].rerank, st["right"].rerank_params) == ("aqe", {"n": 5, "alpha": 3.0})


def side_width() -> int:
    """How many values `on_load` gives per side: strategy, mode, each strategy parameter, re-ranker,
    each re-ranker parameter."""
    from app.controls import rerank_controls

    return 3 + len(shared_params()) + len(rerank_controls())


def test_old_links_open_with_trained_on_the_left(svc):
    """A link made when only the right side could change (no left_* keys) opens as it did: the
    trained metric on the left, in the link's mode."""
    from app.handlers import Handlers

    item = int(svc.data.items.ids[2])
    old = {"q": str(item), "strategy": "shrink", "alpha": "0.25", "mode": "bilinear", "k": "6"}
    st = parse_state(old)
    assert st["left"] == SearchConfig("trained", {}, "bilinear") \
        and st["right"] == SearchConfig("shrink", {"alpha": 0.25}, "bilinear")
    assert parse_state({"q": "3", "strategy": "spectral"})["left"] == SearchConfig("trained", {}, "cosine")

    class Req:  # what gr.Request gives the handler
        query_params = old

    out = Handlers(svc).on_load(Req())
    w = side_width()
    left, right = out[3: 3 + w], out[3 + w: 3 + 2 * w]
    assert out[:1] == ({"kind": "item", "id": item},) and out[2] == 6
    assert left[:2] == ("trained", "bilinear") and right[:2] == ("shrink", "bilinear")
    assert right[2 + [sp.name for sp in shared_params()].index("alpha")] == 0.25
    # the comparison it opens searches trained · bilinear on the left
    h = Handlers(svc)
    values = panels(left=left[:2], right=right[:2], right_params={"alpha": 0.25})
    res = h.on_search({"kind": "item", "id": item}, None, 6, **values)
    assert res[0].startswith("### Left: trained · bilinear") and res[2].startswith("### Right: shrink(alpha=0.25)")
    assert res[-1] == f"?q={item}&left_strategy=trained&left_mode=bilinear&strategy=shrink&alpha=0.25&mode=bilinear&k=6"


def test_on_load_opens_a_shared_link_of_two_configurations(svc):
    from app.controls import rerank_controls
    from app.handlers import Handlers

    class Req:  # what gr.Request gives the handler
        query_params = {"q": str(int(svc.data.items.ids[2])), "left_strategy": "random", "left_r": "0.3",
                        "left_mode": "bilinear", "strategy": "shrink", "alpha": "0.25", "k": "6",
                        "rerank": "aqe", "rerank_n": "4", "left_rerank": "dba", "left_rerank_alpha": "1.5"}

    out = Handlers(svc).on_load(Req())
    n, w = len(shared_params()), side_width()
    names = [sp.name for sp in shared_params()]
    left, right = out[3: 3 + w], out[3 + w: 3 + 2 * w]
    assert out[0] == {"kind": "item", "id": int(svc.data.items.ids[2])} and out[2] == 6
    assert left[:2] == ("random", "bilinear") and left[2 + names.index("r")] == 0.3
    assert left[2 + names.index("seed")] == 0 and right[:2] == ("shrink", "cosine")
    assert right[2 + names.index("alpha")] == 0.25 and len(out) == 3 + 2 * w + 1
    # each side's re-ranker, then its parameter controls: the chosen re-ranker's set, every other left as it is
    keys = [(name, sp.name) for name, sp in rerank_controls()]
    assert left[2 + n] == "dba" and right[2 + n] == "aqe"
    left_rr, right_rr = dict(zip(keys, left[3 + n:], strict=True)), dict(zip(keys, right[3 + n:], strict=True))
    assert (left_rr[("dba", "n")], left_rr[("dba", "alpha")]) == (2, 1.5)
    assert (right_rr[("aqe", "n")], right_rr[("aqe", "alpha")]) == (4, 3.0)
    untouched = {"__type__": "update"}
    assert all(v == untouched for (name, _), v in left_rr.items() if name != "dba")
    assert all(v == untouched for (name, _), v in right_rr.items() if name != "aqe")
    Req.query_params = {"q": "123456789"}
    assert "no item with id 123456789" in Handlers(svc).on_load(Req())[-1]


def test_share_link_of_an_item_and_of_an_upload(svc, tmp_path):
    from app.handlers import Handlers

    h = Handlers(svc)
    item = {"kind": "item", "id": int(svc.data.items.ids[1])}
    out = h.on_search(item, None, 5, **panels(right=("spectral", "cosine")))
    assert out[-1] == f"?q={item['id']}&left_strategy=trained&left_mode=cosine&strategy=spectral&p=0.5&mode=cosine&k=5"
    img = svc.root / svc.data.items.paths[1]
    assert "uploaded query cannot be in a link" in h.on_search({"kind": "upload"}, str(img), 5, **panels())[-1]


def test_params_shown_are_the_chosen_strategys(svc):
    """A panel shows the parameter controls its strategy takes, and hides its parameter group when
    it takes none."""
    from app.controls import visible_params
    from app.handlers import on_strategy

    names = [sp.name for sp in shared_params()]
    want = {"trained": set(), "identity": set(), "diagonal": {"r", "seed"}, "random": {"r", "seed"},
            "diagonal-psd": {"r", "seed", "psd"}, "random-psd": {"r", "seed", "psd"}, "shrink": {"alpha"},
            "spectral": {"p"}, "custom": {"path"}}
    assert set(want) == set(REFINEMENTS.names())
    for strategy, own in want.items():
        assert {n for n, v in visible_params(strategy).items() if v} == own == set(
            REFINEMENTS.get(strategy).param_defaults())
        group, *controls = on_strategy(strategy)
        assert group == {"__type__": "update", "visible": bool(own)}
        assert [u["visible"] for u in controls] == [n in own for n in names]


def test_two_configurations_end_to_end(svc, tmp_path):
    """A non-trained left side through every view: both panels, the share link, the export, the
    Compare tab's statistics, scatter, disagreements and per-class table, the why panel."""
    from app.handlers import Handlers

    h = Handlers(svc)
    left = SearchConfig("shrink", {"alpha": 0.3}, "cosine")
    right = SearchConfig("random", {"r": 0.5, "seed": 0}, "bilinear")
    cfg = panels(left=("shrink", "cosine"), right=("random", "bilinear"), left_params={"alpha": 0.3})
    item = int(svc.data.items.ids[4])
    q = {"kind": "item", "id": item}
    out = h.on_search(q, None, 6, **cfg)
    assert out[0].startswith("### Left: shrink(alpha=0.3) · cosine") and out[2].startswith("### Right: random(r=0.5")
    direct = svc.searcher.search(svc.data.features[4:5], "shrink", {"alpha": 0.3}, "cosine", 7)
    assert out[5]["left"] == [int(i) for i in direct.items.ids[direct.rows[0]] if i != item][:6]
    assert "Jaccard@6" in out[4]
    assert parse_state(dict(urllib.parse.parse_qsl(out[-1][1:]))) == {"q": item, "left": left, "right": right, "k": 6}
    # the Compare tab: x is the left configuration's per-query AP, y the right's
    summary, svg, rows, ids, _, classes = h.on_compare(q, "all", 6, "jaccard", 1.0, **cfg)
    assert summary.startswith("**shrink(alpha=0.3) · cosine** (x) vs **random(r=0.5, seed=0) · bilinear** (y)")
    cmp = svc.comparison(right, left, k=6)
    ok = ~np.isnan(svc.per_query_ap(left))
    np.testing.assert_array_equal(cmp.ap_a, svc.per_query_ap(left)[ok])
    np.testing.assert_array_equal(cmp.ap_b, svc.per_query_ap(right)[ok])
    assert "colour: Jaccard@6" in svg and "★" in svg
    assert [r[0] for r in rows] == [r["id"] for r in cmp.disagreements("all")] == ids
    assert [r[5] for r in rows] == [round(r["jaccard"], 3) for r in cmp.disagreements("all")]
    assert [c[3] for c in classes] == [round(r["ap_a"], 4) for r in cmp.per_class()]
    assert [c[6] for c in classes] == [round(r["jaccard"], 3) for r in cmp.per_class()]  # mean Jaccard@6
    few, few_ids, _ = h.on_filter("all", 6, 0.4, **cfg)  # only queries whose top-6 lists overlap ≤ 0.4
    assert all(r[5] <= 0.4 for r in few) and set(few_ids) <= set(ids)
    _, svg_few, *_ = h.on_compare(q, "all", 6, "outcome", 0.4, **cfg)
    assert svg_few.count("<circle") == int((cmp.jaccard <= 0.4).sum())
    # the export carries both configurations
    files = h.on_export(q, None, 6, **cfg)["value"]
    payload = json.loads(open(files[0]).read())
    assert payload["left"]["strategy"] == "shrink" and payload["left"]["params"] == {"alpha": 0.3}
    assert payload["right"]["label"] == "random(r=0.5, seed=0) · bilinear" and payload["left"]["rerank"] == "none"
    assert [p["config"]["strategy"] for p in payload["panels"]] == ["shrink", "random"]
    with open(files[1], newline="") as f:
        rows_csv = list(csv.DictReader(f))
    assert {(r["side"], r["strategy"], r["mode"]) for r in rows_csv} == {("left", "shrink", "cosine"),
                                                                        ("right", "random", "bilinear")}
    # why a result moved: a result of the right panel, explained against the left
    moved = out[5]["right"][2]
    html_out, box = h.on_why(q, None, moved, 6, **cfg)
    why = svc.why(svc.query_from_item(item), moved, right, left, k=6)
    assert box == {"__type__": "update", "open": True}
    assert why.right.rank == 3 and f"rank {why.left.rank} → 3" in html_out
    assert "change of the norms" in html_out and "score difference (right − left)" in html_out
    assert sum(d.term for d in why.shown) + why.rest + why.change.norm_term == pytest.approx(why.change.delta)
    assert html_out.count('class="why-strip"') == len(why.shown) == 5


def test_export_equals_cli_search(svc, tmp_path):
    """The exported result lists are `python -m index search`'s for the same (uploaded) query."""
    img = svc.root / svc.data.items.paths[7]
    q = svc.query_from_upload(str(img))
    right = SearchConfig("random", {"r": 0.4, "seed": 2}, "bilinear")
    payload = svc.export(q, right, k=6, left=SearchConfig("trained", {}, "bilinear"))
    j, c = write_exports(payload, str(tmp_path))
    exported = json.loads(open(j).read())
    for side, args in (("left", ["--strategy", "trained"]), ("right", ["--strategy", "random", "--r", "0.4",
                                                                     "--seed", "2"])):
        out = tmp_path / f"{side}.json"
        r = run_command("index", "search", "--index", str(svc.index_dir), "--image", str(img), "--k", "6",
                        "--mode", "bilinear", "--json", str(out), *args, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        cli = json.loads(out.read_text())["queries"][0]["results"]
        panel = next(p for p in exported["panels"] if p["side"] == side)
        got = [{f: x[f] for f in HIT_FIELDS} for x in panel["results"]]
        assert [{k: v for k, v in x.items() if k != "score"} for x in got] == \
               [{k: v for k, v in x.items() if k != "score"} for x in cli]
        assert [x["score"] for x in got] == pytest.approx([x["score"] for x in cli], rel=1e-5)
    with open(c, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 12 and {r["side"] for r in rows} == {"left", "right"}
    assert rows[0]["relative_path"] == exported["panels"][0]["results"][0]["relative_path"]


def test_export_of_an_item_query_carries_p_at_k_and_ap(svc, tmp_path):
    from app.handlers import Handlers

    item = {"kind": "item", "id": int(svc.data.items.ids[3])}
    files = Handlers(svc).on_export(item, None, 4, **panels())["value"]
    payload = json.loads(open(files[0]).read())
    assert payload["query"]["id"] == item["id"] and all(p["ap"] is not None and p["p_at_k"] is not None
                                                         for p in payload["panels"])
    assert all(not str(f).startswith(str(svc.index_dir)) for f in files)


def test_tick_labels_are_readable():
    assert tick_label(-0.0216746) == "-0.0217" and tick_label(0.5) == "0.5" and tick_label(1234.5) == "1230"
