"""Strategy × re-ranker: does a ranking refinement add to a metric refinement, overlap it, or cancel it?

For each swept (strategy, mode), one setting: the one validation chose within that
(strategy, mode) when validation features are given, else the strategy's defaults.  Each setting
is then searched under every re-ranker (at its registered defaults) through the one search path
(`SearchConfig.search`), query = gallery with the query's own item left out of its own
re-ranking, and scored with the evaluator's per-query metrics.  The validation-selected cell of
the whole matrix is reported on test (the honest number).
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
from tqdm import tqdm

from evaluation.evaluator import DEFAULT_KS, per_query_metrics

from ..backends.search import Searcher
from ..backends.store import in_memory_index
from ..refinements import REFINEMENTS, strategy_label
from ..rerankers import RERANKERS
from ..search_config import NO_RERANK, SearchConfig

log = logging.getLogger("index")
METRICS = ("map@r", "precision@1", "r_precision", "recall@1", "recall@2", "recall@4", "recall@8")
BATCH = 512  # queries per re-ranking call: bounds the candidate matrices a re-ranker holds


def rerank_split(searcher: Searcher, cfg: SearchConfig, labels: np.ndarray, ks=DEFAULT_KS) -> dict:
    """Mean metrics of `cfg` (strategy, mode, re-ranker) on one split, query = gallery (leave-one-out)."""
    labels = np.asarray(labels)
    n = len(labels)
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    R = counts[inverse] - 1
    valid = np.flatnonzero(R > 0)
    k_need = int(max(R.max(initial=0), max(ks)))
    k = min(k_need, n - 1)
    X = np.asarray(searcher.data.features, dtype=np.float32)
    sums = {m: 0.0 for m in METRICS}
    for s in range(0, len(valid), BATCH):
        rows = valid[s: s + BATCH]
        hits = cfg.search(searcher, X[rows], k, self_ids=rows)
        got = hits.rows
        nbr = np.where(got >= 0, labels[np.maximum(got, 0)], np.iinfo(np.int64).min)
        if nbr.shape[1] < k_need:  # fewer gallery items than needed: missing ranks count as misses
            nbr = np.concatenate([nbr, np.full((len(rows), k_need - nbr.shape[1]), np.iinfo(np.int64).min)], 1)
        for key, v in per_query_metrics(nbr, labels[rows], R[rows], ks).items():
            if key in sums:
                sums[key] += float(v.sum())
    nq = len(valid)
    return {m: (v / nq if nq else float("nan")) for m, v in sums.items()} | {"n_queries": int(nq)}


def chosen_settings(test_agg: list[dict], val_agg: list[dict] | None) -> list[SearchConfig]:
    """One setting per swept (strategy, mode): validation's choice within it, else the defaults."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in val_agg or test_agg:
        groups.setdefault((r["strategy"], r["mode"]), []).append(r)
    out = []
    for (name, mode), rows in groups.items():
        if val_agg:
            params = max(rows, key=lambda r: r["map@r"])["params"]
        else:
            params = dataclasses.asdict(REFINEMENTS.params(name, {}))
            if "seed" in params:
                params["seed"] = 0
        out.append(SearchConfig.of(name, params, mode))
    return out


def rerank_matrix(splits: dict, W: np.ndarray, settings: list[SearchConfig], rerankers: tuple[str, ...],
                  normalize: bool = True, progress: bool = True) -> dict:
    """{split: [row per (setting, re-ranker)]} for splits = {name: (features, labels)}."""
    names = tuple(dict.fromkeys((NO_RERANK, *rerankers)))
    out: dict[str, list[dict]] = {}
    for split, (features, labels) in splits.items():
        s = Searcher(in_memory_index(features, labels, W, normalize), cache_size=2)
        rows = []
        todo = [(c, r) for c in settings for r in names]
        for cfg, name in tqdm(todo, desc=f"{split} strategy × re-ranker", disable=not progress):
            c = SearchConfig.of(cfg.strategy, cfg.params, cfg.mode, name)
            res = rerank_split(s, c, labels)
            rows.append({"strategy": c.strategy, "params": dict(c.params), "mode": c.mode, "rerank": name,
                         "rerank_params": dict(c.rerank_params), **res})
        out[split] = rows
    return out


def _setting_label(row: dict) -> str:
    return f"{strategy_label(row['strategy'], row['params'])} [{row['mode']}]"


def matrix_table(rows: list[dict], val_rows: list[dict] | None) -> dict:
    """The matrix (a row per setting, a column per re-ranker, Δ against `none` of the same
    setting), and the validation-selected cell reported on test."""
    by_setting: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_setting.setdefault(_setting_label(r), {})[r["rerank"]] = r
    rerankers = list(dict.fromkeys(r["rerank"] for r in rows))
    table = []
    for setting, cells in by_setting.items():
        base = cells.get(NO_RERANK)
        table.append({"setting": setting, "cells": {
            n: {"map@r": c["map@r"], "recall@1": c["recall@1"],
                "delta_map@r": None if base is None else c["map@r"] - base["map@r"],
                "delta_recall@1": None if base is None else c["recall@1"] - base["recall@1"]}
            for n, c in cells.items()}})
    selected = None
    if val_rows:
        best = max(val_rows, key=lambda r: r["map@r"])
        t = next(r for r in rows if _setting_label(r) == _setting_label(best) and r["rerank"] == best["rerank"])
        selected = {"setting": _setting_label(best), "rerank": best["rerank"], "val_map@r": best["map@r"],
                    "map@r": t["map@r"], "recall@1": t["recall@1"]}
    return {"rerankers": rerankers, "rows": table, "selected": selected}


def matrix_markdown(m: dict) -> str:
    names = m["rerankers"]
    lines = ["| setting | " + " | ".join(f"{n}: MAP@R (Δ) · R@1 (Δ)" if n != NO_RERANK else "none: MAP@R · R@1"
                                        for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for row in m["rows"]:
        cells = []
        for n in names:
            c = row["cells"].get(n)
            if c is None:
                cells.append("—")
            elif n == NO_RERANK:
                cells.append(f"{c['map@r'] * 100:.2f} · {c['recall@1'] * 100:.2f}")
            else:
                cells.append(f"{c['map@r'] * 100:.2f} ({c['delta_map@r'] * 100:+.2f}) · "
                             f"{c['recall@1'] * 100:.2f} ({c['delta_recall@1'] * 100:+.2f})")
        lines.append(f"| {row['setting']} | " + " | ".join(cells) + " |")
    sel = m["selected"]
    if sel:
        lines += ["", f"Validation-selected cell: {sel['setting']} + {sel['rerank']} (val MAP@R "
                      f"{sel['val_map@r'] * 100:.2f}) → test MAP@R {sel['map@r'] * 100:.2f}, "
                      f"R@1 {sel['recall@1'] * 100:.2f}."]
    return "\n".join(lines) + "\n"


def known(names: tuple[str, ...]) -> tuple[str, ...]:
    """The names, each checked against the registry (an unknown one: the registry's refusal)."""
    for n in names:
        RERANKERS.get(n)
    return names


def best_reranker(test: tuple, val: tuple, W: np.ndarray, cfg: SearchConfig, rerankers: tuple[str, ...],
                  normalize: bool = True) -> dict:
    """The re-ranker (at its defaults) that validation prefers on top of `cfg`, reported on test
    beside `cfg` alone: {"setting", "rerank", "val_map@r" per re-ranker, "test": metrics,
    "test_none": metrics}."""
    sv = Searcher(in_memory_index(val[0], val[1], W, normalize), cache_size=2)
    on_val = {n: rerank_split(sv, SearchConfig.of(cfg.strategy, cfg.params, cfg.mode, n), val[1])["map@r"]
              for n in rerankers}
    best = max(on_val, key=lambda n: on_val[n])
    st = Searcher(in_memory_index(test[0], test[1], W, normalize), cache_size=2)
    return {"setting": cfg.label(), "rerank": best, "val_map@r": on_val,
            "test": rerank_split(st, SearchConfig.of(cfg.strategy, cfg.params, cfg.mode, best), test[1]),
            "test_none": rerank_split(st, SearchConfig.of(cfg.strategy, cfg.params, cfg.mode), test[1])}
