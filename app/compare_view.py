"""The Compare tab's pieces without Gradio: interactive SVG plots, 2-D maps of the gallery
under each configuration's metric, the shareable URL state of two configurations, and the
export files.

The plots are SVG (one <circle data-id> per query, a <title> tooltip each): Gradio's native
scatter plot selects an x-interval, not a point, and gr.Plot has no click event, so the app
puts these in a gr.HTML whose script turns a click on a point into an event.  The same SVG
goes into the static report.
"""
from __future__ import annotations

import csv
import html
import json
import tempfile
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import numpy as np

from core.arrays import l2_normalize
from core.errors import UserError
from index.backends.gallery import HIT_FIELDS
from index.refinements import MODES, REFINEMENTS, file_params
from index.rerankers import RERANKERS
from index.search_config import NO_RERANK, SearchConfig

MAP_METHODS = ("t-SNE", "PCA", "UMAP")
MAX_MAP_POINTS = 10_000
K_RANGE = (1, 48)  # the app's k slider
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7",
           "#dbdb8d", "#9edae5")  # tab20
OUTCOME_COLOURS = {1: "#2ca02c", -1: "#d62728", 0: "#9a9a9a"}


# ---------------------------------------------------------------- plots
def tick_label(v: float) -> str:
    """Readable tick text: 3 significant digits, plain notation (−0.0217, not −2.16746×10⁻²)."""
    return np.format_float_positional(float(v), precision=3, unique=True, fractional=False, trim="-")


def nice_ticks(lo: float, hi: float, n: int = 5) -> np.ndarray:
    from matplotlib.ticker import MaxNLocator

    t = np.asarray(MaxNLocator(n).tick_values(lo, hi), dtype=float)
    return t[(t >= lo - 1e-12) & (t <= hi + 1e-12)]


def svg_scatter(x, y, ids, colours, tips, *, title: str, x_label: str = "", y_label: str = "",
                lims: tuple | None = None, diagonal: bool = False, axes: bool = True, mark: int | None = None,
                note: str = "", width: int = 470, height: int = 430) -> str:
    """One SVG scatter: point i is a circle with data-id=ids[i] and tooltip tips[i]; `mark`: the
    index of a point drawn as a star (the current query); `note` goes under the title."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    L, R, T, B = (52 if axes else 10), 12, 44 if note else 30, (44 if axes else 10)
    if lims is None:
        def pad(a):
            return (float(a.min()), float(a.max())) if len(a) and a.max() > a.min() else (-1.0, 1.0)
        (x0, x1), (y0, y1) = pad(x), pad(y)
    else:
        x0, x1, y0, y1 = lims
    def px(v):
        return L + (np.asarray(v) - x0) / (x1 - x0) * (width - L - R)
    def py(v):
        return height - B - (np.asarray(v) - y0) / (y1 - y0) * (height - T - B)
    out = [f'<svg class="cmp-plot" viewBox="0 0 {width} {height}" width="100%" xmlns="http://www.w3.org/2000/svg" '
           'font-family="sans-serif">',
           f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="13" font-weight="bold">'
           f'{html.escape(title)}</text>']
    if note:
        out.append(f'<text x="{width / 2}" y="32" text-anchor="middle" font-size="11" fill="#555">'
                   f'{html.escape(note)}</text>')
    out.append(f'<rect x="{L}" y="{T}" width="{width - L - R}" height="{height - T - B}" fill="none" stroke="#bbb"/>')
    if axes:
        for t in nice_ticks(x0, x1):
            out.append(f'<text x="{px(t):.1f}" y="{height - B + 14}" text-anchor="middle" font-size="10">'
                       f'{tick_label(t)}</text>')
        for t in nice_ticks(y0, y1):
            out.append(f'<text x="{L - 4}" y="{py(t) + 3:.1f}" text-anchor="end" font-size="10">{tick_label(t)}</text>')
        out.append(f'<text x="{(L + width - R) / 2}" y="{height - 6}" text-anchor="middle" font-size="11">'
                   f'{html.escape(x_label)}</text>')
        out.append(f'<text transform="translate(12,{(T + height - B) / 2}) rotate(-90)" text-anchor="middle" '
                   f'font-size="11">{html.escape(y_label)}</text>')
    if diagonal:
        lo, hi = max(x0, y0), min(x1, y1)
        out.append(f'<line x1="{px(lo):.1f}" y1="{py(lo):.1f}" x2="{px(hi):.1f}" y2="{py(hi):.1f}" '
                   'stroke="#444" stroke-dasharray="4 3"/>')
    X, Y = px(x), py(y)
    for i in range(len(x)):
        out.append(f'<circle cx="{X[i]:.1f}" cy="{Y[i]:.1f}" r="3.2" fill="{colours[i]}" fill-opacity="0.7" '
                   f'data-id="{int(ids[i])}"><title>{html.escape(tips[i])}</title></circle>')
    if mark is not None:
        out.append(f'<text x="{X[mark]:.1f}" y="{Y[mark] + 7:.1f}" text-anchor="middle" font-size="22" '
                   f'fill="black" stroke="yellow" stroke-width="1" data-id="{int(ids[mark])}">★'
                   f'<title>query: {html.escape(tips[mark])}</title></text>')
    out.append("</svg>")
    return "".join(out)


SCATTER_COLOURS = ("outcome", "jaccard")  # the AP scatter's colourings: by ΔAP's sign, by top-k overlap


def jaccard_colour(v: float) -> str:
    """Viridis from 0 (no result in common: dark purple) to 1 (the same top k: yellow)."""
    import matplotlib

    r, g, b, _ = matplotlib.colormaps["viridis"](float(np.clip(v, 0.0, 1.0)))
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def ap_scatter(cmp, colour: str = "outcome", max_jaccard: float | None = None, mark_id: int | None = None,
               **kw) -> str:
    """x: AP under the left configuration, y: under the right one, one point per query, the
    diagonal drawn; coloured green above it (improved), red below (worsened), grey on it, or
    (`colour="jaccard"`) by how much the two top-k lists overlap.  `max_jaccard`: only the
    queries whose lists overlap at most that much.  `mark_id`: the query drawn as a star."""
    if colour not in SCATTER_COLOURS:
        raise UserError(f"scatter colour must be one of {SCATTER_COLOURS}, got {colour!r}")
    o = cmp.outcome()
    jac = cmp.jaccard if cmp.jaccard is not None else np.ones(len(cmp.ids))
    keep = np.arange(len(cmp.ids)) if max_jaccard is None else np.nonzero(jac <= max_jaccard + 1e-12)[0]
    tips = [f"{cmp.class_name(cmp.labels[i])} · id {cmp.ids[i]} · AP {cmp.ap_a[i]:.3f} → {cmp.ap_b[i]:.3f}"
            f" · Jaccard@{cmp.k} {jac[i]:.2f}" for i in keep]
    colours = ([OUTCOME_COLOURS[int(o[i])] for i in keep] if colour == "outcome"
               else [jaccard_colour(jac[i]) for i in keep])
    note = kw.pop("note", "")
    if colour == "jaccard":
        note = ", ".join(x for x in (note, f"colour: Jaccard@{cmp.k}, purple 0 → yellow 1") if x)
    if max_jaccard is not None:
        note = ", ".join(x for x in (note, f"{len(keep):,} of {len(cmp.ids):,} queries with Jaccard@{cmp.k} "
                                           f"≤ {max_jaccard:g}") if x)
    ids = cmp.ids[keep]
    mark = np.nonzero(ids == mark_id)[0] if mark_id is not None else np.zeros(0, dtype=np.int64)
    return svg_scatter(cmp.ap_a[keep], cmp.ap_b[keep], ids, colours, tips,
                       title="per-query AP (MAP@R): click a point to open it", x_label=f"AP, {cmp.label_a}",
                       y_label=f"AP, {cmp.label_b}", lims=(0, 1, 0, 1), diagonal=True,
                       mark=int(mark[0]) if len(mark) else None, note=note, **kw)


# ---------------------------------------------------------------- maps
def metric_features(feats: np.ndarray, M: np.ndarray, kind: str, W: np.ndarray, mode: str) -> tuple[np.ndarray, str]:
    """Features whose Euclidean geometry is M′'s: Lφ with LᵀL = M′ (Wφ for M*, φ for the
    identity; an indefinite M′ keeps its PSD part, said in the note); rows normalised in
    cosine mode, where the M′-cosine is the cosine of Lφ."""
    note = ""
    if kind == "identity":
        X = feats
    elif kind == "lowrank":
        X = feats @ W.T
    else:
        lam, V = np.linalg.eigh(np.asarray(M, dtype=np.float64))
        if lam.min() < -1e-8 * max(abs(lam).max(), 1e-300):
            note = "indefinite M′: its PSD part"
        X = (feats @ (V * np.sqrt(np.clip(lam, 0, None)))).astype(np.float32)
    return (l2_normalize(X) if mode == "cosine" else X), note


def subsample(n: int, seed: int = 0, cap: int = MAX_MAP_POINTS) -> np.ndarray:
    """Rows drawn for a map: all up to `cap`, else `cap` of them (seeded, in index order)."""
    if n <= cap:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, cap, replace=False))


def project_2d(X: np.ndarray, method: str, seed: int = 0) -> tuple[np.ndarray, Callable | None, str]:
    """The app's one 2-D projection (the Compare tab's maps and the gallery map): (coordinates of
    the rows of X, a function placing new rows on the same map or None, the method used).
    t-SNE (on a 50-d PCA, as scikit-learn advises; it places no new rows), PCA, or UMAP where
    installed, else PCA, and the method used says so."""
    if method not in MAP_METHODS:
        raise UserError(f"map method must be one of {MAP_METHODS}, got {method!r}")
    from sklearn.decomposition import PCA

    X = np.asarray(X, dtype=np.float32)
    if method == "UMAP":
        try:
            import umap  # optional
        except ImportError:
            method = "PCA"
        else:
            reducer = umap.UMAP(n_components=2, random_state=seed)
            return reducer.fit_transform(X), reducer.transform, "UMAP"
    if method == "PCA":
        pca = PCA(n_components=2, random_state=seed).fit(X)
        return pca.transform(X), pca.transform, "PCA"
    from sklearn.manifold import TSNE

    if X.shape[1] > 50 and len(X) > 50:
        X = PCA(n_components=50, random_state=seed).fit_transform(X)
    perplexity = float(min(30, max(2, (len(X) - 1) / 3)))
    return TSNE(n_components=2, init="pca", random_state=seed, perplexity=perplexity).fit_transform(X), None, "t-SNE"


def class_colours(labels: np.ndarray) -> list[str]:
    _, codes = np.unique(labels, return_inverse=True)
    return [PALETTE[c % len(PALETTE)] for c in codes]


# ---------------------------------------------------------------- URL state
# A link names the right side's configuration by the plain keys (strategy, its parameters, mode,
# rerank, rerank_<param>) and the left side's by the same keys prefixed "left_".  Links made
# before the left side could change name only the right side: their left side is the trained
# metric in the link's mode, as those links showed it.
LEFT = "left_"


def _config_items(cfg, prefix: str) -> dict:
    if file_params(cfg.strategy):
        raise UserError(f"strategy {cfg.strategy} uses an uploaded file: it cannot be shared in a link")
    own = {f: cfg.params[f] for f in REFINEMENTS.get(cfg.strategy).param_defaults() if cfg.params.get(f) is not None}
    out = {f"{prefix}strategy": cfg.strategy, **{prefix + k: v for k, v in own.items()}, f"{prefix}mode": cfg.mode}
    if cfg.rerank != NO_RERANK:
        out[f"{prefix}rerank"] = cfg.rerank
        out |= {f"{prefix}rerank_{k}": v for k, v in cfg.rerank_params.items() if v is not None}
    return out


def state_query(item_id: int, left, right, k: int) -> str:
    """`?q=<id>&left_strategy=…&left_<param>=…&left_mode=…&strategy=…&<param>=…&mode=…&k=…`: each
    configuration's own parameters only; a strategy that needs a file cannot be shared (its file
    is not in the URL)."""
    return "?" + urllib.parse.urlencode({"q": int(item_id), **_config_items(left, LEFT), **_config_items(right, ""),
                                         "k": int(k)})


def _parse_config(query: dict, prefix: str, default_strategy: str, default_mode: str) -> SearchConfig:
    side = "left " if prefix else ""
    strategy = query.get(f"{prefix}strategy", default_strategy)
    try:
        REFINEMENTS.get(strategy)  # an unknown name is refused with the known ones
    except UserError as e:
        raise UserError(f"the link's {side}strategy: {e}") from None
    if file_params(strategy):
        raise UserError(f"strategy {strategy} needs an uploaded file: a link cannot carry it")
    mode = query.get(f"{prefix}mode", default_mode)
    if mode not in MODES:
        raise UserError(f"the link's {side}mode must be one of {MODES}, got {mode!r}")
    names = REFINEMENTS.get(strategy).param_defaults()
    given = {name: query[prefix + name] for name in names if prefix + name in query}
    rerank = query.get(f"{prefix}rerank", NO_RERANK)
    rerank_params = {key[len(prefix) + 7:]: v for key, v in query.items() if key.startswith(f"{prefix}rerank_")}
    try:  # an unknown re-ranker or a bad value of its parameters is refused with the valid ones
        RERANKERS.params(rerank, rerank_params, ignore_unknown=True)
    except UserError as e:
        raise UserError(f"the link's {side}re-ranker: {e}") from None
    cfg = SearchConfig.of(strategy, given, mode, rerank, rerank_params)
    cfg.check_searchable()
    return cfg


def parse_state(query: dict) -> dict | None:
    """The URL's comparison: {q, left, right (SearchConfig each), k} (None when it names no
    query); bad values are refused with a message that names them."""
    query = {k: v for k, v in dict(query).items() if v not in ("", None)}
    if "q" not in query:
        return None
    try:
        q = int(query["q"])
        k = int(query.get("k", 12))
    except ValueError:
        raise UserError(f"the link's q and k must be integers, got q={query['q']!r}, k={query.get('k')!r}") from None
    if not K_RANGE[0] <= k <= K_RANGE[1]:
        raise UserError(f"the link's k must be between {K_RANGE[0]} and {K_RANGE[1]}, got {k}")
    right = _parse_config(query, "", "identity", "cosine")
    old = not any(key.startswith(LEFT) for key in query)  # a link from before the left side could change
    left = _parse_config(query, LEFT, "trained", right.mode if old else "cosine")
    return {"q": q, "left": left, "right": right, "k": k}


# ---------------------------------------------------------------- export
CSV_FIELDS = ("side", "metric", "strategy", "params", "mode", "rerank", "rerank_params", "p_at_k", "ap",
              *HIT_FIELDS, "correct")


def write_exports(payload: dict, folder: str | None = None) -> tuple[str, str]:
    """The comparison as JSON and as CSV (one row per result per panel), in a fresh temp folder."""
    out = Path(folder or tempfile.mkdtemp(prefix="compare-"))
    stem = f"comparison-q{payload['query'].get('id', 'upload')}"
    j, c = out / f"{stem}.json", out / f"{stem}.csv"
    j.write_text(json.dumps(payload, indent=1, ensure_ascii=False))
    with c.open("w", newline="") as f:
        w = csv.DictWriter(f, CSV_FIELDS)
        w.writeheader()
        for p in payload["panels"]:
            cfg = p["config"]
            for r in p["results"]:
                w.writerow({"side": p["side"], "metric": p["metric"], "strategy": cfg["strategy"],
                            "params": json.dumps(cfg["params"], sort_keys=True), "mode": cfg["mode"],
                            "rerank": cfg["rerank"],
                            "rerank_params": json.dumps(cfg.get("rerank_params", {}), sort_keys=True),
                            "p_at_k": p["p_at_k"], "ap": p["ap"],
                            **{f: r.get(f) for f in (*HIT_FIELDS, "correct")}})
    return str(j), str(c)
