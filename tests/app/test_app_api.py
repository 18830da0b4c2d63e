"""The search API as clients see it: Gradio's /search keeps its parameters' names and positional
order (new ones only at the end), POST /api/search refuses a field it does not know, and every
re-ranker size is bounded by the server's limit, in both APIs, the panels and the Compare tab."""
import gradio as gr
import pytest
from support import panels

from app.limits import DEFAULT_MAX_RERANK_SIZE
from app.params import api_params
from app.service import RetrievalService, SearchConfig
from core.errors import UserError
from index.rerankers import RERANKERS, SIZE_LIMIT, check_size_limit, size_params

# Gradio's /search, as gradio_client calls it positionally: a new parameter is only ever appended.
SEARCH_API = ["image", "strategy", "r", "seed", "alpha", "p", "mode", "k", "psd", "rerank", "rerank_params"]


@pytest.fixture(scope="module")
def api(svc):
    from app.ui import build_ui

    return build_ui(svc).get_api_info()["named_endpoints"]["/search"]["parameters"]


def test_search_api_names_and_order_are_pinned(api):
    assert [p["parameter_name"] for p in api] == SEARCH_API == api_params()
    # every parameter after the image may be left out: a call that stops early keeps the defaults
    defaults = {p["parameter_name"]: p["parameter_default"] for p in api if p["parameter_has_default"]}
    assert defaults == {"strategy": "trained", "r": 0.5, "seed": 0, "alpha": 0.5, "p": 0.5, "mode": "cosine",
                        "k": 10, "psd": "abs", "rerank": "none", "rerank_params": ""}


def test_a_positional_call_in_the_order_before_psd_searches_what_it_names(svc, api):
    """The call a script written before `psd` makes: image, strategy, r, seed, alpha, p, mode, k."""
    from app.handlers import api_search

    img = str(svc.root / svc.data.items.paths[2])
    values = [img, "shrink", 0.5, 0, 0.25, 0.5, "bilinear", 4]
    names = [p["parameter_name"] for p in api][: len(values)]
    got = api_search(svc)(**dict(zip(names, values, strict=True)))
    assert got["metric"] == "shrink(alpha=0.25) · bilinear" and len(got["results"]) == 4


def test_gradio_api_refuses_a_name_it_does_not_take(svc):
    from app.handlers import api_search

    img = str(svc.root / svc.data.items.paths[2])
    with pytest.raises(gr.Error, match=r"unknown field 'stratgy'; valid: image, strategy, r, seed, alpha, p, mode, "
                                       r"k, psd, rerank, rerank_params"):
        api_search(svc)(img, stratgy="identity")


@pytest.fixture(scope="module")
def post(svc):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from app.rest import add_rest_routes

    def send(service=svc, **fields):
        app = FastAPI()
        add_rest_routes(app, service, 10 << 20)
        with open(service.root / service.data.items.paths[2], "rb") as f:
            return TestClient(app).post("/api/search", files={"image": ("q.png", f, "image/png")},
                                        data={k: str(v) for k, v in fields.items()})
    return send


def test_rest_refuses_unknown_fields_naming_the_valid_ones(post):
    r = post(stratgy="identity")  # a typo would otherwise search the trained metric
    assert r.status_code == 400
    assert r.json()["error"] == ("unknown field 'stratgy'; valid: image, strategy, r, seed, alpha, p, mode, k, psd, "
                                 "rerank, rerank_params")
    r = post(strategy="identity", kk=3, rerank_param="n=2")
    assert r.status_code == 400 and r.json()["error"].startswith("unknown fields 'kk', 'rerank_param'; valid: image,")
    # every API parameter is known, another strategy's too (as Gradio's API always sends them all)
    ok = post(strategy="identity", r=0.3, seed=1, alpha=0.5, p=0.5, psd="clip", mode="bilinear", k=3, rerank="none",
              rerank_params="")
    assert ok.status_code == 200 and ok.json()["metric"] == "identity · bilinear"


def test_every_rerankers_defaults_pass_the_default_limit(svc):
    assert DEFAULT_MAX_RERANK_SIZE == svc.max_rerank_size == SIZE_LIMIT
    for name in RERANKERS.names():
        check_size_limit(name, {}, DEFAULT_MAX_RERANK_SIZE)
        svc.check(SearchConfig("trained", {}, "cosine", name, {}))
    assert all(size_params(n) for n in RERANKERS.names() if n != "none")  # the loop checked every re-ranker's sizes


@pytest.fixture(scope="module")
def small(tiny_index):
    """A server whose re-rankers may read at most 6 of anything."""
    return RetrievalService(tiny_index, max_rerank_size=6)


def test_a_size_above_the_server_limit_is_refused_in_both_apis(small, post):
    from app.handlers import api_search

    too_big = "re-ranker 'aqe': n must be ≤ 6 (this server's limit), got 7"
    r = post(service=small, rerank="aqe", rerank_params="n=7")
    assert r.status_code == 400 and r.json()["error"] == too_big
    assert post(service=small, rerank="aqe", rerank_params="n=6", k=3).status_code == 200
    with pytest.raises(gr.Error, match=too_big.replace("(", r"\(").replace(")", r"\)")):
        api_search(small)(str(small.root / small.data.items.paths[2]), rerank="aqe", rerank_params="n=7")
    # a re-ranker's default above the limit is refused too, naming the parameter
    name, size, default = next((n, p, getattr(RERANKERS.params(n, {}), p)) for n in RERANKERS.names()
                               for p in size_params(n) if getattr(RERANKERS.params(n, {}), p) > 6)
    r = post(service=small, rerank=name)
    assert r.status_code == 400 and f"{size} must be ≤ 6 (this server's limit), got {default}" in r.json()["error"]


def test_a_size_above_the_server_limit_is_refused_in_the_panels_and_the_compare_tab(small):
    from app.controls import rerank_key
    from app.handlers import Handlers

    h = Handlers(small)
    item = {"kind": "item", "id": int(small.data.items.ids[3])}
    values = panels() | {"right_rerank": "aqe", rerank_key("right", "aqe", "n"): 9}
    out = h.on_search(item, None, 4, **values)
    assert out[4] == "⚠️ re-ranker 'aqe': n must be ≤ 6 (this server's limit), got 9"
    summary, *_ = h.on_compare(item, "all", 4, "outcome", 1.0, progress=None, **values)
    assert summary == "⚠️ re-ranker 'aqe': n must be ≤ 6 (this server's limit), got 9"
    big = SearchConfig("trained", {}, "cosine", "dba", {"n": 9})
    q = small.query_from_item(item["id"])
    for call in (lambda: small.panel(q, big, 4), lambda: small.comparison(big), lambda: small.per_query_ap(big),
                 lambda: small.why(q, int(small.data.items.ids[5]), big),
                 lambda: small.disagreements(SearchConfig(), big)):
        with pytest.raises(UserError, match="n must be ≤ 6"):
            call()


def test_the_server_option_sets_the_limit_and_refuses_a_bad_one(capsys):
    from app.cli import build_parser

    assert build_parser().parse_args([]).max_rerank_size == DEFAULT_MAX_RERANK_SIZE
    assert build_parser().parse_args(["--max-rerank-size", "200"]).max_rerank_size == 200
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--max-rerank-size", "0"])
    assert e.value.code == 2 and "--max-rerank-size must be ≥ 1, got 0" in capsys.readouterr().err
