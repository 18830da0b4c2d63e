"""Re-rankers from the index CLI: `search --rerank`, `list`, `evaluate --rerankers` (the strategy ×
re-ranker matrix), refusals, and a new re-ranker reaching all of them from one registration."""
import json
from dataclasses import dataclass

import numpy as np
import pytest
from support import run_command

from core.errors import UserError
from evaluation.evaluator import per_query_metrics
from index.analysis.rerank_eval import rerank_matrix, rerank_split
from index.backends.search import Searcher
from index.backends.store import in_memory_index, read_index
from index.cli import build_parser, main
from index.rerankers import AUTO, RERANKERS, WHOLE_GALLERY
from index.search_config import SearchConfig


def run_json(args, tmp_path, name="out.json") -> dict:
    out = tmp_path / name
    assert main([*args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_search_with_a_reranker_is_the_configuration_search(tiny_index, tmp_path):
    data = read_index(tiny_index)
    q = np.asarray(data.features[:3], dtype=np.float32)
    np.save(tmp_path / "q.npy", q)
    got = run_json(["search", "--index", str(tiny_index), "--features", str(tmp_path / "q.npy"), "--k", "4",
                    "--strategy", "identity", "--rerank", "aqe", "--rerank-param", "n=3,alpha=1"], tmp_path)
    assert got["rerank"] == "aqe" and got["rerank_params"]["n"] == 3 and got["rerank_params"]["alpha"] == 1.0
    want = SearchConfig.of("identity", {}, "cosine", "aqe", {"n": 3, "alpha": 1}).search(Searcher(data), q, 4)
    assert [[r["id"] for r in g["results"]] for g in got["queries"]] == [
        [int(data.items.ids[r]) for r in row] for row in want.rows]


def test_search_without_a_reranker_is_unchanged(tiny_index, tmp_path):
    data = read_index(tiny_index)
    np.save(tmp_path / "q.npy", np.asarray(data.features[:2], dtype=np.float32))
    base = ["search", "--index", str(tiny_index), "--features", str(tmp_path / "q.npy"), "--k", "5"]
    plain = run_json(base, tmp_path, "a.json")
    none = run_json([*base, "--rerank", "none"], tmp_path, "b.json")
    assert plain == none and plain["rerank"] == "none" and plain["rerank_params"] == {}


@pytest.mark.parametrize("bad, message", [
    (["--rerank", "aqe", "--rerank-param", "k1=3"], "re-ranker 'aqe'"),
    (["--rerank", "aqe", "--rerank-param", "n"], "KEY=VALUE"),
])
def test_bad_rerank_settings_are_refused_before_the_index_is_read(tmp_path, bad, message):
    with pytest.raises(UserError, match=message):
        main(["search", "--index", str(tmp_path / "missing"), "--features", str(tmp_path / "q.npy"), *bad])


def test_bad_rerank_settings_are_one_line_errors_with_exit_2(tiny_index, tmp_path):
    r = run_command("index", "search", "--index", tiny_index, "--features", tmp_path / "q.npy",
                    "--rerank", "bogus", cwd=tmp_path)
    assert r.returncode == 2 and "unknown re-ranker 'bogus'" in r.stderr and "Traceback" not in r.stderr
    r = run_command("index", "search", "--index", tiny_index, "--features", tmp_path / "q.npy",
                    "--rerank", "kreciprocal", "--rerank-param", "k1=many", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1


def test_list_names_every_reranker_with_its_parameters(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "re-rankers:" in out
    for e in RERANKERS.entries():
        assert e.name in out
        for k in e.param_defaults():
            assert f"{k} = " in out
    assert "k1 ∈ {4, 6, 10, 20, 30}, k2 ∈ {1, 3, 6}, lambda_value ∈ {0.1, 0.3, 0.5}" in out  # the grids too
    # a whole-gallery size reads "all", a size-dependent one "auto", and both are taken as input
    assert "pool = auto  " in out and "truncation = auto  " in out
    assert "pool = auto: every item, and the plain search's top 1,000 on a gallery read by row" in out
    assert str(WHOLE_GALLERY) not in out and str(AUTO) not in out
    assert "truncation = auto: every item up to 500,000 items, the plain search's top 10,000 above" in out
    assert "truncation=auto," in SearchConfig.of("trained", {}, "cosine", "diffusion").label()
    assert SearchConfig.of("trained", {}, "cosine", "diffusion", {"truncation": "auto"}).rerank_params[
        "truncation"] == AUTO
    label = SearchConfig.of("trained", {}, "cosine", "kreciprocal", {"pool": "all"}).label()
    assert label.endswith("pool=all, sets=auto)")
    assert SearchConfig.of("trained", {}, "cosine", "diffusion", {"truncation": "ALL"}).rerank_params["truncation"] \
        == WHOLE_GALLERY


def _direct_map_at_r(searcher, cfg, labels):
    """MAP@R of every query with a relevant item, each query re-ranked alone with itself left out."""
    X = np.asarray(searcher.data.features, dtype=np.float32)
    _, inv, counts = np.unique(labels, return_inverse=True, return_counts=True)
    R = counts[inv] - 1
    aps = []
    for i in np.flatnonzero(R > 0):
        h = cfg.search(searcher, X[i: i + 1], int(max(R.max(), 8)), self_ids=np.array([i]))
        row = h.rows[0]
        assert i not in row  # the query never ranks itself
        m = per_query_metrics(labels[row][None, :], labels[i: i + 1], R[i: i + 1])
        aps.append(m["map@r"][0])
    return float(np.mean(aps))


def test_matrix_cells_equal_a_direct_per_query_computation():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((90, 12)).astype(np.float32)
    y = np.repeat(np.arange(15), 6)
    X += 1.5 * rng.standard_normal((15, 12)).astype(np.float32)[y]
    W = rng.standard_normal((6, 12)).astype(np.float32)
    s = Searcher(in_memory_index(X, y, W, True))
    for name in ("none", "aqe", "kreciprocal"):
        cfg = SearchConfig.of("identity", {}, "cosine", name, {"k1": 5, "k2": 2} if name == "kreciprocal" else {})
        assert rerank_split(s, cfg, y)["map@r"] == pytest.approx(_direct_map_at_r(s, cfg, y), abs=1e-9)
    none_row = rerank_matrix({"test": (X, y)}, W, [SearchConfig.of("identity", {}, "cosine")], ("aqe",),
                             progress=False)["test"]
    assert [r["rerank"] for r in none_row] == ["none", "aqe"]


def test_evaluate_writes_the_strategy_by_reranker_matrix(tiny_run, tmp_path, capsys):
    ck = str(tiny_run[0].out) + "/best.pt"
    assert main(["evaluate", "--checkpoint", ck, "--out", str(tmp_path / "e"), "--no-progress",
                 "--cache-dir", str(tmp_path / "c"), "--strategies", "trained,identity",
                 "--rerankers", "none,aqe,dba"]) == 0
    res = json.loads((tmp_path / "e" / "strategies.json").read_text())
    m = res["rerank"]
    assert m["rerankers"] == ["none", "aqe", "dba"]
    assert {r["setting"] for r in m["rows"]} >= {"trained [cosine]", "identity [cosine]"}
    for row in m["rows"]:
        assert row["cells"]["none"]["delta_map@r"] == 0
        for n in ("aqe", "dba"):
            c = row["cells"][n]
            assert c["delta_map@r"] == pytest.approx(c["map@r"] - row["cells"]["none"]["map@r"])
    # the none column equals the strategy sweep's own number for the same setting
    trained = next(r for r in res["test"] if r["strategy"] == "trained" and r["mode"] == "cosine")
    cell = next(r for r in m["rows"] if r["setting"] == "trained [cosine]")["cells"]["none"]
    assert cell["map@r"] == pytest.approx(trained["map@r"], abs=1e-9)
    assert m["selected"]["rerank"] in ("none", "aqe", "dba")
    # each re-ranker's parameters chosen on validation from its (coarse, the default --grid) grid
    from index.analysis.rerank_eval import reranker_grid

    for row in m["rows"]:
        for n in ("aqe", "dba"):
            assert row["cells"][n]["chosen"] in reranker_grid(n, "coarse")
    text = (tmp_path / "e" / "rerank.md").read_text()
    assert "| setting |" in text and "Parameters chosen on validation" in text
    with pytest.raises(SystemExit) as e:
        main(["evaluate", "--checkpoint", ck, "--out", str(tmp_path / "z"), "--rerankers", "none,nope"])
    assert e.value.code == 2 and not (tmp_path / "z").exists()


@dataclass
class EchoParams:
    depth: int = 5


def test_a_new_reranker_is_one_registration_away_from_the_cli_and_the_sweep(tiny_index, tmp_path, capsys):
    @RERANKERS.register("echo_first", EchoParams, doc="the first search, unchanged (a test's re-ranker)",
                        depth="depth")
    def echo_first(space, queries, first, k, *, self_ids, params):
        from index.rerankers import candidates

        rows, scores = candidates(first, self_ids, k)
        return space.hits(rows, scores)

    try:
        search = next(a for a in build_parser()._actions if a.dest == "command").choices["search"]
        assert "echo_first" in search.format_help()
        assert main(["list"]) == 0 and "echo_first" in capsys.readouterr().out
        data = read_index(tiny_index)
        np.save(tmp_path / "q.npy", np.asarray(data.features[:2], dtype=np.float32))
        got = run_json(["search", "--index", str(tiny_index), "--features", str(tmp_path / "q.npy"), "--k", "3",
                        "--rerank", "echo_first", "--rerank-param", "depth=4"], tmp_path)
        plain = run_json(["search", "--index", str(tiny_index), "--features", str(tmp_path / "q.npy"), "--k", "3"],
                         tmp_path, "plain.json")
        assert got["rerank"] == "echo_first" and got["queries"] == plain["queries"]
        rows = rerank_matrix({"test": (np.asarray(data.features), data.items.labels)}, data.W,
                             [SearchConfig.of("trained", {}, "cosine")], ("echo_first",), progress=False)["test"]
        assert rows[1]["rerank"] == "echo_first" and rows[1]["map@r"] == pytest.approx(rows[0]["map@r"])
    finally:
        RERANKERS.unregister("echo_first")
    assert "echo_first" not in RERANKERS


@dataclass
class ShuffleParams:
    keep: int = 0  # 1: the plain search's ranking; 0: its top k reversed


def _shuffle_reranker():
    @RERANKERS.register("keep_or_reverse", ShuffleParams, doc="a test's re-ranker with a grid", depth="keep",
                        grid={"keep": (0, 1)})
    def keep_or_reverse(space, queries, first, k, *, self_ids, params):
        from index.rerankers import candidates

        rows, scores = candidates(first, self_ids, k)
        return space.hits(rows, scores) if params.keep else space.hits(rows[:, ::-1], scores[:, ::-1])


def test_reranker_grids_are_every_combination_the_coarse_one_keeps_ends_and_defaults():
    from index.analysis.rerank_eval import reranker_grid

    full = reranker_grid("aqe")
    assert len(full) == len(RERANKERS.get("aqe").spec.grid["n"]) * len(RERANKERS.get("aqe").spec.grid["alpha"])
    assert {"n": 2, "alpha": 3.0} in full
    coarse = reranker_grid("aqe", "coarse")
    assert {p["n"] for p in coarse} == {1, 2, 3, 10} and {p["alpha"] for p in coarse} == {0.0, 3.0, 5.0}
    # combinations the re-ranker refuses (k2 > k1 + 1) are not tried
    kr = reranker_grid("kreciprocal")
    assert kr and all(p["k2"] <= p["k1"] + 1 for p in kr) and {"k1": 20, "k2": 6, "lambda_value": 0.3} in kr
    assert reranker_grid("none") == [{}]


def clustered(seed: int, classes: int, per_class: int, d: int, k: int, noise: float):
    """(features, labels, neck): `per_class` noisy copies of each of `classes` random centres."""
    rng = np.random.default_rng(seed)
    y = np.repeat(np.arange(classes), per_class)
    X = (rng.standard_normal((classes, d))[y] + noise * rng.standard_normal((len(y), d))).astype(np.float32)
    return X, y, rng.standard_normal((k, d)).astype(np.float32)


def test_evaluate_chooses_each_rerankers_parameters_on_validation(tmp_path):
    """A re-ranker whose grid holds a harmful and a harmless setting: validation picks the harmless
    one, test reports it, and the rows say what was tried."""
    X, y, W = clustered(1, classes=12, per_class=5, d=10, k=5, noise=0.6)
    _shuffle_reranker()
    try:
        cfg = SearchConfig.of("identity", {}, "cosine")
        mat = rerank_matrix({"test": (X, y), "val": (X[::-1].copy(), y[::-1].copy())}, W, [cfg],
                            ("keep_or_reverse",), progress=False)
        test = {r["rerank"]: r for r in mat["test"]}
        cell = test["keep_or_reverse"]
        assert cell["chosen"] == {"keep": 1} and cell["rerank_params"] == {"keep": 1}
        assert [t["rerank_params"] for t in cell["tried"]] == [{"keep": 0}, {"keep": 1}]
        assert cell["tried"][1]["map@r"] > cell["tried"][0]["map@r"]
        assert cell["map@r"] == pytest.approx(test["none"]["map@r"])  # keep=1 is the plain search
        s = Searcher(in_memory_index(X, y, W, True))
        bad = rerank_split(s, SearchConfig.of("identity", {}, "cosine", "keep_or_reverse", {"keep": 0}), y)
        assert bad["map@r"] < cell["map@r"]
        # without validation: the defaults (keep = 0), nothing tried
        alone = {r["rerank"]: r for r in rerank_matrix({"test": (X, y)}, W, [cfg], ("keep_or_reverse",),
                                                        progress=False)["test"]}
        assert alone["keep_or_reverse"]["rerank_params"] == {"keep": 0} and alone["keep_or_reverse"]["tried"] == []
        assert alone["keep_or_reverse"]["map@r"] == pytest.approx(bad["map@r"])
    finally:
        RERANKERS.unregister("keep_or_reverse")


def test_best_reranker_reports_the_validation_choice_on_test():
    from index.analysis.rerank_eval import best_reranker

    X, y, W = clustered(2, classes=10, per_class=6, d=8, k=4, noise=0.7)
    _shuffle_reranker()
    try:
        cfg = SearchConfig.of("identity", {}, "cosine")
        row = best_reranker((X, y), (X, y), W, cfg, ("keep_or_reverse",), val_queries=30)
        assert row["rerank"] == "keep_or_reverse" and row["rerank_params"] == {"keep": 1}
        assert row["test"]["map@r"] == pytest.approx(row["test_none"]["map@r"])
        assert row["val_map@r"]["keep_or_reverse"] == max(t["map@r"] for t in row["tried"]["keep_or_reverse"])
    finally:
        RERANKERS.unregister("keep_or_reverse")
