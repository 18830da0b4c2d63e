""""One file plus one line" for re-rankers: a re-ranker registered here, and nowhere else,
reaches the app's panels and their dropdowns, the Gradio /search API and POST /api/search."""
from dataclasses import dataclass

import pytest
from support import blocks_by_label, panels

from core.params import param
from index.rerankers import RERANKERS, candidates


@dataclass
class FlipParams:
    depth: int = param(5, "first-search candidates flipped")


def flip(space, queries, first, k, *, self_ids, params: FlipParams):
    """Flip: the plain search's top `depth` in reverse order (a test-only re-ranker)."""
    rows, scores = candidates(first, self_ids, max(k, params.depth))
    return space.hits(rows[:, ::-1][:, :k], scores[:, ::-1][:, :k])


@pytest.fixture
def flip_registered(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    RERANKERS.register("flip", FlipParams, depth="depth")(flip)  # the one line
    try:
        yield "flip"
    finally:
        RERANKERS.unregister("flip")


def flipped(svc, feats, depth: int, k: int, own: int | None = None) -> list[int]:
    """By hand: the plain top `depth` (the query's own item left out), reversed, cut to k."""
    ids = svc.data.items.ids[svc.searcher.search(feats, "trained", {}, "cosine", depth + 1).rows[0]].tolist()
    return [i for i in ids if i != own][:depth][::-1][:k]


def test_new_reranker_reaches_the_panels_and_their_dropdowns(flip_registered, svc):
    from app.controls import rerank_key
    from app.handlers import Handlers
    from app.service import SearchConfig
    from app.ui import build_ui

    item = int(svc.data.items.ids[3])
    q = svc.query_from_item(item)
    panel = svc.panel(q, SearchConfig("trained", {}, "cosine", "flip", {"depth": 4}), k=3)
    assert panel.title == "trained · cosine · flip(depth=4)"
    assert [r["id"] for r in panel.results] == flipped(svc, q.feats, 4, 3, own=item)
    values = panels() | {"right_strategy": "trained", "right_rerank": "flip", rerank_key("right", "flip", "depth"): 6}
    out = Handlers(svc).on_search({"kind": "item", "id": item}, None, 3, **values)
    assert out[2].startswith("### Right: trained · cosine · flip(depth=6)") and out[5]["right"] == flipped(
        svc, q.feats, 6, 3, own=item)
    assert "&rerank=flip&rerank_depth=6&" in out[-1]

    demo = build_ui(svc)
    by_label = blocks_by_label(demo)
    for side in ("Left", "Right"):
        (dd,) = by_label[f"{side} re-ranker"]
        assert "flip" in [v for _, v in dd.choices]
    controls = by_label["depth: first-search candidates flipped (flip; default: 5)"]
    assert len(controls) == 2 and all(c.visible is False and c.value == 5 for c in controls)  # hidden until chosen
    (api_dd,) = by_label["rerank"]  # the hidden API's
    assert "flip" in [v for _, v in api_dd.choices]


def test_new_reranker_reaches_both_http_apis(flip_registered, svc):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from app.handlers import api_search
    from app.rest import add_rest_routes

    path = svc.root / svc.data.items.paths[5]
    feats = svc.query_from_upload(str(path)).feats
    got = api_search(svc)(str(path), "trained", mode="cosine", k=3, rerank="flip", rerank_params="depth=4")
    assert got["metric"] == "trained · cosine · flip(depth=4)"
    assert [r["id"] for r in got["results"]] == flipped(svc, feats, 4, 3)

    app = FastAPI()
    add_rest_routes(app, svc, 10 << 20)
    with open(path, "rb") as f:
        r = TestClient(app).post("/api/search", files={"image": ("q.png", f, "image/png")},
                                 data={"k": "3", "rerank": "flip", "rerank_params": '{"depth": 6}'})
    assert r.status_code == 200, r.text
    assert [x["id"] for x in r.json()["results"]] == flipped(svc, feats, 6, 3)
    with open(path, "rb") as f:
        bad = TestClient(app).post("/api/search", files={"image": ("q.png", f, "image/png")},
                                   data={"rerank": "flip", "rerank_params": "depth=x"})
    assert bad.status_code == 400 and "re-ranker 'flip': depth: 'x' is not an integer" in bad.json()["error"]


def test_unregistering_removes_it_again(svc):
    from app.ui import build_ui

    assert "flip" not in RERANKERS
    choices = [v for b in build_ui(svc).blocks.values() if getattr(b, "label", None) == "Right re-ranker"
               for _, v in b.choices]
    assert choices and "flip" not in choices
