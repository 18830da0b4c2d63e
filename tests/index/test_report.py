"""`python -m index report`: one self-contained HTML page that parses, with the expected rows."""
from html.parser import HTMLParser

from support import run_module

from index.analysis.compare import Comparer
from index.backends.store import read_index


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
    r = run_module("index", "report", "--index", tiny_index, "--strategy", "random", "--r", "0.5", "--seed", "0",
                   "--mode", "bilinear", "--top", "2", "--k", "3", "--out", out, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    page = Page()
    page.feed(out.read_text())
    page.close()
    counts = Comparer(read_index(tiny_index)).compare("random", {"r": 0.5, "seed": 0}, "bilinear",
                                                      left_mode="bilinear").counts()
    assert counts["improved"] >= 1 and counts["worsened"] >= 1
    assert page.rows.get("query improved", 0) == min(2, counts["improved"])
    assert page.rows.get("query worsened", 0) == min(2, counts["worsened"])
    shown = page.rows["query improved"] + page.rows["query worsened"]
    # the scatter, then per query row its thumbnail and 3 results under each metric
    assert page.imgs == 1 + shown * (1 + 2 * 3)
    assert page.links and all(v.startswith("data:image/png;base64,") for v in page.links)  # self-contained
    assert f"{counts['queries']:,} queries: {counts['improved']:,} improved" in out.read_text()


def test_report_refuses_a_missing_analysis_folder(tiny_index, tmp_path):
    r = run_module("index", "report", "--index", tiny_index, "--strategy", "identity", "--analysis",
                   tmp_path / "nope", "--out", tmp_path / "r.html", cwd=tmp_path)
    assert (
        r.returncode == 2 and r.stderr.startswith("error: --analysis folder not found") and "Traceback" not in r.stderr
    )
    assert not (tmp_path / "r.html").exists()
