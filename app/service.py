"""Everything the app does, without Gradio: the handlers call this, the HTTP APIs call this,
and the tests do too.

One `RetrievalService` per gallery, on any backend (app/backend.py: an index directory, an
on-disk IVF, a Milvus collection): it embeds query images with the gallery's own model,
searches under any two configurations (index/search_config.py) through the backend's
`Gallery`, scores each panel (P@k and AP = MAP@R of the query when its class is known),
compares the two over every query or a seeded sample (app/sampled.py), explains why a result
moved (index/analysis/explain.py over the backend's features, read by row), and draws the
pictures (app/render.py).  The API's parameters are app/params.py.  Every configuration
searched is first checked against the server's bound on a re-ranker's sizes.  What the app
draws or computes is kept in the process's one memory cache under `--cache-memory`
(app/cache.py), keyed by the gallery's digest (`Served.digest`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from core.errors import CorruptImageError, UserError
from core.images import load_rgb
from evaluation.evaluator import per_query_metrics
from index.analysis.compare import Comparer, Comparison, jaccard_at_k
from index.analysis.explain import Explainer, Why
from index.analysis.sweep import MAX_N as SWEEP_MAX_N
from index.backends.gallery import HIT_FIELDS
from index.backends.store import Items
from index.embedder import ImageEmbedder
from index.refinements import REFINEMENTS, file_params, strategy_key
from index.rerankers import check_size_limit, reads_by_row
from index.search_config import NO_RERANK, SearchConfig

from . import render
from .backend import Served, items_at, open_served
from .cache import keep, keep_image, pixels
from .compare_view import ap_scatter, class_colours, metric_features, project_2d, subsample, svg_scatter
from .limits import COMPARE_ALL_UP_TO, COMPARE_SAMPLE, DEFAULT_MAX_RERANK_SIZE
from .params import api_params, config_dict, rerank_params_from, spec_from, whole_number
from .sampled import GalleryComparer

__all__ = ["Panel", "Query", "RetrievalService", "SearchConfig"]

# a collection's example queries are drawn from this many of its rows (read by row), seeded
EXAMPLE_POOL = 4096


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


class RetrievalService:
    def __init__(self, index_dir=None, checkpoint: str | None = None, analysis_dir: str | None = None,
                 verify: bool = True, device: str = "cpu", max_rerank_size: int = DEFAULT_MAX_RERANK_SIZE,
                 served: Served | None = None, compare_all_up_to: int = COMPARE_ALL_UP_TO,
                 compare_sample: int = COMPARE_SAMPLE):
        """`served`: the gallery on any backend (app/backend.py); else the index directory
        `index_dir`, searched in RAM.  The Compare tab compares every query up to
        `compare_all_up_to` gallery items, above a seeded sample of `compare_sample`."""
        self.max_rerank_size = int(max_rerank_size)
        self.served = served or open_served("faiss", index_dir, verify=verify)
        self.gallery = self.served.gallery      # every search
        self.data = self.served.view             # metadata, W, model facts, features by row
        self.searcher = self.served.metrics      # M′ per strategy, exact scores (why, maps)
        self.backend = self.served.backend
        self.index_dir = Path(index_dir) if index_dir else Path(self.served.where)
        man = self.data.manifest
        self.embedder = None
        ck = checkpoint or man.get("checkpoint")
        if ck and man.get("checkpoint_sha256"):
            self.embedder = ImageEmbedder(ck, man, device=device)
        self.analysis_dir = Path(analysis_dir) if analysis_dir else None
        self.root = Path(self.data.root) if self.data.root else None
        # id → row by binary search over the sorted ids: 16 bytes an item (a dict: ~100 at 10⁶),
        # made once here and never changed (the gallery's own index, not a cache); a collection
        # is asked by id instead (its items are read by row, never all at once)
        self._by_id = self._sorted_ids = None
        if not self.served.by_row:
            self._by_id = np.argsort(self.data.items.ids, kind="stable")
            self._sorted_ids = self.data.items.ids[self._by_id]
        # neither keeps results itself: both keep them in the process's memory cache
        self.comparer = Comparer(self.data, self.searcher) if self.backend == "faiss" else None
        self.sampler = GalleryComparer(self.served)
        self.compare_all_up_to, self.compare_sample = int(compare_all_up_to), int(compare_sample)

    def warm(self) -> None:
        """Build every file-free strategy's M′ at its default parameters (with the cosine parts
        where M′ is PSD), so that the first search under each is as fast as the next, and the
        trained metric's per-query AP (the Compare tab's baseline).  The app runs this in the
        background after it starts.  Only the in-RAM index: the on-disk IVF and Milvus make M′
        per search from W (a d × d matrix, no pass over the gallery)."""
        if self.backend != "faiss":
            return
        for name in self.strategy_choices(with_files=False):
            try:
                self.searcher.query_view(name, {}, self.searcher.resolve_mode(name, {}, "cosine")[0])
            except UserError:
                pass  # a strategy that refuses this index's M*: its own search says why
        if self.comparer is not None and 0 < len(self.data.items) <= min(SWEEP_MAX_N, self.compare_all_up_to):
            # the Compare tab's left side, in both modes: a first comparison then costs only its M′
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
        feats = np.asarray(self.data.features[[row]], dtype=np.float32).reshape(1, -1)
        return Query(feats, int(self.data.items.labels[row]), int(item_id), self.thumbnail(item_id))

    def _row(self, item_id: int) -> int:
        if self._sorted_ids is None or self._by_id is None:
            g: Any = self.gallery  # a MilvusGallery
            return int(g.rows_of_ids([int(item_id)])[0])
        at = int(np.searchsorted(self._sorted_ids, int(item_id)))
        if at >= len(self._sorted_ids) or self._sorted_ids[at] != int(item_id):
            raise UserError(f"no item with id {item_id} in this index")
        return int(self._by_id[at])

    def items_at(self, rows) -> Items:
        """The ids, labels, paths and splits of the given gallery rows (one read on a collection)."""
        return items_at(self.data.items, rows)

    # ------------------------------------------------------------ search
    def check(self, spec: SearchConfig) -> None:
        """Refuse a configuration this server does not search: an unknown re-ranker, a parameter it
        does not take, a size parameter above `max_rerank_size`, or a re-ranker on a backend that
        cannot hold its metric space (its own one-line refusal)."""
        spec.check_searchable()
        check_size_limit(spec.rerank, spec.rerank_params, self.max_rerank_size)
        # a re-ranker read by row needs no metric space of the whole gallery (Milvus: no copy)
        if (spec.rerank != NO_RERANK and not reads_by_row(spec.rerank, spec.rerank_params)
                and self.rerank_refusal is not None):
            raise UserError(self.rerank_refusal)

    @cached_property
    def explainer(self) -> Explainer:
        """The why panel's, keyed by the gallery's digest (made at the first why: a collection's
        digest may read a few of its rows).  It keeps its results in the process's memory cache."""
        return Explainer(self.searcher, key=self.served.digest)

    @cached_property
    def rerank_refusal(self) -> str | None:
        """The backend's own one-line refusal of re-rankers, None where it runs them (every
        backend the app opens does): asked once, at the first re-ranked search, which needs that
        metric space anyway (Milvus then finds or copies its vectors)."""
        try:
            self.gallery.metric_space("trained", {}, "bilinear")
        except UserError as e:
            return str(e)
        return None

    def api_search(self, image, values: dict) -> dict:
        """One search of the HTTP APIs (Gradio's /search, POST /api/search): the query image and
        `values` by the API's parameter names (`api_params()`), each optional: strategy trained
        (one that needs no file), mode cosine, k 10, the strategy's own defaults, no re-ranker
        (`rerank_params`: see `params.rerank_params_from`).  A name that is none of them is
        refused with the valid ones.  → {"metric", "note", "results": HIT_FIELDS and
        has_image per result}."""
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
                "results": [{f: x[f] for f in (*HIT_FIELDS, "has_image")} for x in panel.results]}

    def panel(self, q: Query, spec: SearchConfig, k: int = 12) -> Panel:
        """One panel: the top k under `spec` (its re-ranker included), a gallery query's own item
        left out (leave-one-out: it neither appears nor helps its own re-ranking), with P@k and
        AP where the query's class is known; each result says whether it has an image."""
        k = int(k)
        if not 1 <= k <= 200:
            raise UserError("k must be between 1 and 200")
        self.check(spec)
        mode, note = self.gallery.resolve_mode(spec.strategy, spec.params, spec.mode)
        cfg = spec.with_mode(mode)
        res = self._search(q, cfg, k)
        results = res.results()[0][:k]
        for i, r in enumerate(results):
            r["rank"] = i + 1  # after the query's own item is left out
            r["correct"] = None if q.label is None else bool(r["label"] == q.label)
            r["has_image"] = render.has_image(self.data.root, r["relative_path"])
        p_at_k = ap = None
        if q.label is not None and results:
            p_at_k = float(np.mean([r["correct"] for r in results]))
            ap = self.query_ap(q, cfg)
        return Panel(cfg.label(), results, p_at_k, ap, note)

    def _search(self, q: Query, cfg: SearchConfig, k: int):
        """The top k under `cfg` (mode resolved), the query's own row left out: without a
        re-ranker the gallery's search one deeper, its own row dropped (every backend); with one
        `SearchConfig.search` with the row left out in the gallery's metric space."""
        if q.self_id is None:
            return cfg.search(self.gallery, q.feats, k)
        own = self._row(q.self_id)
        if cfg.rerank != NO_RERANK:
            return cfg.search(self.gallery, q.feats, k, self_ids=np.array([own]))
        hits = self.gallery.search(q.feats, cfg.strategy, cfg.params, cfg.mode, k + 1)
        keep = np.nonzero(hits.rows[0] != own)[0][:k]
        hits.rows, hits.scores = hits.rows[:, keep], hits.scores[:, keep]
        if hits.at is not None:
            hits.at = hits.at[:, keep]
        return hits

    def query_ap(self, q: Query, cfg: SearchConfig) -> float | None:
        """MAP@R of this query against the whole gallery (its own item left out), under `cfg` (its
        mode as given) and its re-ranker."""
        R = int(self.served.class_sizes([q.label])[0]) - (1 if q.self_id is not None else 0)
        if R <= 0:
            return None
        res = self._search(q, cfg, R)
        rows = res.rows[0][res.rows[0] >= 0][:R]
        labels = np.asarray(self.data.items.labels[rows], dtype=np.int64)
        m = per_query_metrics(labels[None, :], np.array([q.label]), np.array([R]), ks=(1,))
        return float(m["map@r"][0])

    def compare(self, q: Query, right: SearchConfig, k: int = 12,
                left: SearchConfig | None = None) -> tuple[Panel, Panel]:
        """The two panels: `left` (default: the trained metric, cosine) and `right`."""
        return self.panel(q, left or SearchConfig(), k), self.panel(q, right, k)

    def export(self, q: Query, right: SearchConfig, k: int = 12, left: SearchConfig | None = None) -> dict:
        """The current comparison: the query, both configurations, and both panels' results
        (HIT_FIELDS, whether each is of the query's class and has an image), P@k and AP, and the
        overlap of the two lists (Jaccard@k), as the JSON/CSV export writes them."""
        left = left or SearchConfig()
        query = ({"kind": "item", "id": q.self_id, "label": q.label, "class_name": self.item_class(q.self_id)}
                 if q.self_id is not None else {"kind": "upload"})
        pair = self.compare(q, right, k, left)
        panels = [{"side": side, "metric": p.title, "config": config_dict(cfg), "note": p.note, "p_at_k": p.p_at_k,
                   "ap": p.ap, "results": [{f: r[f] for f in (*HIT_FIELDS, "correct", "has_image")}
                                           for r in p.results]}
                  for side, cfg, p in zip(("left", "right"), (left, right), pair, strict=True)]
        return {"index": self.served.where, "backend": self.backend, "k": int(k), "query": query,
                "left": config_dict(left), "right": config_dict(right),
                "jaccard_at_k": self.overlap(pair[0], pair[1]), "panels": panels}

    @staticmethod
    def overlap(a: Panel, b: Panel) -> float:
        """Jaccard of the two panels' result lists (1 for two empty lists)."""
        ids = [np.array([r["id"] for r in p.results], dtype=np.int64) for p in (a, b)]
        width = max(1, *(len(x) for x in ids))
        rows = np.full((2, width), -1, dtype=np.int64)
        for i, x in enumerate(ids):
            rows[i, : len(x)] = x
        return float(jaccard_at_k(rows[:1], rows[1:], width)[0])

    # ------------------------------------------------------------ why a result moved
    def why(self, q: Query, item_id: int, right: SearchConfig, left: SearchConfig | None = None, k: int = 12,
            top: int = 5) -> Why:
        """Gallery item `item_id` as a result of `q`: rank and score under both configurations,
        the score difference over the eigen-directions of M_right − M_left (index/analysis/explain.py,
        reading the gallery's features by row, one pass over them per ranking)."""
        left = left or SearchConfig()
        for spec in (left, right):
            self.check(spec)
        self_row = self._row(q.self_id) if q.self_id is not None else None
        return self.explainer.why(q.feats, self._row(item_id), left, right, self_row=self_row,
                                  k=int(k), top=top)

    # ------------------------------------------------------------ the whole test set
    def per_query_ap(self, spec: SearchConfig, progress=None) -> np.ndarray:
        """MAP@R of every index item as a query (leave-one-out), under `spec` (its mode as given)
        and its re-ranker: the in-RAM index's batched pass (index/analysis/compare.py)."""
        self.check(spec)
        if self.comparer is None:
            raise UserError(f"per-query AP of every item is the in-RAM index's; the {self.backend} backend "
                            "compares through `comparison`")
        return self.comparer.ap(spec, progress)

    def sampled(self) -> bool:
        """Whether the Compare tab compares a sample of the queries (above `compare_all_up_to` items)."""
        return len(self.data.items) > self.compare_all_up_to

    def comparison(self, right: SearchConfig, left: SearchConfig | None = None, k: int = 12,
                   progress=None, seed: int = 0, sample: int | None = None) -> Comparison:
        """Per-query AP under `left` (default: trained, cosine) vs `right`, and Jaccard@k of their
        top-k lists: over every query up to `compare_all_up_to` items, above over a sample of
        `sample` queries (default `compare_sample`) drawn with `seed`, with bootstrap intervals
        (app/sampled.py).  `progress(done, total, what)`: called while a side is computed."""
        left = left or SearchConfig()
        for spec in (left, right):
            self.check(spec)
        if not self.sampled():
            if self.comparer is not None:
                return self.comparer.compare(left, right, k=int(k), progress=progress, seed=int(seed))
            return self.sampler.compare(left, right, int(k), int(seed), None, progress)
        return self.sampler.compare(left, right, int(k), int(seed), int(sample or self.compare_sample), progress)

    def disagreements(self, right: SearchConfig, left: SearchConfig | None = None, top: int = 12,
                      progress=None) -> list[dict]:
        if not len(self.data.items):
            return []
        return self.comparison(right, left, progress=progress).disagreements("all", top)

    def scatter_html(self, cmp: Comparison, q_id: int | None = None, colour: str = "outcome",
                     max_jaccard: float | None = None) -> str:
        """The per-query AP scatter, coloured by outcome or by Jaccard@k, only the queries whose
        top-k lists overlap at most `max_jaccard` drawn (all: None)."""
        return ap_scatter(cmp, colour=colour, max_jaccard=max_jaccard, mark_id=q_id)

    def map_coords(self, strategy: str, params: dict, mode: str, method: str) -> tuple[np.ndarray, np.ndarray, str]:
        """(rows, 2-D coordinates, note) of the gallery (at most MAX_MAP_POINTS of it, read by row)
        under a metric; computed once per (gallery, strategy, parameters, mode, method)."""
        rm = self.searcher.metric(strategy, params)

        def make():
            n = len(self.data.items)
            rows = subsample(n)
            X, note = metric_features(np.asarray(self.data.features[rows], dtype=np.float32), rm.M, rm.op.kind,
                                      self.data.W, mode)
            notes = [note, f"sub-sampled: {len(rows):,} of {n:,} points" if len(rows) < n else ""]
            xy, _, used = project_2d(X, method)
            if used != method:
                notes.append(f"{method} is not installed: {used}")
            return rows, xy, ", ".join(x for x in notes if x)
        return keep("map", self.served.digest, strategy_key(strategy, rm.params), mode, method, build=make)

    def map_html(self, spec: SearchConfig, method: str, title: str, q_id: int | None = None) -> str:
        """The gallery in 2-D under `spec`, coloured by class, the query (an item) starred."""
        mode, _ = self.searcher.resolve_mode(spec.strategy, spec.params, spec.mode)
        rows, xy, note = self.map_coords(spec.strategy, spec.params, mode, method)
        shown = self.items_at(rows)
        ids, labels = shown.ids, shown.labels
        mark = np.nonzero(ids == q_id)[0]
        tips = [f"{self.class_name(lab)} · id {i}" for i, lab in zip(ids, labels, strict=True)]
        return svg_scatter(xy[:, 0], xy[:, 1], ids, class_colours(labels), tips, title=f"{title} ({method})",
                           axes=False, mark=int(mark[0]) if len(mark) else None, note=note)

    # ------------------------------------------------------------ pictures
    def class_name(self, label: int) -> str:
        return self.data.class_names.get(int(label), str(int(label)))

    def item_class(self, item_id: int) -> str:
        """The class name of a gallery item."""
        return self.class_name(int(self.data.items.labels[self._row(item_id)]))

    def has_image(self, item_id: int) -> bool:
        """Whether the item has an image file to show (a synthetic distractor has none)."""
        return render.has_image(self.data.root, self.data.items.paths[self._row(item_id)])

    def thumbnail(self, item_id: int, size: int = 112) -> Image.Image:
        """The gallery image of an item, read when first shown (only indexed items are ever read);
        a placeholder saying "no image" where it has none."""
        row = self._row(item_id)
        root, rel = self.data.root, self.data.items.paths[row]
        return keep_image("thumb", str(root or ""), str(rel), int(item_id), int(size),
                          draw=lambda: render.thumbnail(root, rel, int(item_id), size))

    def thumbnail_uri(self, item_id: int, size: int = 96) -> str:
        """A thumbnail as a data: URI (the plots' hover preview; the app serves no files)."""
        return render.data_uri(self.thumbnail(int(item_id), size))

    def examples(self, n: int = 24, seed: int = 0) -> list[int]:
        """Example query ids, one per class, spread over the index (deterministic); items with an
        image where there are any.  A collection's come from EXAMPLE_POOL of its rows drawn with
        `seed` (its items are read by row, never all at once)."""
        items = self.data.items
        if self.served.by_row:
            size = len(items)
            drawn = np.sort(np.random.default_rng(seed).choice(size, min(size, EXAMPLE_POOL), replace=False))
            items = self.items_at(drawn)
        paths = items.paths
        pictured = np.array([bool(p) for p in paths], dtype=bool)
        pool = np.nonzero(pictured)[0] if pictured.any() else np.arange(len(paths))
        y = items.labels[pool]
        classes = np.unique(y)
        rng = np.random.default_rng(seed)
        chosen = rng.choice(classes, size=min(n, len(classes)), replace=False)
        ids = []
        for c in chosen:
            rows = pool[np.nonzero(y == c)[0]]
            ids.append(int(items.ids[rows[rng.integers(len(rows))]]))
        return ids

    def class_count(self) -> int | None:
        """How many classes the gallery has: the manifest's count, else a collection's class
        names (None where it names none), else counted in the labels in memory."""
        man = self.data.manifest
        if man.get("classes"):
            return int(man["classes"])
        if self.served.by_row:
            return len(self.data.class_names) or None
        return len(np.unique(self.data.items.labels))

    def metric_report(self, spec: SearchConfig) -> dict:
        return self.searcher.metric(spec.strategy, spec.params).report

    def heatmap(self, spec: SearchConfig, max_side: int = 256) -> Image.Image:
        """|M′| entries block-averaged down to at most max_side², symmetric colour scale (the
        metric's: a re-ranker does not change it, and is not named); drawn once per M′."""
        spec = spec.without_rerank()
        rm = self.searcher.metric(spec.strategy, spec.params)
        return keep_image("heatmap", self.served.digest, strategy_key(spec.strategy, rm.params), spec.label(),
                          int(max_side), draw=lambda: render.plot_matrix(rm.M, spec.label(), max_side))

    def map_base(self) -> tuple:
        """(rows ↦ 2-D, the drawn map's pixels, 2-D ↦ pixel) of the gallery's trunk features (UMAP if
        installed, else PCA; at most MAX_MAP_POINTS items, read by row), drawn once per gallery."""
        def make() -> dict:
            rows = subsample(len(self.data.items))
            X = self.searcher.prepare_queries(np.asarray(self.data.features[rows], dtype=np.float32))
            xy, proj, used = project_2d(X, "UMAP")
            img, to_pixel = render.plot_map(xy, np.asarray(self.data.items.labels[rows], dtype=np.int64),
                                            f"gallery, {used} of trunk features (colour = class; ★ = the query)")
            # UMAP's `transform` keeps the rows it was fitted on: held here too, so the cache counts them
            return {"proj": proj, "pixels": pixels(img), "to_pixel": to_pixel,
                    "fitted_on": X if used == "UMAP" else np.zeros(0, np.float32)}
        base = keep("gallery-map", self.served.digest, build=make)
        return base["proj"], base["pixels"], base["to_pixel"]

    def gallery_map(self, q: Query | None = None) -> Image.Image:
        """The gallery's 2-D map (`map_base`), coloured by class; the query starred on a copy."""
        proj, base, to_pixel = self.map_base()
        img = Image.fromarray(base).copy()
        if q is not None and proj is not None:
            x, y = to_pixel(proj(self.searcher.prepare_queries(q.feats))[0])
            render.draw_star(img, x, y)
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
