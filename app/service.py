"""Everything the app does, without Gradio: the handlers call this, the HTTP APIs call this,
and the tests do too.

One `RetrievalService` per index: it embeds query images with the index's own
model, searches under any two configurations (index/search_config.py; the
trained metric and the identity by default), scores each panel (P@k and AP =
MAP@R of the query when its class is known), finds the queries where the two
disagree most, explains why a result moved between them, and draws the
analysis pictures.  The search specification is here too: a configuration from
the controls' or an API call's values (`spec_from`), the API's parameters in their
stable order (`api_params`) and its one search (`RetrievalService.api_search`).
Every configuration searched is first checked against the server's bound on a
re-ranker's sizes (`max_rerank_size`).
Read paths are lock-free (FAISS searches are thread-safe); caches are locked.
"""
from __future__ import annotations

import base64
import dataclasses
import io
import json
import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from core.errors import CorruptImageError, UserError
from core.images import load_rgb
from core.params import parse_items
from evaluation.evaluator import per_query_metrics
from index.analysis.compare import Comparer, Comparison, item_image
from index.analysis.explain import Explainer, Why
from index.analysis.sweep import MAX_N as SWEEP_MAX_N
from index.backends.gallery import HIT_FIELDS
from index.backends.search import Searcher
from index.backends.store import read_index
from index.embedder import ImageEmbedder
from index.refinements import REFINEMENTS, file_params, shared_params, strategy_key, strategy_params
from index.rerankers import check_size_limit, reranker_params
from index.search_config import NO_RERANK, SearchConfig

from .compare_view import ap_scatter, class_colours, metric_features, project_2d, subsample, svg_scatter
from .limits import DEFAULT_MAX_RERANK_SIZE

log = logging.getLogger("app")


@dataclass
class Query:
    feats: np.ndarray                 # 1 × d trunk feature
    label: int | None = None          # known class (gallery items), else None
    self_id: int | None = None        # the query is this gallery item: leave it out
    image: Image.Image | None = None


@dataclass
class Panel:
    title: str
    results: list[dict]
    p_at_k: float | None
    ap: float | None
    note: str = ""


# the app's name for a configuration: one type from the panels to the comparer and the exports
DEFAULT_RIGHT = SearchConfig("identity")  # the right panel's first configuration (the left's: SearchConfig())
# The search API's parameters in their stable order.  Gradio's /search takes them positionally
# (gradio_client), so this order only ever grows at the end: a strategy parameter registered
# later follows these, in registry order.
API_ORDER = ("image", "strategy", "r", "seed", "alpha", "p", "mode", "k", "psd", "rerank", "rerank_params")
API_FIXED = ("image", "strategy", "mode", "k", "rerank", "rerank_params")  # the rest: strategy parameters


def api_params() -> list[str]:
    """The search API's parameter names (Gradio's /search, POST /api/search) in their stable order:
    API_ORDER, then each file-free strategy parameter not in it, in registry order."""
    strategy = [sp.name for sp in shared_params() if not sp.metadata.get("file")]
    return ([n for n in API_ORDER if n in API_FIXED or n in strategy]
            + [n for n in strategy if n not in API_ORDER])


def spec_from(strategy, mode, values: dict, rerank: str = NO_RERANK, rerank_params: dict | None = None) -> SearchConfig:
    """A configuration from the parameter controls' or an API call's values (every strategy's, by
    name; the others are not read): the chosen strategy's typed parameters, so that its label shows
    exactly what was searched, and the re-ranker's (only its own: another key is refused with the
    ones it takes)."""
    for name in file_params(strategy):
        if not values.get(name):
            raise UserError(f"strategy {strategy}: upload {REFINEMENTS.get(strategy).param_help()[name]} first")
    rerank = rerank or NO_RERANK
    given = {k: v for k, v in (rerank_params or {}).items() if v is not None}
    return SearchConfig(strategy, dataclasses.asdict(strategy_params(strategy, values)), mode, rerank,
                dataclasses.asdict(reranker_params(rerank, given)))


def rerank_params_from(given) -> dict:
    """A re-ranker's parameters as the APIs take them: a dict, a JSON object, or `key=value`
    pairs separated by commas or spaces ("n=3, alpha=1"); empty: none (its defaults)."""
    if given is None:
        return {}
    if isinstance(given, dict):
        return dict(given)
    text = str(given).strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            out = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"rerank_params: not a JSON object ({e.msg})") from None
        if not isinstance(out, dict):
            raise UserError("rerank_params: want a JSON object or key=value pairs")
        return out
    return parse_items([t for t in re.split(r"[,\s]+", text) if t], "rerank_params")


def jaccard(a, b) -> float:
    """|A ∩ B| / |A ∪ B| of two result id lists (1 for two empty lists)."""
    sa, sb = set(a), set(b)
    return len(sa & sb) / len(sa | sb) if sa | sb else 1.0


def whole_number(value, name: str) -> int:
    """An API's integer field, given as a number or as its text (a form field)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not number.is_integer():
        raise UserError(f"{name} must be a whole number, got {value!r}")
    return int(number)


class RetrievalService:
    def __init__(self, index_dir, checkpoint: str | None = None, analysis_dir: str | None = None,
                 verify: bool = True, device: str = "cpu", max_rerank_size: int = DEFAULT_MAX_RERANK_SIZE):
        self.max_rerank_size = int(max_rerank_size)
        self.data = read_index(index_dir, verify=verify)
        self.searcher = Searcher(self.data)
        self.index_dir = Path(index_dir)
        man = self.data.manifest
        self.embedder = None
        ck = checkpoint or man.get("checkpoint")
        if ck and man.get("checkpoint_sha256"):
            self.embedder = ImageEmbedder(ck, man, device=device)
        self.analysis_dir = Path(analysis_dir) if analysis_dir else None
        self.root = Path(self.data.root) if self.data.root else None
        self._row_of_id = {int(i): r for r, i in enumerate(self.data.items.ids)}
        self._lock = threading.Lock()
        self.comparer = Comparer(self.data, self.searcher)
        self.explainer = Explainer(self.searcher)
        self._maps: dict = {}
        self._pca: tuple | None = None  # (projection, the drawn map, data ↦ pixel), drawn once
        self._thumbs: dict[tuple[int, int], Image.Image] = {}
        self._heatmaps: dict = {}

    def warm(self) -> None:
        """Build every file-free strategy's M′ at its default parameters (with the cosine parts
        where M′ is PSD), so that the first search under each is as fast as the next, and the
        trained metric's per-query AP (the Compare tab's baseline).  The app runs this in the
        background after it starts."""
        for name in self.strategy_choices(with_files=False):
            try:
                self.searcher.query_view(name, {}, self.searcher.resolve_mode(name, {}, "cosine")[0])
            except UserError:
                pass  # a strategy that refuses this index's M*: its own search says why
        if 0 < len(self.data.items) <= SWEEP_MAX_N and self.searcher.exact:
            # the Compare tab's left side, in both modes: a first comparison then costs only its M′
            # (seconds, in one batched pass; larger indexes search every item: left to the tab)
            for mode in ("cosine", "bilinear"):
                self.comparer.per_query_ap("trained", {}, mode)

    @staticmethod
    def strategy_choices(with_files: bool = True) -> list[str]:
        """The registered refinement strategies; `with_files=False`: only those that need no
        user-supplied file (what an API call can name)."""
        return [n for n in REFINEMENTS.names() if with_files or not file_params(n)]

    # ------------------------------------------------------------ queries
    def query_from_upload(self, source) -> Query:
        """An uploaded file path / bytes / PIL image → Query (class unknown)."""
        if self.embedder is None:
            raise UserError("this index has no model (built from features): it cannot embed images")
        if source is None:
            raise UserError("no image: upload, paste or pick an example first")
        try:
            img = source.convert("RGB") if isinstance(source, Image.Image) else load_rgb(source)
        except CorruptImageError as e:
            raise UserError(f"that upload is not a usable image: {e.reason}") from None
        return Query(self.embedder.features([img]), image=img)

    def query_from_item(self, item_id: int) -> Query:
        row = self._row(item_id)
        feats = np.asarray(self.data.features[row: row + 1], dtype=np.float32)
        return Query(feats, int(self.data.items.labels[row]), int(item_id), self.thumbnail(item_id))

    def _row(self, item_id: int) -> int:
        if int(item_id) not in self._row_of_id:
            raise UserError(f"no item with id {item_id} in this index")
        return self._row_of_id[int(item_id)]

    # ------------------------------------------------------------ search
    def check(self, spec: SearchConfig) -> None:
        """Refuse a configuration this server does not search: an unknown re-ranker, a parameter it
        does not take, or a size parameter above `max_rerank_size`."""
        spec.check_searchable()
        check_size_limit(spec.rerank, spec.rerank_params, self.max_rerank_size)

    def api_search(self, image, values: dict) -> dict:
        """One search of the HTTP APIs (Gradio's /search, POST /api/search): the query image and
        `values` by the API's parameter names (`api_params()`), each optional: strategy trained
        (one that needs no file), mode cosine, k 10, the strategy's own defaults, no re-ranker
        (`rerank_params`: see `rerank_params_from`).  A name that is none of them is refused with
        the valid ones.  → {"metric", "note", "results": HIT_FIELDS per result}."""
        valid = api_params()
        unknown = [name for name in values if name not in valid]
        if unknown:
            raise UserError(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                            f"valid: {', '.join(valid)}")
        strategy = values.get("strategy") or "trained"
        choices = self.strategy_choices(with_files=False)
        if strategy not in choices:
            raise UserError(f"unknown strategy {strategy!r}; choose from {', '.join(choices)}")
        k = whole_number(values.get("k", 10), "k")
        spec = spec_from(strategy, values.get("mode") or "cosine", values, values.get("rerank") or NO_RERANK,
                         rerank_params_from(values.get("rerank_params")))
        self.check(spec)  # a bad configuration is refused before the image is decoded
        panel = self.panel(self.query_from_upload(image), spec, k)
        # "relative_path", not "path": gradio_client would take a "path" key for a file to download
        return {"metric": panel.title, "note": panel.note,
                "results": [{f: x[f] for f in HIT_FIELDS} for x in panel.results]}

    def panel(self, q: Query, spec: SearchConfig, k: int = 12) -> Panel:
        """One panel: the top k under `spec` (its re-ranker included) through `SearchConfig.search`,
        a gallery query's own item left out (leave-one-out: it neither appears nor helps its own
        re-ranking), with P@k and AP where the query's class is known."""
        k = int(k)
        if not 1 <= k <= 200:
            raise UserError("k must be between 1 and 200")
        self.check(spec)
        mode, note = self.searcher.resolve_mode(spec.strategy, spec.params, spec.mode)
        cfg = spec.with_mode(mode)
        res = cfg.search(self.searcher, q.feats, k, self_ids=self._self_ids(q))
        results = res.results()[0][:k]
        for i, r in enumerate(results):
            r["rank"] = i + 1  # after the query's own item is left out
            r["correct"] = None if q.label is None else bool(r["label"] == q.label)
        p_at_k = ap = None
        if q.label is not None and results:
            p_at_k = float(np.mean([r["correct"] for r in results]))
            ap = self.query_ap(q, cfg)
        return Panel(cfg.label(), results, p_at_k, ap, note)

    def _self_ids(self, q: Query) -> np.ndarray | None:
        """The query's own gallery row, for leave-one-out (None for an upload)."""
        return None if q.self_id is None else np.array([self._row(q.self_id)])

    def query_ap(self, q: Query, cfg: SearchConfig) -> float | None:
        """MAP@R of this query against the whole index (its own item left out), under `cfg` (its
        mode as given) and its re-ranker, through `SearchConfig.search`."""
        labels = self.data.items.labels
        R = int((labels == q.label).sum()) - (1 if q.self_id is not None else 0)
        if R <= 0:
            return None
        res = cfg.search(self.searcher, q.feats, R, self_ids=self._self_ids(q))
        rows = res.rows[0][res.rows[0] >= 0][:R]
        m = per_query_metrics(labels[rows][None, :], np.array([q.label]), np.array([R]), ks=(1,))
        return float(m["map@r"][0])

    def compare(self, q: Query, right: SearchConfig, k: int = 12,
                left: SearchConfig | None = None) -> tuple[Panel, Panel]:
        """The two panels: `left` (default: the trained metric, cosine) and `right`."""
        return self.panel(q, left or SearchConfig(), k), self.panel(q, right, k)

    def export(self, q: Query, right: SearchConfig, k: int = 12, left: SearchConfig | None = None) -> dict:
        """The current comparison: the query, both configurations, and both panels' results
        (HIT_FIELDS and whether each is of the query's class), P@k and AP, and the overlap of
        the two lists (Jaccard@k), as the JSON/CSV export writes them."""
        left = left or SearchConfig()
        query = ({"kind": "item", "id": q.self_id, "label": q.label, "class_name": self.item_class(q.self_id)}
                 if q.self_id is not None else {"kind": "upload"})
        pair = self.compare(q, right, k, left)
        panels = [{"side": side, "metric": p.title, "config": cfg.to_dict(), "note": p.note, "p_at_k": p.p_at_k,
                   "ap": p.ap, "results": [{f: r[f] for f in (*HIT_FIELDS, "correct")} for r in p.results]}
                  for side, cfg, p in zip(("left", "right"), (left, right), pair, strict=True)]
        overlap = jaccard([r["id"] for r in pair[0].results], [r["id"] for r in pair[1].results])
        return {"index": str(self.index_dir), "k": int(k), "query": query, "left": left.to_dict(),
                "right": right.to_dict(), "jaccard_at_k": overlap, "panels": panels}

    # ------------------------------------------------------------ why a result moved
    def why(self, q: Query, item_id: int, right: SearchConfig, left: SearchConfig | None = None, k: int = 12,
            top: int = 5) -> Why:
        """Gallery item `item_id` as a result of `q`: rank and score under both configurations,
        the score difference over the eigen-directions of M_right − M_left (index/analysis/explain.py)."""
        left = left or SearchConfig()
        for spec in (left, right):
            self.check(spec)
        self_row = self._row(q.self_id) if q.self_id is not None else None
        return self.explainer.why(q.feats, self._row(item_id), left, right, self_row=self_row,
                                  k=int(k), top=top)

    # ------------------------------------------------------------ the whole test set
    def per_query_ap(self, spec: SearchConfig, progress=None) -> np.ndarray:
        """MAP@R of every index item as a query (leave-one-out), under `spec` (its mode as given)
        and its re-ranker; one batched pass without a re-ranker, cached (index/analysis/compare.py)."""
        self.check(spec)
        return self.comparer.ap(spec, progress)

    def comparison(self, right: SearchConfig, left: SearchConfig | None = None, k: int = 12,
                   progress=None) -> Comparison:
        """Per-query AP under `left` (default: trained, cosine) vs `right` over every query, and
        Jaccard@k of their top-k lists.  `progress(done, total, what)`: called while a side with a
        re-ranker is computed (every query re-ranked: seconds to a minute on the demo index)."""
        left = left or SearchConfig()
        for spec in (left, right):
            self.check(spec)
        return self.comparer.compare(left, right, k=int(k), progress=progress)

    def disagreements(self, right: SearchConfig, left: SearchConfig | None = None, top: int = 12,
                      progress=None) -> list[dict]:
        if not self.data.manifest.get("count"):
            return []
        return self.comparison(right, left, progress=progress).disagreements("all", top)

    def scatter_html(self, cmp: Comparison, q_id: int | None = None, colour: str = "outcome",
                     max_jaccard: float | None = None) -> str:
        """The per-query AP scatter, coloured by outcome or by Jaccard@k, only the queries whose
        top-k lists overlap at most `max_jaccard` drawn (all: None)."""
        return ap_scatter(cmp, colour=colour, max_jaccard=max_jaccard, mark_id=q_id)

    def map_coords(self, strategy: str, params: dict, mode: str, method: str) -> tuple[np.ndarray, np.ndarray, str]:
        """(rows, 2-D coordinates, note) of the gallery under a metric; computed once per
        (strategy, parameters, mode, method)."""
        rm = self.searcher.metric(strategy, params)
        key = (strategy_key(strategy, rm.params), mode, method)
        with self._lock:
            hit = self._maps.get(key)
        if hit is not None:
            return hit
        rows = subsample(len(self.data.items))
        X, note = metric_features(np.asarray(self.data.features, dtype=np.float32)[rows], rm.M, rm.op.kind,
                                  self.data.W, mode)
        if len(rows) < len(self.data.items):
            note = ", ".join(x for x in (note, f"sub-sampled: {len(rows):,} of {len(self.data.items):,} points") if x)
        out = (rows, project_2d(X, method), note)
        with self._lock:
            self._maps[key] = out
        return out

    def map_html(self, spec: SearchConfig, method: str, title: str, q_id: int | None = None) -> str:
        """The gallery in 2-D under `spec`, coloured by class, the query (an item) starred."""
        mode, _ = self.searcher.resolve_mode(spec.strategy, spec.params, spec.mode)
        rows, xy, note = self.map_coords(spec.strategy, spec.params, mode, method)
        ids, labels = self.data.items.ids[rows], self.data.items.labels[rows]
        mark = np.nonzero(ids == q_id)[0]
        tips = [f"{self.class_name(lab)} · id {i}" for i, lab in zip(ids, labels, strict=True)]
        return svg_scatter(xy[:, 0], xy[:, 1], ids, class_colours(labels), tips, title=f"{title} ({method})",
                           axes=False, mark=int(mark[0]) if len(mark) else None, note=note)

    def thumbnail_uri(self, item_id: int, size: int = 96) -> str:
        """A thumbnail as a data: URI (the plots' hover preview; the app serves no files)."""
        buf = io.BytesIO()
        self.thumbnail(int(item_id), size).save(buf, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    # ------------------------------------------------------------ pictures
    def class_name(self, label: int) -> str:
        return self.data.class_names.get(int(label), str(int(label)))

    def item_class(self, item_id: int) -> str:
        """The class name of a gallery item."""
        return self.class_name(int(self.data.items.labels[self._row(item_id)]))

    def thumbnail(self, item_id: int, size: int = 112) -> Image.Image:
        """The gallery image of an item (only indexed items are ever read)."""
        key = (int(item_id), size)
        with self._lock:
            if key in self._thumbs:
                return self._thumbs[key]
        img = item_image(self.data, self._row(item_id))
        if img is None:
            img = Image.new("RGB", (size, size), (230, 230, 230))
            ImageDraw.Draw(img).text((8, size // 2 - 6), f"id {item_id}", fill=(90, 90, 90))
        img = img.copy()
        img.thumbnail((size, size))
        with self._lock:
            if len(self._thumbs) < 20000:
                self._thumbs[key] = img
        return img

    def examples(self, n: int = 24, seed: int = 0) -> list[int]:
        """Example query ids, one per class, spread over the index (deterministic)."""
        y = self.data.items.labels
        classes = np.unique(y)
        rng = np.random.default_rng(seed)
        chosen = rng.choice(classes, size=min(n, len(classes)), replace=False)
        ids = []
        for c in chosen:
            rows = np.nonzero(y == c)[0]
            ids.append(int(self.data.items.ids[rows[rng.integers(len(rows))]]))
        return ids

    def metric_report(self, spec: SearchConfig) -> dict:
        return self.searcher.metric(spec.strategy, spec.params).report

    def heatmap(self, spec: SearchConfig, max_side: int = 256) -> Image.Image:
        """|M′| entries block-averaged down to at most max_side², symmetric colour scale (the
        metric's: a re-ranker does not change it, and is not named)."""
        spec = spec.without_rerank()
        rm = self.searcher.metric(spec.strategy, spec.params)
        key = (strategy_key(spec.strategy, rm.params), spec.label())
        with self._lock:
            hit = self._heatmaps.get(key)
        if hit is not None:
            return hit
        M = rm.M
        d = M.shape[0]
        b = max(1, int(np.ceil(d / max_side)))
        pad = (-d) % b
        Mp = np.pad(M, ((0, pad), (0, pad)))
        small = Mp.reshape(Mp.shape[0] // b, b, Mp.shape[1] // b, b).mean(axis=(1, 3))
        img = _plot_matrix(small, f"{spec.label()}  (d = {d}{f', {b}×{b} blocks' if b > 1 else ''})")
        with self._lock:  # drawn once per M′ (matplotlib takes ~100 ms a figure)
            self._heatmaps[key] = img
            while len(self._heatmaps) > 16:
                self._heatmaps.pop(next(iter(self._heatmaps)))
        return img

    def gallery_map(self, q: Query | None = None) -> Image.Image:
        """2-D map of the gallery (UMAP if installed, else PCA), coloured by class; the query marked."""
        with self._lock:
            if self._pca is None:
                proj, xy, method = _fit_2d(np.asarray(self.data.features, dtype=np.float32))
                # the scatter is drawn once; each query only stars its point on a copy (PIL, ~1 ms)
                self._pca = (proj, *_plot_map(xy, self.data.items.labels, method))
        proj, base, to_pixel = self._pca
        img = base.copy()
        if q is not None and proj is not None:
            x, y = to_pixel(proj(self.searcher.prepare_queries(q.feats))[0])
            _draw_star(img, x, y)
        return img

    def analysis(self) -> dict:
        """The strategy-evaluation outputs written by `python -m index evaluate`, if present."""
        out: dict[str, str | Image.Image | None] = {"table": None, "sweep": None, "principles": None}
        if self.analysis_dir is None:
            return out
        t = self.analysis_dir / "table.md"
        if t.is_file():
            out["table"] = t.read_text()
        for key, name in (("sweep", "restraint_sweep.png"), ("principles", "principles.png")):
            p = self.analysis_dir / name
            if p.is_file():
                out[key] = Image.open(p).convert("RGB")
        return out


def _fig_to_pil(fig) -> Image.Image:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    buf.seek(0)
    return Image.open(buf).convert("RGB")


def _plot_matrix(M: np.ndarray, title: str) -> Image.Image:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    v = float(np.abs(M).max()) or 1.0
    fig, ax = plt.subplots(figsize=(4.2, 3.6))
    im = ax.imshow(M, cmap="RdBu_r", vmin=-v, vmax=v, interpolation="nearest")
    fig.colorbar(im, ax=ax, fraction=0.046)
    ax.set_title(title, fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])
    fig.tight_layout()
    return _fig_to_pil(fig)


def _fit_2d(X: np.ndarray):
    try:
        import umap  # optional

        reducer = umap.UMAP(n_components=2, random_state=0)
        xy = reducer.fit_transform(X)
        return (lambda q: reducer.transform(q)), xy, "UMAP"
    except ImportError:
        from sklearn.decomposition import PCA

        pca = PCA(n_components=2, random_state=0).fit(X)
        return (lambda q: pca.transform(q)), pca.transform(X), "PCA"


def _plot_map(xy, labels, method):
    """The gallery scatter as an image, and data (x, y) ↦ its pixel (x, y)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4), dpi=90)  # the saved image's dpi: display pixels = image pixels
    _, codes = np.unique(labels, return_inverse=True)
    ax.scatter(xy[:, 0], xy[:, 1], c=codes % 20, cmap="tab20", s=4, alpha=0.6, linewidths=0)
    ax.set_title(f"gallery, {method} of trunk features (colour = class; ★ = the query)", fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    fig.tight_layout()
    fig.canvas.draw()  # fixes the layout, so the transform below is the saved image's
    transform, height = ax.transData.transform, fig.get_figheight() * fig.dpi

    def to_pixel(p):
        dx, dy = transform((float(p[0]), float(p[1])))
        return dx, height - dy  # image rows run downwards
    return _fig_to_pil(fig), to_pixel


def _draw_star(img: Image.Image, x: float, y: float, r: float = 11.0) -> None:
    """A black five-pointed star with a yellow rim at pixel (x, y)."""
    pts = [(x + (r if i % 2 == 0 else r * 0.42) * np.sin(np.pi * i / 5),
            y - (r if i % 2 == 0 else r * 0.42) * np.cos(np.pi * i / 5)) for i in range(10)]
    ImageDraw.Draw(img).polygon(pts, fill=(0, 0, 0), outline=(255, 215, 0), width=2)
