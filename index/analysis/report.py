"""`python -m index report`: one self-contained HTML page comparing two configurations (the
trained metric and a refined one, by default) over every query of an index (figures and
thumbnails inlined as base64 PNGs).

Contents: the strategy table and curves of `python -m index evaluate` (given its folder), the
per-query AP scatter, the queries that improved and worsened most from left to right, each
with its results under both configurations and the overlap of their top k (Jaccard@k), and the
per-class table.  Either configuration may have a re-ranker: every query is then re-ranked
with its own item left out (index/analysis/compare.py), and its results are the re-ranked ones.
"""
from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from core.atomic import write_text
from core.errors import UserError

from ..backends.search import Searcher
from ..backends.store import IndexData
from ..search_config import SearchConfig
from .compare import Comparer, Comparison, Progress, item_image

CSS = """body{font-family:system-ui,sans-serif;margin:24px;max-width:1300px;color:#222}
table{border-collapse:collapse;margin:8px 0 20px}td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px}
th{background:#f3f3f3}td.num{text-align:right}.res img{border:3px solid transparent;margin:1px}
.res img.hit{border-color:#2ca02c}.res img.miss{border-color:#d62728}.up{color:#1a7f1a}.down{color:#c62828}
figure{display:inline-block;margin:6px}figcaption{font-size:13px;color:#555}"""


def _png(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _fig_png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Thumbs:
    """Inline thumbnails of index items, each encoded once per report: `build_report` makes one
    and drops it with the page, so what it holds (the items the page shows, a few kB each) lives
    for that one report, outside the process's memory cache."""

    def __init__(self, data: IndexData, size: int = 64):
        self.data, self.size = data, size
        self._uris: dict[int, str] = {}  # item id → its thumbnail's data URI
        self._row = {int(i): r for r, i in enumerate(data.items.ids)}

    def __call__(self, item_id: int) -> str:
        if item_id not in self._uris:
            img = item_image(self.data, self._row[item_id])
            if img is None:
                img = Image.new("RGB", (self.size, self.size), (230, 230, 230))
                ImageDraw.Draw(img).text((4, self.size // 2 - 6), f"id {item_id}", fill=(90, 90, 90))
            img = img.copy()
            img.thumbnail((self.size, self.size))
            self._uris[item_id] = _png(img)
        return self._uris[item_id]


def scatter_png(cmp: Comparison) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    o = cmp.outcome()
    fig, ax = plt.subplots(figsize=(5.2, 5))
    for v, colour, name in ((0, "#9a9a9a", "tied"), (1, "#2ca02c", "improved"), (-1, "#d62728", "worsened")):
        m = o == v
        ax.scatter(cmp.ap_a[m], cmp.ap_b[m], s=6, c=colour, alpha=0.6, linewidths=0, label=f"{name} ({m.sum():,})")
    ax.plot([0, 1], [0, 1], "k--", lw=1)
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel=f"AP, {cmp.label_a}", ylabel=f"AP, {cmp.label_b}")
    ax.set_title("per-query AP (MAP@R)", fontsize=11)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    return _fig_png(fig)


def neighbours(searcher: Searcher, ids: list[int], cfg: SearchConfig, k: int) -> list[list]:
    """Each item query's top k under `cfg` (its mode as given, its re-ranker run; its own item left
    out, of its re-ranking too), through `SearchConfig.search`: [(id, label, score)]."""
    if not ids:
        return []
    data = searcher.data
    row = {int(i): r for r, i in enumerate(data.items.ids)}
    rows = np.array([row[i] for i in ids], dtype=np.int64)
    res = cfg.search(searcher, np.asarray(data.features[rows]), k, self_ids=rows)
    return [[(int(data.items.ids[r]), int(data.items.labels[r]), float(s)) for r, s in zip(rs, ss, strict=True)
             if r >= 0] for rs, ss in zip(res.rows, res.scores, strict=True)]


def _table(header: list[str], rows: list[list], cls: str = "") -> str:
    """Cells given as '<td…' are used as they are, anything else is escaped text."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    attr = f' class="{cls}"' if cls else ""
    body = "".join(f"<tr{attr}>" + "".join(c if str(c).startswith("<td") else f"<td>{html.escape(str(c))}</td>"
                                           for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _num(v: float, signed: bool = False) -> str:
    cls = "" if not signed or v == 0 else (" up" if v > 0 else " down")
    return f'<td class="num{cls}">{v:+.4f}</td>' if signed else f'<td class="num">{v:.4f}</td>'


def analysis_section(folder: Path | None) -> str:
    """The strategy table and curves written by `python -m index evaluate`, if given."""
    if folder is None:
        return ("<p><em>No strategy evaluation given: run <code>python -m index evaluate</code> and pass its "
                "folder with <code>--analysis</code>.</em></p>")
    sj = folder / "strategies.json"
    if not sj.is_file():
        raise UserError(f"--analysis {folder}: no strategies.json there (the folder `python -m index evaluate` writes)")
    res = json.loads(sj.read_text())
    rows = [[t["row"], t["choice"], *(f'<td class="num">{t[m] * 100:.2f}</td>'
                                      for m in ("map@r", "precision@1", "r_precision", "recall@4"))]
            for t in res.get("table", [])]
    out = _table(["metric matrix", "choice", "MAP@R", "P@1", "RP", "R@4"], rows)
    for name, caption in (("restraint_sweep.png", "accuracy vs restraint degree"),
                          ("principles.png", "accuracy vs principle ratios")):
        p = folder / name
        if p.is_file():
            out += (f'<figure><figcaption>{caption}</figcaption><img src="data:image/png;base64,'
                    f'{base64.b64encode(p.read_bytes()).decode()}" style="max-width:100%"></figure>')
    return out


def query_rows(cmp: Comparison, rows: list[dict], res_a: list, res_b: list, thumbs: Thumbs, cls: str) -> str:
    """One table row per query: the query, its APs, and its results under both metrics."""
    def strip(results, label):
        return "".join(f'<img class="{"hit" if lab == label else "miss"}" src="{thumbs(i)}" '
                       f'title="{html.escape(cmp.class_name(lab))} · id {i} · {s:.3f}" width="48">'
                       for i, lab, s in results)
    out = []
    for r, a, b in zip(rows, res_a, res_b, strict=True):
        q = (f'<td><img src="{thumbs(r["id"])}" width="64"><br>{html.escape(r["class_name"])}<br>'
             f'<small>id {r["id"]}</small></td>')
        out.append([q, _num(r["ap_a"]), _num(r["ap_b"]), _num(r["delta"], signed=True), _num(r["jaccard"]),
                    f'<td class="res">{html.escape(cmp.label_a)}<br>{strip(a, r["label"])}<br>'
                    f'{html.escape(cmp.label_b)}<br>{strip(b, r["label"])}</td>'])
    return _table(["query", "AP left", "AP right", "ΔAP", f"Jaccard@{cmp.k}", "results (green: same class)"],
                  out, cls)


def build_report(data: IndexData, left: SearchConfig, right: SearchConfig, top: int = 20, k: int = 8,
                 analysis: Path | None = None, seed: int = 0, progress: Progress | None = None) -> str:
    """The report's HTML (one string, nothing linked): `left` (x) against `right` (y), each with
    its re-ranker where it has one.  `progress`: the comparer's, while a re-ranked side is computed.
    The comparison is kept in the process's memory cache (`Comparer`): a second report of the
    same configurations in one process reuses it."""
    comparer = Comparer(data)
    cmp = comparer.compare(left, right, seed=seed, k=k, progress=progress)
    sides = [c.normalized().with_mode(comparer.resolve(c.strategy, c.params, c.mode)) for c in (left, right)]
    thumbs = Thumbs(data)
    title = f"{cmp.label_a} vs {cmp.label_b}"
    parts = [f"<h1>{html.escape(title)}</h1>",
             f"<p>Index <code>{html.escape(str(data.path))}</code>: {len(data.items):,} items of "
             f"{len(np.unique(data.items.labels)):,} classes; every item is a query against the rest "
             "(leave-one-out), scored by MAP@R. Left (x): <b>" + html.escape(cmp.label_a) + "</b>; right (y): <b>"
             + html.escape(cmp.label_b) + f"</b>. Jaccard@{cmp.k}: how much the two top-{cmp.k} lists of a query "
             "overlap (1: the same items).</p>",
             f"<p><b>{html.escape(cmp.summary_text())}</b></p>",
             "<h2>Strategy table</h2>", analysis_section(analysis),
             "<h2>Per-query AP</h2>", f'<img src="{scatter_png(cmp)}" alt="AP scatter">']
    for which, cls, title in (("improved", "query improved", "improved"), ("worsened", "query worsened", "worsened")):
        rows = cmp.disagreements(which, top)
        ids = [r["id"] for r in rows]
        parts += [f"<h2>Top {len(rows)} {title} queries (of {cmp.counts()[which]:,})</h2>",
                  query_rows(cmp, rows, neighbours(comparer.searcher, ids, sides[0], k),
                             neighbours(comparer.searcher, ids, sides[1], k), thumbs, cls)]
    per_class = sorted(cmp.per_class(), key=lambda r: r["delta"])
    parts += ["<h2>Per class (by Δ)</h2>",
              _table(["class", "label", "n", "AP left", "AP right", "Δ", f"mean Jaccard@{cmp.k}"],
                     [[r["class_name"], r["label"], r["n"], _num(r["ap_a"]), _num(r["ap_b"]), _num(r["delta"], True),
                       _num(r["jaccard"])] for r in per_class])]
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Compare: {html.escape(title)}"
            f"</title><style>{CSS}</style></head><body>{''.join(parts)}</body></html>")


def write_report(data: IndexData, out, left: SearchConfig, right: SearchConfig, **kw) -> Path:
    out = Path(out)
    write_text(out, build_report(data, left, right, **kw))
    return out
