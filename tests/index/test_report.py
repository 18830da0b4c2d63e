"""`python -m index report`: one self-contained HTML page that parses, with the expected rows."""
from html.parser import HTMLParser

import pytest
from support import run_command

from core.cli import run_cli
from index.analysis.compare import Comparer
from index.backends.store import read_index
from index.cli import main
from index.search_config import SearchConfig


class Page(HTMLParser):
    """Counts table rows by class, and collects every src/href (nothing may be linked)."""

    def __init__(self):
        super().__init__()
        self.rows, self.links, self.imgs = {}, [], 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "tr" and a.get("class"):
            self.rows[a["class"]] = self.rows.get(a["class"], 0) + 1
        if tag == "img":
            self.imgs += 1
        self.links += [v for k, v in attrs if k in ("src", "href")]


def test_report_html(tiny_index, tmp_path):
    out = tmp_path / "report.html"
    r = run_command("index", "report", "--index", tiny_index, "--strategy", "random", "--r", "0.5", "--seed", "0",
                    "--mode", "bilinear", "--top", "2", "--k", "3", "--out", out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    page = Page()
    page.feed(out.read_text())
    page.close()
    # no left flags: trained, in the right side's mode (as reports without them always compared)
    right = SearchConfig("random", {"r": 0.5, "seed": 0}, "bilinear")
    counts = Comparer(read_index(tiny_index)).compare(SearchConfig("trained", {}, "bilinear"), right).counts()
    assert counts["improved"] >= 1 and counts["worsened"] >= 1
    assert page.rows.get("query improved", 0) == min(2, counts["improved"])
    assert page.rows.get("query worsened", 0) == min(2, counts["worsened"])
    shown = page.rows["query improved"] + page.rows["query worsened"]
    # the scatter, then per query row its thumbnail and 3 results under each metric
    assert page.imgs == 1 + shown * (1 + 2 * 3)
    assert page.links and all(v.startswith("data:image/png;base64,") for v in page.links)  # self-contained
    assert f"{counts['queries']:,} queries: {counts['improved']:,} improved" in out.read_text()


def test_report_refuses_a_missing_analysis_folder(tiny_index, tmp_path):
    r = run_command("index", "report", "--index", tiny_index, "--strategy", "identity", "--analysis",
                    tmp_path / "nope", "--out", tmp_path / "r.html", cwd=tmp_path)
    assert (
        r.returncode == 2 and r.stderr.startswith("error: --analysis folder not found") and "Traceback" not in r.stderr
    )
    assert not (tmp_path / "r.html").exists()


def test_report_of_two_configurations(tiny_index, tmp_path):
    """--left-*: any configuration on the left; the page names both, and its counts are the comparer's."""
    out = tmp_path / "two.html"
    r = run_command("index", "report", "--index", tiny_index, "--left-strategy", "identity", "--left-mode", "cosine",
                    "--strategy", "random", "--r", "0.5", "--mode", "bilinear", "--top", "2", "--k", "3", "--out", out,
                    cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    cmp = Comparer(read_index(tiny_index)).compare(SearchConfig("identity", {}, "cosine"),
                                                   SearchConfig("random", {"r": 0.5, "seed": 0}, "bilinear"), k=3)
    c = cmp.counts()
    assert "<h1>identity · cosine vs random(r=0.5, seed=0) · bilinear</h1>" in text
    assert f"{c['queries']:,} queries: {c['improved']:,} improved, {c['worsened']:,} worsened" in text
    assert "Jaccard@3" in text and f"mean top-3 overlap (Jaccard@3) {cmp.summary()['mean_jaccard']:.3f}" in text
    page = Page()
    page.feed(text)
    assert page.rows.get("query improved", 0) == min(2, c["improved"])


@pytest.mark.parametrize("flags, message", [
    (["--left-strategy", "nope"], "error: --left-strategy: unknown refinement strategy 'nope'; choose from"),
    (["--left-strategy", "identity", "--left-param", "r=0.5"], "error: --left-param: refinement strategy "
                                                               "'identity': no parameter 'r'"),
    (["--left-strategy", "random", "--left-param", "r"], "error: --left-param: refinement strategy 'random': "
                                                         "want key=value, got 'r'"),
    (["--left-strategy", "random", "--left-param", "r=2"], "error: --left-param: refinement strategy 'random': "
                                                           "r must be in [0, 1], got 2.0"),
    (["--left-mode", "l3"], "error: --left-mode must be one of bilinear, cosine, got 'l3'"),
])
def test_report_refuses_a_bad_left_side(tiny_index, tmp_path, capsys, flags, message):
    out = tmp_path / "r.html"
    assert run_cli(main, ["report", "--index", str(tiny_index), "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1  # one line
    assert not out.exists()


def test_report_with_a_reranker(tiny_index, tmp_path, capsys, monkeypatch):
    """--rerank/--rerank-param: the right side re-ranks every query (its own item left out); the
    page names the re-ranker, its counts are the comparer's, its result strips the re-ranked lists."""
    import html
    import re

    import numpy as np

    from index.backends.search import Searcher

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    out = tmp_path / "rr.html"
    assert run_cli(main, ["report", "--index", str(tiny_index), "--strategy", "identity", "--rerank", "aqe",
                          "--rerank-param", "n=3", "--left-rerank", "none", "--top", "2", "--k", "3",
                          "--out", str(out)]) == 0
    text = out.read_text()
    data = read_index(tiny_index)
    left, right = SearchConfig("trained", {}, "cosine"), SearchConfig.of("identity", {}, "cosine", "aqe", {"n": 3})
    cmp = Comparer(data).compare(left, right, k=3)
    c = cmp.counts()
    assert "<h1>trained · cosine vs identity · cosine · aqe(n=3, alpha=3.0)</h1>" in text
    assert f"{c['queries']:,} queries: {c['improved']:,} improved, {c['worsened']:,} worsened" in text
    assert c["improved"] + c["worsened"] > 0
    which = "improved" if c["improved"] else "worsened"
    first = cmp.disagreements(which, 1)[0]
    row = int(np.nonzero(data.items.ids == first["id"])[0][0])
    want = right.search(Searcher(data), np.asarray(data.features[row: row + 1]), 3, self_ids=[row])
    cell = text.split(f'<tr class="query {which}">', 1)[1].split("</tr>", 1)[0]
    shown = [int(i) for i in re.findall(r" · id (\d+) · ", cell.split(html.escape(cmp.label_b) + "<br>", 1)[1])]
    assert shown == data.items.ids[want.rows[0]].tolist() and first["id"] not in shown


@pytest.mark.parametrize("flags, message", [
    (["--rerank", "nope"], "error: --rerank: unknown re-ranker 'nope'; choose from aqe, dba, diffusion"),
    (["--left-rerank", "nope"], "error: --left-rerank: unknown re-ranker 'nope'; choose from"),
    (["--rerank", "aqe", "--rerank-param", "x=1"], "error: --rerank-param: re-ranker 'aqe': no parameter 'x'; "
                                                   "valid: ['n', 'alpha']"),
    (["--rerank", "aqe", "--rerank-param", "n"], "error: --rerank-param: re-ranker 'aqe': want key=value, got 'n'"),
    (["--rerank", "aqe", "--rerank-param", "n=0"], "error: --rerank-param: re-ranker 'aqe': n must be ≥ 1, got 0"),
    (["--rerank-param", "n=2"], "error: --rerank-param: re-ranker 'none': no parameter 'n'"),
    (["--left-rerank", "dba", "--left-rerank-param", "alpha=x"], "error: --left-rerank-param: re-ranker 'dba': "
                                                                 "alpha: 'x' is not a number"),
])
def test_report_refuses_a_bad_reranker(tiny_index, tmp_path, capsys, flags, message):
    out = tmp_path / "r.html"
    assert run_cli(main, ["report", "--index", str(tiny_index), "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1  # one line
    assert not out.exists()


def test_report_help_shows_each_reranker_flag_with_its_default(capsys):
    from index.cli import build_parser

    report = build_parser()._subparsers._group_actions[0].choices["report"]
    helps = {a.dest: a.help for a in report._actions}
    for dest in ("rerank", "rerank_param", "left_rerank", "left_rerank_param"):
        assert "(default: " in helps[dest], dest
    with pytest.raises(SystemExit):
        main(["report", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: none)" in text.split("--rerank NAME")[-1] and "pool=auto" in text and "1000000001" not in text
