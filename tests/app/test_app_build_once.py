"""Compare clicked twice runs once, two different comparisons run at once, and what the user
sees of a tiny p-value and of an export that does not exist yet."""
import argparse
import threading

import numpy as np
import pytest
from support import panels

from app.handlers import Handlers
from app.sampled import GalleryComparer, without_own_rows
from app.service import RetrievalService
from core.flags import add_shared_args
from index.analysis.compare import Comparer, Comparison
from index.search_config import SearchConfig
from index.space import CACHE


def twice_at_once(call) -> list:
    """`call()` from two threads released together; their results."""
    start, out = threading.Barrier(2), [None, None]

    def run(i):
        start.wait()
        out[i] = call()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_compare_clicked_twice_at_once_runs_the_comparison_once(svc, monkeypatch):
    CACHE.clear()  # what earlier tests compared
    runs = []
    compute = Comparer._compute

    def counted(self, rm, strategy, params, mode):
        runs.append((strategy, mode))
        threading.Event().wait(0.2)  # long enough for the second click to arrive while it runs
        return compute(self, rm, strategy, params, mode)

    monkeypatch.setattr(Comparer, "_compute", counted)
    h = Handlers(svc)
    cfg = panels(right=("identity", "cosine"))
    first, second = twice_at_once(lambda: h.on_compare(None, "all", 6, "outcome", 1.0, progress=None, **cfg))
    assert sorted(runs) == [("identity", "cosine"), ("trained", "cosine")]  # each side once
    assert first[0] == second[0] and first[0].startswith("**trained · cosine** (x) vs **identity · cosine**")
    h.on_compare(None, "all", 6, "outcome", 1.0, progress=None, **cfg)  # a third click: nothing to run
    assert len(runs) == 2


def test_a_sampled_compare_clicked_twice_at_once_searches_each_side_once(tiny_index, monkeypatch):
    CACHE.clear()
    s = RetrievalService(tiny_index, compare_all_up_to=5, compare_sample=10)
    assert s.sampled()
    runs = []
    side = GalleryComparer._side

    def counted(self, cfg, rows, progress):
        runs.append(cfg.strategy)
        threading.Event().wait(0.2)
        return side(self, cfg, rows, progress)

    monkeypatch.setattr(GalleryComparer, "_side", counted)
    right = SearchConfig("identity", {}, "cosine")
    a, b = twice_at_once(lambda: s.comparison(right, seed=3))
    assert sorted(runs) == ["identity", "trained"]
    np.testing.assert_array_equal(a.ap_b, b.ap_b)
    assert len(a.ids) == 10 and a.population > 10
    s.comparison(right, seed=4)  # another sample: searched again
    assert len(runs) == 4


def test_two_different_comparisons_run_at_the_same_time(svc, monkeypatch):
    """Each build waits at a barrier for the other: were one comparison to hold a lock over its
    whole pass, the second could not start and the barrier would break."""
    CACHE.clear()
    svc.comparer.per_query_ap("trained", {}, "cosine")  # the shared left side, before the barrier
    both = threading.Barrier(2, timeout=20)
    compute = Comparer._compute

    def meet(self, rm, strategy, params, mode):
        both.wait()
        return compute(self, rm, strategy, params, mode)

    monkeypatch.setattr(Comparer, "_compute", meet)
    results: dict = {}

    def run(strategy):
        results[strategy] = svc.comparison(SearchConfig(strategy, {}, "cosine"))

    threads = [threading.Thread(target=run, args=(n,)) for n in ("identity", "shrink")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not both.broken and set(results) == {"identity", "shrink"}
    assert all(c.label_b.startswith(n) for n, c in results.items())
    assert all(svc.comparer.holds(SearchConfig(n, {}, "cosine")) for n in ("identity", "shrink"))


@pytest.mark.parametrize("improved, shown", [(1100, "p < 10⁻³⁰⁰"),  # 2·2⁻¹¹⁰⁰ underflows to 0
                                             (1000, "p < 10⁻³⁰⁰"),  # 2·2⁻¹⁰⁰⁰ ≈ 1.9e-301: below the floor
                                             (9, "p = 0.00391")])   # 2·2⁻⁹
def test_a_tiny_sign_test_p_value_is_shown_as_a_bound(improved, shown):
    n = improved
    cmp = Comparison("a", "b", np.arange(n), np.zeros(n, np.int64), np.zeros(n), np.full(n, 0.5))
    assert cmp.summary_text().endswith(f"two-sided sign test {shown}")


def test_the_export_box_is_hidden_until_there_is_an_export(svc):
    from app.ui import build_ui

    demo = build_ui(svc)
    (box,) = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == "exported"]
    assert box.visible is False
    conf = [c for c in demo.config["components"] if c.get("props", {}).get("elem_id") == "exported"]
    assert len(conf) == 1 and conf[0]["props"]["visible"] is False
    h = Handlers(svc)
    item = {"kind": "item", "id": int(svc.data.items.ids[2])}
    shown = h.on_export(item, None, 4, **panels())
    assert shown["visible"] is True and [str(f).rsplit(".", 1)[1] for f in shown["value"]] == ["json", "csv"]
    nothing = h.on_export(None, None, 4, **panels())  # no query: a warning, and the box hidden again
    assert nothing == {"__type__": "update", "value": None, "visible": False}


def test_the_app_takes_the_one_memory_budget_as_the_index_commands_do(capsys):
    from app.cli import build_parser

    p = build_parser()
    flag = next(a for a in p._actions if "--cache-memory" in a.option_strings)
    ref = argparse.ArgumentParser()
    add_shared_args(ref, "cache_memory")
    want = next(a for a in ref._actions if "--cache-memory" in a.option_strings)
    assert (flag.help, flag.default) == (want.help, want.default)
    assert p.parse_args(["--cache-memory", "512M"]).cache_memory == 512 << 20
    helptext = " ".join(p.format_help().split())
    assert "--cache-memory SIZE" in helptext and "(default: $DML_CACHE_MEMORY, else 4G)" in helptext
    assert "--cache-mb" not in helptext
    with pytest.raises(SystemExit):
        p.parse_args(["--cache-mb", "256"])
    assert "unrecognized arguments: --cache-mb" in capsys.readouterr().err


def test_each_query_list_loses_its_own_row_and_is_cut_to_depth():
    found = np.array([[3, 0, 5, -1], [1, 2, 4, 6]])
    np.testing.assert_array_equal(without_own_rows(found, np.array([0, 4]), 2), [[3, 5], [1, 2]])
    np.testing.assert_array_equal(without_own_rows(found, np.array([9, 1]), 4), [[3, 0, 5, -1], [2, 4, 6, -1]])
