""""One file plus one line", for real: a refinement strategy registered here, and nowhere
else, reaches the index CLI, the evaluation sweep, the app's service, UI and HTTP API."""
import json
from dataclasses import dataclass

import numpy as np
import pytest
from support import panels

from core.params import param
from index.refinements import REFINEMENTS


@dataclass
class LiftParams:
    gamma: float = param(0.25, "weight γ of the added identity", bounds="[0, 2]")


def lift(M: np.ndarray, p: LiftParams) -> np.ndarray:
    """Lift: M* + γ·I (a test-only strategy)."""
    return M + p.gamma * np.eye(M.shape[0])


@pytest.fixture
def lift_registered():
    REFINEMENTS.register("lift", LiftParams, grid={"gamma": (0.0, 0.5)})(lift)  # the one line
    try:
        yield "lift"
    finally:
        REFINEMENTS.unregister("lift")


def cli(capsys, *argv) -> str:
    from index.cli import main

    try:
        main(list(argv))
    except SystemExit as e:  # --help exits 0
        assert e.code == 0
    return capsys.readouterr().out


def test_new_strategy_reaches_the_index_cli(lift_registered, tiny_index, tmp_path, capsys):
    from index.backends.search import Searcher
    from index.backends.store import read_index

    helptext = " ".join(cli(capsys, "search", "--help").split())
    assert "lift: Lift: M* + γ·I (a test-only strategy)." in helptext
    assert "--gamma GAMMA weight γ of the added identity (lift; default: 0.25)" in helptext
    assert "lift" in cli(capsys, "list") and "gamma = 0.25" in cli(capsys, "list")
    # the generated flag reaches the strategy: the CLI returns what the Searcher returns
    data = read_index(tiny_index)
    q = tmp_path / "q.npy"
    np.save(q, np.asarray(data.features[:2]))
    out = tmp_path / "res.json"
    cli(capsys, "search", "--index", str(tiny_index), "--features", str(q), "--strategy", "lift",
        "--gamma", "1.5", "--k", "4", "--mode", "bilinear", "--json", str(out))
    res = json.loads(out.read_text())
    want = Searcher(data).search(np.asarray(data.features[:2]), "lift", {"gamma": 1.5}, "bilinear", 4)
    assert res["params"] == {"gamma": 1.5}
    np.testing.assert_allclose([[x["score"] for x in r["results"]] for r in res["queries"]], want.scores, rtol=1e-5)
    assert [[x["id"] for x in r["results"]] for r in res["queries"]] == data.items.ids[want.rows].tolist()


def test_new_strategy_reaches_the_sweep(lift_registered):
    from index.analysis.strategy_eval import evaluate_configs, is_trained_equivalent, label, sweep_configs

    configs = [c for c in sweep_configs(seeds=2) if c[0] == "lift"]
    assert configs == [("lift", {"gamma": 0.0}, "bilinear"), ("lift", {"gamma": 0.0}, "cosine"),
                       ("lift", {"gamma": 0.5}, "bilinear"), ("lift", {"gamma": 0.5}, "cosine")]
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(6), 4)
    X = np.abs(rng.normal(size=(6, 12))[y] + 0.3 * rng.normal(size=(24, 12)))
    rows = evaluate_configs(X, y, rng.normal(size=(3, 12)), configs, progress=False)
    assert [label(r) for r in rows] == ["lift(gamma=0.0) [bilinear]", "lift(gamma=0.0) [cosine]",
                                        "lift(gamma=0.5) [bilinear]", "lift(gamma=0.5) [cosine]"]
    assert all(0 <= r["map@r"] <= 1 for r in rows) and not any(is_trained_equivalent(r) for r in rows)


def test_new_strategy_reaches_the_app(lift_registered, tiny_index):
    from app.handlers import Handlers
    from app.service import RetrievalService, SearchConfig
    from app.ui import build_ui

    svc = RetrievalService(tiny_index)
    assert "lift" in svc.strategy_choices() and "lift" in svc.strategy_choices(with_files=False)
    q = svc.query_from_item(int(svc.data.items.ids[3]))
    assert svc.panel(q, SearchConfig("lift", {"gamma": 0.5}, "cosine"), k=3).title == "lift(gamma=0.5) · cosine"
    ok = Handlers(svc).on_search({"kind": "item", "id": int(svc.data.items.ids[3])}, None, 3,
                                 **panels(right=("lift", "bilinear"), right_params={"gamma": 0.75}))
    assert "Right: lift(gamma=0.75) · bilinear" in ok[2] and len(ok[3]) == 3

    demo = build_ui(svc)
    by_label = {b.label: b for b in demo.blocks.values() if getattr(b, "label", None)}
    for side in ("Left", "Right"):
        assert "lift" in [v for _, v in by_label[f"{side} strategy"].choices]
    assert "lift" in [v for _, v in by_label["strategy"].choices]  # the hidden API's dropdown
    sliders = [b for b in demo.blocks.values()
               if getattr(b, "label", None) == "gamma: weight γ of the added identity (lift; default: 0.25)"]
    assert len(sliders) == 2  # one per panel, hidden until a panel chooses lift
    assert all((s.minimum, s.maximum, s.value, s.visible) == (0.0, 2.0, 0.25, False) for s in sliders)
    api = demo.get_api_info()["named_endpoints"]["/search"]["parameters"]
    assert [p["parameter_name"] for p in api][-2:] == ["rerank_params", "gamma"]  # a new one comes last


def test_unregistering_removes_it_again(capsys):
    helptext = cli(capsys, "search", "--help")
    assert "lift" not in helptext and "--gamma" not in helptext
