"""App handlers: search, strategy switching, disagreements, and bad uploads (no browser)."""
import io

import numpy as np
import pytest
from PIL import Image
from support import panels

from app import render
from app.service import RetrievalService, SearchConfig
from core.errors import UserError
from evaluation import evaluate
from index.space import CACHE


def test_item_query_leaves_itself_out_and_scores_match_evaluator(svc):
    i = int(svc.data.items.ids[5])
    q = svc.query_from_item(i)
    left, right = svc.compare(q, SearchConfig("identity", {}, "cosine"), k=6)
    for panel in (left, right):
        assert len(panel.results) == 6 and i not in [r["id"] for r in panel.results]
        assert all(r["correct"] == (r["label"] == q.label) for r in panel.results)
        assert panel.p_at_k == pytest.approx(np.mean([r["correct"] for r in panel.results]))
    # the panel's AP is this query's MAP@R in the leave-one-out evaluation of the whole gallery
    feats = np.asarray(svc.data.features)
    res = evaluate(feats, svc.data.items.labels, normalize=True, clustering=False)
    ap_all = svc.per_query_ap(SearchConfig("identity", {}, "cosine"))
    assert float(np.nanmean(ap_all)) == pytest.approx(res["map@r"])
    assert right.ap == pytest.approx(ap_all[5])


def test_strategy_switching_changes_right_panel_only(svc):
    q = svc.query_from_item(int(svc.data.items.ids[0]))
    trained = SearchConfig("trained", {}, "bilinear")
    l1, r1 = svc.compare(q, SearchConfig("identity", {}, "bilinear"), k=8, left=trained)
    l2, r2 = svc.compare(q, SearchConfig("spectral", {"p": 1.5}, "bilinear"), k=8, left=trained)
    assert [x["id"] for x in l1.results] == [x["id"] for x in l2.results]
    assert "identity" in r1.title and "spectral(p=1.5)" in r2.title
    assert [x["score"] for x in r1.results] != [x["score"] for x in r2.results]
    # cosine under an indefinite M′ falls back to bilinear, and says so
    _, r3 = svc.compare(q, SearchConfig("diagonal", {"r": 1.0, "seed": 0}, "cosine"), k=4)
    assert "bilinear" in r3.title and "indefinite" in r3.note


def test_disagreements_are_the_largest_ap_changes(svc):
    spec = SearchConfig("random", {"r": 1.0, "seed": 0}, "bilinear")
    rows = svc.disagreements(spec, SearchConfig("trained", {}, "bilinear"), top=5)
    a = svc.per_query_ap(SearchConfig("trained", {}, "bilinear"))
    b = svc.per_query_ap(spec)
    d = np.abs(np.nan_to_num(b - a))
    assert len(rows) == min(5, int((d > 0).sum()))
    assert rows and [abs(r["delta"]) for r in rows] == sorted([abs(r["delta"]) for r in rows], reverse=True)
    assert abs(rows[0]["delta"]) == pytest.approx(d.max())


def test_upload_query_any_mode(svc, tmp_path):
    src = svc.root / svc.data.items.paths[2]
    im = Image.open(src).convert("RGBA")
    p = tmp_path / "q.png"
    im.save(p)
    q = svc.query_from_upload(str(p))
    assert q.label is None and q.feats.shape == (1, svc.data.dim)
    panel = svc.panel(q, SearchConfig("trained", {}, "cosine"), k=3)
    assert panel.results[0]["id"] == int(svc.data.items.ids[2])  # finds the same image first
    assert panel.p_at_k is None and all(r["correct"] is None for r in panel.results)
    q2 = svc.query_from_upload(Image.open(src).convert("CMYK"))
    np.testing.assert_allclose(q2.feats, q.feats, atol=1e-2)


def _png_bytes(size=(8, 8)):
    buf = io.BytesIO()
    Image.new("RGB", size, (255, 255, 255)).save(buf, format="PNG")
    return buf.getvalue()


def test_bad_uploads_are_refused_with_a_message(svc, tmp_path, monkeypatch):
    cases = {"not_image.png": b"%PDF-1.4 this is a pdf", "empty.png": b"",
             "truncated.png": _png_bytes((64, 64))[:60]}
    for name, blob in cases.items():
        p = tmp_path / name
        p.write_bytes(blob)
        with pytest.raises(UserError, match="not a usable image"):
            svc.query_from_upload(str(p))
    import core.images
    monkeypatch.setattr(core.images, "MAX_PIXELS", 1000)
    big = tmp_path / "huge.png"
    big.write_bytes(_png_bytes((100, 100)))
    with pytest.raises(UserError, match="too large"):
        svc.query_from_upload(str(big))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # Pillow's own bomb limit
    with pytest.raises(UserError, match="decompression bomb"):
        svc.query_from_upload(str(big))
    with pytest.raises(UserError, match="no image"):
        svc.query_from_upload(None)


def test_ui_handler_turns_errors_into_a_visible_message(svc, tmp_path):
    from app.handlers import Handlers

    h = Handlers(svc)
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"garbage")
    out = h.on_search({"kind": "upload"}, str(bad), 5, **panels())
    assert out[1] == [] and out[3] == [] and out[4].startswith("⚠️") and "not a usable image" in out[4]
    item = {"kind": "item", "id": int(svc.data.items.ids[1])}
    for side in ("left", "right"):  # either panel's file-less custom strategy is refused
        out = h.on_search(item, None, 5, **panels(**{side: ("custom", "bilinear")}))
        assert "strategy custom: upload a symmetric d × d .npy matrix file first" in out[4]
    ok = h.on_search(item, None, 5, **panels(right=("random", "bilinear"), right_params={"r": 0.3, "seed": 1}))
    assert len(ok[1]) == 5 and len(ok[3]) == 5 and "random(r=0.3, seed=1) · bilinear" in ok[2]


def test_a_load_or_a_control_change_before_any_query_searches_nothing_and_warns_nothing(svc, monkeypatch):
    import gradio as gr

    from app.handlers import SEARCH_OUTPUTS, Handlers

    warned = []
    monkeypatch.setattr(gr, "Warning", lambda msg: warned.append(msg))
    h = Handlers(svc)
    idle = h.on_refresh(None, None, 5, **panels())
    assert len(idle) == SEARCH_OUTPUTS and all(x == gr.update() for x in idle) and warned == []
    h.on_search(None, None, 5, **panels())  # the Search button with nothing to search says so
    assert warned == ["no image: upload, paste or pick an example first"]
    item = {"kind": "item", "id": int(svc.data.items.ids[1])}
    ran, searched = h.on_refresh(item, None, 5, **panels()), h.on_search(item, None, 5, **panels())
    assert len(ran) == len(searched) == SEARCH_OUTPUTS and ran[:5] == searched[:5]


def test_custom_matrix_from_the_ui_is_labelled_by_its_file(svc, tmp_path):
    from app.handlers import Handlers

    M = tmp_path / "mine.npy"
    np.save(M, np.eye(svc.data.dim))
    item = {"kind": "item", "id": int(svc.data.items.ids[1])}
    ok = Handlers(svc).on_search(item, None, 4, **panels(left=("custom", "bilinear"), left_params={"path": str(M)}))
    assert "Left: custom(file=mine.npy) · bilinear" in ok[0] and len(ok[1]) == 4


def test_strategy_choices_come_from_the_registry(svc):
    from index.refinements import REFINEMENTS

    assert svc.strategy_choices() == REFINEMENTS.names()
    assert "custom" not in svc.strategy_choices(with_files=False)  # needs a file: not in the API
    assert set(svc.strategy_choices(with_files=False)) == set(REFINEMENTS.names()) - {"custom"}


def test_pictures_render(svc, monkeypatch):
    spec = SearchConfig("diagonal", {"r": 0.5}, "bilinear")
    CACHE.clear()  # what earlier tests drew
    drawn = []
    plot = render.plot_matrix
    monkeypatch.setattr(render, "plot_matrix", lambda *a: drawn.append(a[1]) or plot(*a))
    first = svc.heatmap(spec)
    assert first.size[0] > 100
    assert np.array_equal(np.asarray(svc.heatmap(spec)), np.asarray(first))
    assert drawn == [spec.label()]  # drawn once per M′
    assert len(svc.examples(4)) == 4


def test_gallery_map_stars_the_query_where_its_point_is(svc):
    """The scatter is drawn once; the query's star lands on its projected point."""
    q = svc.query_from_item(int(svc.data.items.ids[3]))
    plain, starred = np.asarray(svc.gallery_map()), np.asarray(svc.gallery_map(q))
    proj, base, to_pixel = svc.map_base()
    assert plain.shape == starred.shape == np.asarray(base).shape and plain.shape[1] > 100
    x, y = (int(round(v)) for v in to_pixel(proj(svc.searcher.prepare_queries(q.feats))[0]))
    assert tuple(starred[y, x]) == (0, 0, 0)  # the star's black centre
    changed = np.argwhere((plain != starred).any(axis=2))
    assert len(changed) and np.abs(changed - [y, x]).max() <= 12  # only around it


def test_warm_builds_every_default_strategy_before_the_first_search(tiny_index, monkeypatch):
    """The app warms these in the background at start: afterwards a search under any
    file-free strategy at its defaults builds nothing (same M′ object, cosine parts ready)."""
    CACHE.clear()  # what earlier tests built: this one counts what a first comparison computes
    s = RetrievalService(tiny_index)
    s.warm()
    names = s.strategy_choices(with_files=False)
    built = {n: s.searcher.metric(n, {}) for n in names}
    assert len(names) >= 6
    for n, rm in built.items():  # cosine parts exactly where cosine exists
        assert s.searcher.holds_cosine_parts(n, {}) == bool(rm.report["psd"]), n
    q = s.query_from_item(int(s.data.items.ids[0]))
    for n in names:
        s.panel(q, SearchConfig(n, {}, "cosine"), k=3)
        assert s.searcher.metric(n, {}) is built[n], n
    # the Compare tab's baseline too, in either mode: a first comparison computes only its M′'s
    assert all(s.comparer.holds(SearchConfig("trained", {}, mode)) for mode in ("cosine", "bilinear"))
    computed = []
    compute = s.comparer._compute
    monkeypatch.setattr(s.comparer, "_compute", lambda rm, *a: computed.append(rm.name) or compute(rm, *a))
    s.comparison(SearchConfig("identity", {}, "cosine"))
    assert computed == ["identity"] and s.comparer.holds(SearchConfig("identity", {}, "cosine"))


def test_query_embedding_reproduces_the_indexed_features(svc):
    """A gallery image embedded as a query (one image, channels-last) gets the feature the index
    stored for it (batched, the default layout) up to float round-off."""
    rows = [0, 5, 11]
    stored = np.asarray(svc.data.features, dtype=np.float32)[rows]
    for row, want in zip(rows, stored, strict=True):
        got = svc.query_from_upload(str(svc.root / svc.data.items.paths[row])).feats[0]
        got = got / np.linalg.norm(got) if svc.data.manifest["normalize"] else got
        np.testing.assert_allclose(got, want, atol=1e-5)
