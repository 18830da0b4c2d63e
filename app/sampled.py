"""The Compare tab on any backend and at any size: per-query AP (MAP@R, leave-one-out) of two
configurations over every query up to a size (app/limits.py's COMPARE_ALL_UP_TO gallery items,
`--compare-all-up-to`), above it over a seeded random sample of the queries (COMPARE_SAMPLE,
`--compare-sample`), each figure with its bootstrap 95% interval.

Each query is searched through the gallery (`Gallery.search`, its own row dropped from a
one-deeper list; with a re-ranker `SearchConfig.search` with the row left out) to depth
max(R, NEIGHBOURS): its AP reads the top R, Jaccard@k the top NEIGHBOURS, as
index/analysis/compare.py's whole-index comparison does.  Its features are read by row from
the backend (memory-mapped file or the collection), only the sample's, and so are the labels of
the items a collection returns (its sample drawn from rows, each query's relevant count from its
class's size: no pass over every item).  Each side (a
configuration over a set of queries) is kept in the process's memory cache (app/cache.py):
computed once however many requests ask for it at the same time.  The faiss backend up to that
size keeps the batched whole-index comparison (`Comparer`).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from core.errors import UserError
from evaluation.evaluator import per_query_metrics, relevant_counts
from index.analysis.compare import NEIGHBOURS, Comparison, Progress, bootstrap_ci, jaccard_at_k
from index.search_config import NO_RERANK, SearchConfig

from .backend import Served, items_at
from .cache import keep

CHUNK = 32                  # queries searched together


@dataclass
class SampledComparison(Comparison):
    """A `Comparison` over `len(ids)` queries drawn (seeded) from `population`; population 0:
    every query was compared."""
    population: int = 0

    def intervals(self) -> dict[str, tuple[float, float]]:
        """Bootstrap 95% intervals (numpy's Generator(seed)) of MAP@R left and right, the mean AP
        difference and the mean Jaccard@k."""
        out = {"map_a": bootstrap_ci(self.ap_a, self.seed), "map_b": bootstrap_ci(self.ap_b, self.seed),
               "mean_delta": bootstrap_ci(self.delta, self.seed)}
        if self.jaccard is not None:
            out["mean_jaccard"] = bootstrap_ci(self.jaccard, self.seed)
        return out

    def summary(self) -> dict:
        s = super().summary() | {"sampled": bool(self.population), "population": self.population}
        return s | {"ci95_" + k: v for k, v in self.intervals().items()} if self.population else s

    def summary_text(self) -> str:
        text = super().summary_text()
        if not self.population:
            return text
        iv = self.intervals()
        cis = " · ".join(f"{name} [{iv[key][0]:.4f}, {iv[key][1]:.4f}]" for key, name in
                         (("map_a", "MAP@R left"), ("map_b", "MAP@R right"), ("mean_jaccard", f"Jaccard@{self.k}"))
                         if key in iv)
        return (f"sample of {len(self.ids):,} of {self.population:,} queries (seed {self.seed}) · {text} · "
                f"bootstrap 95% intervals: {cis}")


def sample_rows(valid: np.ndarray, size: int, seed: int) -> np.ndarray:
    """`size` of the rows `valid`, drawn without replacement by numpy's Generator(seed), in order."""
    if size < 1:
        raise UserError(f"the sample size must be ≥ 1, got {size}")
    if len(valid) <= size:
        return valid
    return np.sort(np.random.default_rng(seed).choice(valid, size, replace=False))


class GalleryComparer:
    """Per-query AP through the gallery's own search, per configuration and sample, kept in the
    process's memory cache."""

    def __init__(self, served: Served):
        self.served = served

    @cached_property
    def R(self) -> np.ndarray:
        """Each item's relevant count (other items of its class): fixed by the gallery's labels,
        one integer an item, computed once (two first callers compute the same array).  Only a
        gallery whose labels are in memory: a collection's are read by row (`_drawn`)."""
        y = self.served.view.items.labels
        return relevant_counts(y, y, same_set=True)

    def relevant(self, labels: np.ndarray) -> np.ndarray:
        """The relevant count of a query of each of these labels (the other items of its class)."""
        return self.served.class_sizes(labels) - 1

    def rows(self, sample: int | None, seed: int) -> tuple[np.ndarray, int]:
        """(query rows, population): every query (population 0) when `sample` is None, else
        `sample` of them drawn with `seed` (population: how many they were drawn from)."""
        if self.served.by_row:
            return self._drawn(sample, seed)
        valid = np.nonzero(self.R > 0)[0]
        if sample is None:
            return valid, 0
        rows = sample_rows(valid, int(sample), int(seed))
        return rows, (len(valid) if len(rows) < len(valid) else 0)

    def _drawn(self, sample: int | None, seed: int) -> tuple[np.ndarray, int]:
        """`rows` of a gallery read by row: rows drawn with `seed` (4× as many again while fewer
        than `sample` of them have another item of their class), their labels read, the first
        `sample` that have one kept, in row order.  The population is the number of such items
        where the collection stores its class counts, else the gallery's size.  Every row is read
        only when `sample` is None (a gallery of at most `compare_all_up_to` items)."""
        items = self.served.view.items
        n = len(items)

        def with_relevant(rows: np.ndarray) -> np.ndarray:
            return rows[self.relevant(items_at(items, rows).labels) > 0]

        if sample is None:
            return with_relevant(np.arange(n, dtype=np.int64)), 0
        if sample < 1:
            raise UserError(f"the sample size must be ≥ 1, got {sample}")
        draw = min(n, int(sample))
        while True:
            valid = with_relevant(np.random.default_rng(seed).choice(n, draw, replace=False).astype(np.int64))
            if len(valid) >= sample or draw == n:
                break
            draw = min(n, 4 * draw)
        rows = np.sort(valid[: int(sample)])
        g: Any = self.served.gallery
        counts = g.class_counts[1] if g.class_counts is not None else None
        population = int(counts[counts > 1].sum()) if counts is not None else n
        if population <= len(rows) or (draw == n and len(rows) == len(valid)):
            population = 0  # every query that has another item of its class is compared
        return rows, population

    def side(self, cfg: SearchConfig, rows: np.ndarray, progress: Progress | None) -> tuple[np.ndarray, np.ndarray]:
        """(AP, top NEIGHBOURS rows) of the queries `rows` under `cfg` (mode resolved)."""
        queries = hashlib.blake2b(np.ascontiguousarray(rows, dtype=np.int64).tobytes(), digest_size=16).hexdigest()
        # `progress` is the building request's: another request for the same side waits for it
        return keep("sampled-side", self.served.digest, cfg.key(), queries,
                    build=lambda: self._side(cfg, rows, progress))

    def _side(self, cfg: SearchConfig, rows: np.ndarray, progress: Progress | None):
        g, view = self.served.gallery, self.served.view
        y = view.items.labels   # read by row: the queries' and their results' labels only
        n = len(y)
        ap = np.full(len(rows), np.nan)
        top = np.full((len(rows), NEIGHBOURS), -1, dtype=np.int64)
        what = f"searching {len(rows):,} queries under {cfg.label()}"
        for a in range(0, len(rows), CHUNK):
            part = rows[a: a + CHUNK]
            y_part = np.asarray(y[part], dtype=np.int64)
            R = self.relevant(y_part)
            missing = int(y_part.min(initial=0)) - 1  # the label of "no item": none of these queries'
            depth = int(min(n - 1, max(int(R.max(initial=0)), NEIGHBOURS)))
            feats = np.asarray(view.features[part], dtype=np.float32)
            if cfg.rerank == NO_RERANK:
                hits = g.search(feats, cfg.strategy, cfg.params, cfg.mode, depth + 1, what="index features")
                found = without_own_rows(hits.rows, part, depth)
            else:
                found = cfg.search(g, feats, depth, self_ids=part, what="index features").rows
            nbr = np.where(found >= 0, np.asarray(y[np.maximum(found, 0)], dtype=np.int64), missing)
            ap[a: a + len(part)] = per_query_metrics(nbr, y_part, R, ks=(1,))["map@r"]
            m = min(NEIGHBOURS, found.shape[1])
            top[a: a + len(part), :m] = found[:, :m]
            if progress is not None:
                progress(a + len(part), len(rows), what)
        return ap, top

    def compare(self, left: SearchConfig, right: SearchConfig, k: int = 10, seed: int = 0, sample: int | None = None,
                progress: Progress | None = None) -> SampledComparison:
        rows, population = self.rows(sample, seed)
        sides = []
        for cfg in (left, right):
            cfg.check_searchable()
            mode = self.served.gallery.resolve_mode(cfg.strategy, cfg.params, cfg.mode)[0]
            c = cfg.normalized().with_mode(mode)
            sides.append((c, *self.side(c, rows, progress)))
        (ca, a, top_a), (cb, b, top_b) = sides
        k = max(1, min(int(k), NEIGHBOURS))
        items = items_at(self.served.view.items, rows)
        return SampledComparison(ca.label(), cb.label(), items.ids, items.labels, a, b,
                                 dict(self.served.view.class_names), int(seed), jaccard_at_k(top_a, top_b, k), k,
                                 population)


def without_own_rows(found: np.ndarray, own: np.ndarray, depth: int) -> np.ndarray:
    """Each query's list without its own row (`own[i]`), cut to `depth` (−1 padded)."""
    out = np.full((len(found), depth), -1, dtype=np.int64)
    for i, (r, o) in enumerate(zip(found, own, strict=True)):
        kept = r[(r != o) & (r >= 0)][:depth]
        out[i, : len(kept)] = kept
    return out
