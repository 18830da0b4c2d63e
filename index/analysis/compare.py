"""Two metrics over a whole index, query by query: per-query AP, the paired statistics, per class.

Every item is a query against the rest (leave-one-out), scored by MAP@R: one batched sweep
(index/analysis/sweep.py) up to `sweep.MAX_N` items, one chunked exact search above; a side
with a re-ranker through `SearchConfig.search`, `RERANK_CHUNK` queries at a time, its own row
left out.  Each configuration's per-query AP and top `NEIGHBOURS` items (Jaccard@k) are kept in
the process's one memory cache (core.memory.CACHE), keyed by a digest of the gallery's
content and the configuration: built once however many threads ask, and two different
configurations computed at the same time.  The app's Compare tab and `index report` use it;
docs/app-and-compare.md describes both.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from core.errors import CorruptImageError
from core.images import load_rgb
from evaluation.evaluator import evaluate_ranking, per_query_metrics, relevant_counts
from evaluation.knn import knn_chunks

from ..backends.search import Searcher
from ..backends.store import IndexData
from ..refinements import strategy_key
from ..rerankers import ranked_pool
from ..search_config import NO_RERANK, SearchConfig
from ..space import CACHE, fingerprint, key_hash
from .sweep import MAX_N, GramSweep

FILTERS = ("all", "improved", "worsened")
TIE_TOL = 1e-12  # APs are equal when their rankings are: only round-off separates "tied"
NEIGHBOURS = 50  # top items kept per query and configuration: Jaccard@k for k up to this (the app's k ≤ 48)
RERANK_CHUNK = 256  # queries per re-ranked search of a whole-index comparison (progress after each)
Progress = Callable[[int, int, str], None]  # (queries done, queries in all, what) after each chunk
SIGN_TEST_FLOOR = 1e-300  # a p-value below this is shown as a bound (an underflow reads as 0)


def data_digest(data: IndexData) -> str:
    """What a gallery's analyses are kept under: a digest of its content (`space.store.fingerprint`:
    an index directory's checksums, else its arrays), or of a Milvus collection's checksum
    recorded at export and its neck (its vectors are read by row, never hashed whole); with how
    its queries are prepared and searched (normalised or not, the index's factory)."""
    man = data.manifest if isinstance(data.manifest, dict) else {}
    how = [bool(man.get("normalize")), str(man.get("factory", ""))]
    if not man.get("files") and man.get("content_sha256"):
        return key_hash("collection", man["content_sha256"],
                        hashlib.sha256(np.ascontiguousarray(data.W, dtype="<f4").tobytes()).hexdigest(), how)
    return key_hash("gallery", fingerprint(data), how)


def p_value_text(p: float) -> str:
    """'p = 0.0123', or a bound where the p-value is below SIGN_TEST_FLOOR (0 included: the exact
    value underflowed; the smallest positive double is ~4.9e-324)."""
    return "p < 10⁻³⁰⁰" if p < SIGN_TEST_FLOOR else f"p = {p:.3g}"


class QuerySweep(GramSweep):
    """The batched sweep, kept per query: each item's MAP@R and top items under one setting.
    Given `key` (the gallery's digest), ΦΦᵀ and the low-rank EEᵀ, shared by every setting and
    only read, are kept in the process's memory cache; the rest (N × N work buffers) is this
    sweep's own, so sweeps of different settings run at the same time without sharing a buffer."""

    def __init__(self, features: np.ndarray, labels: np.ndarray, W: np.ndarray, key: str | None = None):
        super().__init__(features, labels, W)
        self.key = key

    def gram(self) -> np.ndarray:
        if self._G is None and self.key is not None:  # built as the cache's own, counted from its start
            self._G = CACHE.get_or_build(("analysis.compare", key_hash(self.key, "gram")), self.new_gram,
                                         reserve=self.n * self.n * 4)
        return super().gram()

    def low_rank(self) -> np.ndarray:
        if self._T is None and self.key is not None:
            self._T = CACHE.get_or_build(("analysis.compare", key_hash(self.key, "low-rank")), self.new_low_rank,
                                         reserve=self.n * self.n * 4)
        return super().low_rank()

    def per_query(self, S: torch.Tensor, mode: str, top: int = NEIGHBOURS) -> tuple[np.ndarray, np.ndarray]:
        """(MAP@R of every item, NaN where it has no other item of its class; its `top` first
        rows, −1 where there are fewer or it is no query); S is not modified."""
        ap = np.full(self.n, np.nan)
        nbr = np.full((self.n, top), -1, dtype=np.int64)
        k = min(max(int(self.R.max(initial=0)), top), self.n - 1)  # R ≤ n − 1: every needed rank exists
        for rows, idx in self.ranked(S, mode, k):
            ap[rows] = per_query_metrics(self.labels[idx], self.labels[rows], self.R[rows], ks=(1,))["map@r"]
            nbr[rows, : min(top, k)] = idx[:, :top]
        return ap, nbr


def jaccard_at_k(a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """Per row, |A ∩ B| / |A ∪ B| of the first k entries of a and of b (item rows, each row's
    entries distinct; −1 is no item); 1 where both are empty."""
    both = np.sort(np.concatenate([a[:, :k], b[:, :k]], axis=1), axis=1)
    real = both >= 0
    inter = ((both[:, 1:] == both[:, :-1]) & real[:, 1:]).sum(axis=1)
    union = real.sum(axis=1) - inter
    return np.where(union > 0, inter / np.maximum(union, 1), 1.0)


def sign_test(improved: int, worsened: int) -> float:
    """Two-sided exact sign test of improved vs worsened (ties dropped); 1 when none differ."""
    from scipy.stats import binomtest

    n = improved + worsened
    return float(binomtest(improved, n, 0.5, alternative="two-sided").pvalue) if n else 1.0


def bootstrap_ci(values: np.ndarray, seed: int = 0, n_boot: int = 2000, level: float = 0.95,
                 chunk: int = 250) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean: `n_boot` resamples with replacement, drawn
    `chunk` at a time from numpy's Generator(seed) (memory stays chunk × n)."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = np.concatenate([values[rng.integers(0, len(values), size=(min(chunk, n_boot - b), len(values)))].mean(1)
                            for b in range(0, n_boot, chunk)])
    lo, hi = np.percentile(means, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


@dataclass
class Comparison:
    """Per-query AP of the same queries under configuration A (x, the left side) and B (y, the
    right side), and how much their top-k lists overlap (Jaccard@k, where computed)."""
    label_a: str
    label_b: str
    ids: np.ndarray            # item ids of the queries (those with a relevant item)
    labels: np.ndarray
    ap_a: np.ndarray
    ap_b: np.ndarray
    class_names: dict = field(default_factory=dict)
    seed: int = 0
    jaccard: np.ndarray | None = None  # per query: Jaccard of the two top-k lists
    k: int = 0                         # the k of `jaccard`

    @property
    def delta(self) -> np.ndarray:
        return self.ap_b - self.ap_a

    def outcome(self) -> np.ndarray:
        """+1 improved, −1 worsened, 0 tied, per query."""
        d = self.delta
        return np.where(d > TIE_TOL, 1, np.where(d < -TIE_TOL, -1, 0))

    def counts(self) -> dict:
        o = self.outcome()
        return {"queries": int(len(o)), "improved": int((o > 0).sum()), "worsened": int((o < 0).sum()),
                "tied": int((o == 0).sum())}

    def summary(self) -> dict:
        c = self.counts()
        lo, hi = bootstrap_ci(self.delta, self.seed)
        out = c | {"map_a": float(self.ap_a.mean()) if len(self.ap_a) else float("nan"),
                   "map_b": float(self.ap_b.mean()) if len(self.ap_b) else float("nan"),
                   "mean_delta": float(self.delta.mean()) if len(self.delta) else float("nan"),
                   "ci95": (lo, hi), "sign_test_p": sign_test(c["improved"], c["worsened"])}
        if self.jaccard is not None:
            out["mean_jaccard"] = float(self.jaccard.mean()) if len(self.jaccard) else float("nan")
        return out

    def summary_text(self) -> str:
        s = self.summary()
        text = (f"{s['queries']:,} queries: {s['improved']:,} improved, {s['worsened']:,} worsened, "
                f"{s['tied']:,} tied · MAP@R {s['map_a']:.4f} → {s['map_b']:.4f} · mean ΔAP {s['mean_delta']:+.4f} "
                f"(bootstrap 95% CI [{s['ci95'][0]:+.4f}, {s['ci95'][1]:+.4f}]) · two-sided sign test "
                f"{p_value_text(s['sign_test_p'])}")
        if "mean_jaccard" in s:
            text += f" · mean top-{self.k} overlap (Jaccard@{self.k}) {s['mean_jaccard']:.3f}"
        return text

    def class_name(self, label: int) -> str:
        return self.class_names.get(int(label), str(int(label)))

    def row(self, i: int) -> dict:
        out = {"id": int(self.ids[i]), "label": int(self.labels[i]), "class_name": self.class_name(self.labels[i]),
               "ap_a": float(self.ap_a[i]), "ap_b": float(self.ap_b[i]), "delta": float(self.delta[i])}
        if self.jaccard is not None:
            out["jaccard"] = float(self.jaccard[i])
        return out

    def _overlap_at_most(self, max_jaccard: float | None) -> np.ndarray:
        if max_jaccard is None or self.jaccard is None:
            return np.ones(len(self.ids), dtype=bool)
        return self.jaccard <= max_jaccard + TIE_TOL

    def disagreements(self, which: str = "all", top: int | None = None, label: int | None = None,
                      max_jaccard: float | None = None) -> list[dict]:
        """Queries by |ΔAP|, largest first (ties by position): `which` of FILTERS (all: every
        query that changed), optionally of one class, optionally only those whose top-k lists
        overlap at most `max_jaccard`."""
        if which not in FILTERS:
            raise ValueError(f"filter must be one of {FILTERS}, got {which!r}")
        o = self.outcome()
        keep = {"all": o != 0, "improved": o > 0, "worsened": o < 0}[which] & self._overlap_at_most(max_jaccard)
        if label is not None:
            keep = keep & (self.labels == label)
        rows = np.nonzero(keep)[0]
        rows = rows[np.argsort(-np.abs(self.delta[rows]), kind="stable")][:top]
        return [self.row(int(i)) for i in rows]

    def class_queries(self, label: int) -> list[dict]:
        """Every query of one class, largest |ΔAP| first."""
        rows = np.nonzero(self.labels == label)[0]
        return [self.row(i) for i in rows[np.argsort(-np.abs(self.delta[rows]), kind="stable")]]

    def per_class(self) -> list[dict]:
        """Per class: its queries n, mean AP under A and B, Δ and, where computed, the mean
        Jaccard@k of its queries' two top-k lists (by label)."""
        out = []
        for c in np.unique(self.labels):
            m = self.labels == c
            a, b = float(self.ap_a[m].mean()), float(self.ap_b[m].mean())
            row = {"label": int(c), "class_name": self.class_name(c), "n": int(m.sum()), "ap_a": a, "ap_b": b,
                   "delta": b - a}
            if self.jaccard is not None:
                row["jaccard"] = float(self.jaccard[m].mean())
            out.append(row)
        return out


class Comparer:
    """Per-query AP of whole-index leave-one-out retrieval, one batched pass per setting.  Every
    result is kept in the process's memory cache (module doc) under a digest of the gallery (`key`)
    and the configuration: no lock here, so two different comparisons run at once and the same
    one runs once (a second caller waits for the first's result)."""

    def __init__(self, data: IndexData, searcher: Searcher | None = None, key: str | None = None):
        """`key`: the gallery's digest where the caller has it (default: `data_digest(data)`,
        computed at the first comparison)."""
        self.data = data
        self.searcher = searcher or Searcher(data)
        self._key = key

    @property
    def key(self) -> str:
        """A digest of what every result here depends on: the gallery's content, and how it is
        searched (an exact index or not, candidates read per result)."""
        if self._key is None:  # two threads may both compute it: the same string
            self._key = key_hash("compare", data_digest(self.data), bool(self.searcher.exact),
                                 int(self.searcher.rerank_factor))
        return self._key

    def _kept(self, what: str, *parts, build: Callable[[], dict]) -> dict:
        return CACHE.get_or_build(("analysis.compare", key_hash(self.key, what, *parts)), build)

    def resolve(self, strategy: str, params: dict | None, mode: str) -> str:
        return self.searcher.resolve_mode(strategy, params or {}, mode)[0]

    def batched(self) -> bool:
        """Whether a configuration without a re-ranker takes the batched sweep (else the search path)."""
        return bool(self.searcher.exact) and len(self.data.items) <= MAX_N

    def _per_query_key(self, strategy: str, params: dict | None, mode: str) -> tuple:
        rm = self.searcher.metric(strategy, params)
        # the path too: the two agree up to floating-point ties, and only the sweep gives the top lists
        return "per-query", "sweep" if self.batched() else "search", strategy_key(strategy, rm.params), mode

    def _entry(self, strategy: str, params: dict | None, mode: str) -> dict:
        rm = self.searcher.metric(strategy, params)
        return self._kept(*self._per_query_key(strategy, params, mode),
                          build=lambda: self._compute(rm, strategy, params, mode))

    def holds(self, cfg: SearchConfig) -> bool:
        """Whether the per-query AP of `cfg` (its mode as given, its re-ranker included) is kept now."""
        if cfg.rerank == NO_RERANK:
            parts = self._per_query_key(cfg.strategy, cfg.params, cfg.mode)
        else:
            parts = ("reranked", cfg.normalized().key())
        return CACHE.peek(("analysis.compare", key_hash(self.key, *parts))) is not None

    def per_query_ap(self, strategy: str = "trained", params: dict | None = None, mode: str = "cosine") -> np.ndarray:
        """MAP@R of every index item as a query, in index order (NaN: no other item of its class).
        `mode` is used as given (resolve an indefinite M′'s cosine first: `resolve`)."""
        return self._entry(strategy, params, mode)["ap"]

    def neighbours(self, strategy: str = "trained", params: dict | None = None, mode: str = "cosine") -> np.ndarray:
        """Each item's first `NEIGHBOURS` rows as a query (itself left out; −1: none), in index order."""
        entry = self._entry(strategy, params, mode)
        if entry["top"] is not None:  # the batched pass gives them with the APs
            return entry["top"]
        rm = self.searcher.metric(strategy, params)
        return self._kept("neighbours", strategy_key(strategy, rm.params), mode,
                          build=lambda: {"top": self._search_neighbours(strategy, params, mode)})["top"]

    def ap(self, cfg: SearchConfig, progress: Progress | None = None) -> np.ndarray:
        """`per_query_ap` of a configuration (its mode as given), its re-ranker included."""
        if cfg.rerank == NO_RERANK:
            return self.per_query_ap(cfg.strategy, cfg.params, cfg.mode)
        return self._reranked(cfg, progress)["ap"]

    def top(self, cfg: SearchConfig, progress: Progress | None = None) -> np.ndarray:
        """`neighbours` of a configuration (its mode as given), its re-ranker included."""
        if cfg.rerank == NO_RERANK:
            return self.neighbours(cfg.strategy, cfg.params, cfg.mode)
        return self._reranked(cfg, progress)["top"]

    def _reranked(self, cfg: SearchConfig, progress: Progress | None) -> dict:
        cfg = cfg.normalized()  # typed parameters, defaults filled in: one cache entry per configuration
        # `progress` is the building caller's: another caller of the same configuration waits for it
        return self._kept("reranked", cfg.key(), build=lambda: self._compute_reranked(cfg, progress))

    def _compute_reranked(self, cfg: SearchConfig, progress: Progress | None) -> dict:
        """Every item that has a relevant item as a query, re-ranked with itself left out.  A
        query's AP reads its top R, its top list the top NEIGHBOURS: one pass at the larger of
        the two serves both, as the first entries of a re-ranked list do not depend on how many
        are asked for while that stays within the re-ranker's candidate pool; a need beyond the
        pool (a class larger than it, or NEIGHBOURS) gets a pass at exactly that k."""
        y = self.data.items.labels
        n = len(y)
        R = relevant_counts(y, y, same_set=True)
        valid = np.nonzero(R > 0)[0]
        ap = np.full(n, np.nan)
        top = np.full((n, NEIGHBOURS), -1, dtype=np.int64)
        missing = int(y.min(initial=0)) - 1  # the label of "no item": never a query's
        pool = ranked_pool(cfg.rerank, cfg.rerank_params, 1, n)
        deepest = max(1, n - 1)
        want_top = min(NEIGHBOURS, deepest)
        K = min(max(int(R.max(initial=0)), want_top), deepest if pool is None else min(pool, deepest))
        jobs = [(valid, K)]  # (queries, k): the passes, each query's AP and top list from the first that serves it
        jobs += [(valid[R[valid] == r], int(r)) for r in np.unique(R[valid]) if r > K]
        if want_top > K:
            jobs.append((valid, want_top))
        total, done = sum(len(rows) for rows, _ in jobs), 0
        what = f"re-ranking every query under {cfg.label()}"
        if progress is not None:
            progress(0, total, what)
        for queries, k in jobs:
            for a in range(0, len(queries), RERANK_CHUNK):
                rows = queries[a: a + RERANK_CHUNK]
                hits = cfg.search(self.searcher, np.asarray(self.data.features[rows], dtype=np.float32), k,
                                  self_ids=rows, what="index features")
                mine = R[rows] <= k if k == K else R[rows] == k  # the queries whose AP this pass gives
                if mine.any():
                    nbr = np.where(hits.rows >= 0, y[np.maximum(hits.rows, 0)], missing)
                    ap[rows[mine]] = per_query_metrics(nbr[mine], y[rows[mine]], R[rows[mine]], ks=(1,))["map@r"]
                if k == want_top or (k == K and K >= want_top):
                    m = min(want_top, hits.k)
                    top[rows, :m] = hits.rows[:, :m]
                done += len(rows)
                if progress is not None:
                    progress(done, total, what)
        return {"ap": ap, "top": top}

    def _compute(self, rm, strategy, params, mode) -> dict:
        y = self.data.items.labels
        if self.batched():
            if mode == "cosine" and not rm.report["psd"]:
                self.searcher.query_view(strategy, params, mode)  # raises the search path's refusal
            # the features as they are (a memory map or the Flat index's own vectors: float32, no
            # copy); this sweep's N × N buffers live for this one pass
            sweep = QuerySweep(self.data.features, y, self.data.W, key=self.key)
            ap, top = sweep.per_query(sweep.scores(rm.M, rm.op), mode)
            return {"ap": ap, "top": top}
        transform, index, _ = self.searcher.query_view(strategy, params, mode)
        q = self.searcher.prepare_queries(np.asarray(self.data.features, dtype=np.float32))
        res = evaluate_ranking(index, transform(q), y, y, same_set=True, ks=(1,), return_per_query=True)
        return {"ap": res["per_query"]["map@r"], "top": None}  # the top lists: a search of their own, when asked

    def _search_neighbours(self, strategy, params, mode) -> np.ndarray:
        transform, index, _ = self.searcher.query_view(strategy, params, mode)
        n = len(self.data.items)
        top = np.full((n, NEIGHBOURS), -1, dtype=np.int64)
        q = transform(self.searcher.prepare_queries(np.asarray(self.data.features, dtype=np.float32)))
        for rows, _, ids in knn_chunks(q, index, NEIGHBOURS, self_ids=np.arange(n)):
            top[rows, : ids.shape[1]] = ids
        return top

    def compare(self, left: SearchConfig, right: SearchConfig, seed: int = 0, k: int = 10,
                progress: Progress | None = None) -> Comparison:
        """Configuration `left` (x) against `right` (y), each mode resolved (an indefinite M′ has no
        cosine) and each re-ranker run, over the queries that have a relevant item; Jaccard@k of
        their top-k lists (k capped at NEIGHBOURS).  `progress`: called while a re-ranked side
        is computed (nothing else takes long enough to need it)."""
        sides = []
        for cfg in (left, right):
            cfg.check_searchable()
            c = cfg.normalized().with_mode(self.resolve(cfg.strategy, cfg.params, cfg.mode))
            sides.append((c, self.ap(c, progress), self.top(c, progress)))
        (ca, a, top_a), (cb, b, top_b) = sides
        ok = ~np.isnan(a)
        k = max(1, min(int(k), NEIGHBOURS))
        return Comparison(ca.label(), cb.label(), self.data.items.ids[ok], self.data.items.labels[ok], a[ok], b[ok],
                          dict(self.data.class_names), seed, jaccard_at_k(top_a[ok], top_b[ok], k), k)


def item_image(data: IndexData, row: int) -> Image.Image | None:
    """The gallery image of one index row, or None where it cannot be read."""
    rel = data.items.paths[row]
    if not rel or not data.root:
        return None
    p = Path(rel) if Path(rel).is_absolute() else Path(data.root) / rel
    try:
        return load_rgb(p)
    except CorruptImageError:
        return None
