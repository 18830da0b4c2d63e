"""Strategy × re-ranker: does a ranking refinement add to a metric refinement, overlap it, or cancel it?

For each swept (strategy, mode), one setting: the one validation chose within that
(strategy, mode) when validation features are given, else the strategy's defaults.  Each setting
is then searched under every re-ranker through the one search path (`SearchConfig.search`),
query = gallery with the query's own item left out of its own re-ranking, and scored with the
evaluator's per-query metrics.  A re-ranker's parameters are chosen as a strategy's are: with
validation features, each setting of its declared grid (`RerankerSpec.grid`; the coarse grid:
every other value of each parameter, both ends and the default kept) is scored on the
validation classes and the best by MAP@R is reported on test; without them, its defaults.  The
validation-selected cell of the whole matrix is reported on test (the honest number).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging

import numpy as np
from tqdm import tqdm

from core.errors import UserError
from evaluation.evaluator import DEFAULT_KS, per_query_metrics

from ..backends.search import Searcher
from ..backends.store import in_memory_index
from ..refinements import REFINEMENTS, coarse, strategy_label
from ..rerankers import RERANKERS, reranker_params
from ..search_config import NO_RERANK, SearchConfig

log = logging.getLogger("index")
METRICS = ("map@r", "precision@1", "r_precision", "recall@1", "recall@2", "recall@4", "recall@8")
BATCH = 512  # queries per re-ranking call: bounds the candidate matrices a re-ranker holds


def rerank_split(searcher: Searcher, cfg: SearchConfig, labels: np.ndarray, ks=DEFAULT_KS,
                 queries: int | None = None) -> dict:
    """Mean metrics of `cfg` (strategy, mode, re-ranker) on one split, query = gallery (leave-one-out).
    `queries`: only that many of the split's items as queries (a fixed draw; the gallery stays whole)."""
    labels = np.asarray(labels)
    n = len(labels)
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    R = counts[inverse] - 1
    valid = np.flatnonzero(R > 0)
    if queries is not None and queries < len(valid):
        valid = np.sort(np.random.default_rng(0).choice(valid, queries, replace=False))
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


def reranker_grid(name: str, grid_name: str = "full") -> list[dict]:
    """The parameter settings a sweep tries for re-ranker `name`: every combination of its declared
    grid (`coarse`: every other value of each parameter, both ends and the default kept), the
    others at their defaults; combinations its validation refuses (kreciprocal's k2 > k1 + 1) are
    left out.  A re-ranker without a grid: its defaults alone."""
    grid = RERANKERS.get(name).spec.grid
    defaults = RERANKERS.get(name).param_defaults()
    if grid_name == "coarse":
        grid = {k: tuple(sorted(set(coarse(tuple(v))) | {defaults[k]})) for k, v in grid.items()}
    out = []
    for values in itertools.product(*grid.values()):
        p = dict(zip(grid, values, strict=True))
        try:
            reranker_params(name, p)
        except UserError:
            continue
        out.append(p)
    return out or [{}]


def choose_params(searcher: Searcher, cfg: SearchConfig, name: str, labels: np.ndarray, grid_name: str = "full",
                  queries: int | None = None, progress=None) -> tuple[dict, list[dict]]:
    """The grid setting of re-ranker `name` with the best MAP@R on top of `cfg` on this (validation)
    split: (its parameters, every setting tried with its MAP@R)."""
    tried = []
    for p in reranker_grid(name, grid_name):
        res = rerank_split(searcher, SearchConfig.of(cfg.strategy, cfg.params, cfg.mode, name, p), labels,
                           queries=queries)
        tried.append({"rerank_params": p, "map@r": res["map@r"]})
        if progress is not None:
            progress.update()
    best = max(tried, key=lambda t: t["map@r"])  # ties: the first, the grid's order
    return best["rerank_params"], tried


def rerank_matrix(splits: dict, W: np.ndarray, settings: list[SearchConfig], rerankers: tuple[str, ...],
                  normalize: bool = True, progress: bool = True, grid_name: str = "full",
                  val_queries: int | None = None) -> dict:
    """{split: [row per (setting, re-ranker)]} for splits = {name: (features, labels)}.  With a
    "val" split, each re-ranker's parameters are chosen on it from its grid (`choose_params`,
    scored on `val_queries` of its items at most) and every split reports that choice; the rows
    carry it ("rerank_params") and what was tried ("tried")."""
    names = tuple(dict.fromkeys((NO_RERANK, *rerankers)))
    searchers = {split: Searcher(in_memory_index(f, y, W, normalize)) for split, (f, y) in splits.items()}
    chosen: dict[tuple, tuple[dict, list]] = {}
    if "val" in splits:
        todo = [(c, r) for c in settings for r in names]
        total = sum(len(reranker_grid(r, grid_name)) for _, r in todo)
        with tqdm(total=total, desc="val re-ranker grids", disable=not progress) as bar:
            for cfg, name in todo:
                chosen[(cfg.key(), name)] = choose_params(searchers["val"], cfg, name, splits["val"][1], grid_name,
                                                          val_queries, bar)
    out: dict[str, list[dict]] = {}
    for split, (_, labels) in splits.items():
        rows = []
        todo = [(c, r) for c in settings for r in names]
        for cfg, name in tqdm(todo, desc=f"{split} strategy × re-ranker", disable=not progress):
            given, tried = chosen.get((cfg.key(), name), ({}, []))
            c = SearchConfig.of(cfg.strategy, cfg.params, cfg.mode, name, given)
            res = rerank_split(searchers[split], c, labels)
            rows.append({"strategy": c.strategy, "params": dict(c.params), "mode": c.mode, "rerank": name,
                         "rerank_params": dict(c.rerank_params), "chosen": dict(given), "tried": tried, **res})
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
            n: {"map@r": c["map@r"], "recall@1": c["recall@1"], "chosen": c.get("chosen", {}),
                "delta_map@r": None if base is None else c["map@r"] - base["map@r"],
                "delta_recall@1": None if base is None else c["recall@1"] - base["recall@1"]}
            for n, c in cells.items()}})
    selected = None
    if val_rows:
        best = max(val_rows, key=lambda r: r["map@r"])
        t = next(r for r in rows if _setting_label(r) == _setting_label(best) and r["rerank"] == best["rerank"])
        selected = {"setting": _setting_label(best), "rerank": best["rerank"], "val_map@r": best["map@r"],
                    "rerank_params": best.get("chosen", {}), "map@r": t["map@r"], "recall@1": t["recall@1"]}
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
    tuned = [n for n in names if n != NO_RERANK and any(row["cells"].get(n, {}).get("chosen") for row in m["rows"])]
    if tuned:
        lines += ["", "Parameters chosen on validation from each re-ranker's grid (the rest at their defaults):", "",
                  "| setting | " + " | ".join(tuned) + " |", "|---|" + "---|" * len(tuned)]
        for row in m["rows"]:
            lines.append(f"| {row['setting']} | " + " | ".join(
                params_text(row["cells"].get(n, {}).get("chosen", {})) or "—" for n in tuned) + " |")
    sel = m["selected"]
    if sel:
        chosen = params_text(sel.get("rerank_params", {}))
        lines += ["", f"Validation-selected cell: {sel['setting']} + {sel['rerank']}"
                      f"{f'({chosen})' if chosen else ''} (val MAP@R {sel['val_map@r'] * 100:.2f}) → test MAP@R "
                      f"{sel['map@r'] * 100:.2f}, R@1 {sel['recall@1'] * 100:.2f}."]
    return "\n".join(lines) + "\n"


def params_text(params: dict) -> str:
    """k1=20, k2=6 (a re-ranker's chosen parameters, as a label writes them)."""
    return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def known(names: tuple[str, ...]) -> tuple[str, ...]:
    """The names, each checked against the registry (an unknown one: the registry's refusal)."""
    for n in names:
        RERANKERS.get(n)
    return names


def best_reranker(test: tuple, val: tuple, W: np.ndarray, cfg: SearchConfig, rerankers: tuple[str, ...],
                  normalize: bool = True, grid_name: str = "coarse", val_queries: int | None = None) -> dict:
    """The re-ranker and parameters that validation prefers on top of `cfg` (each re-ranker's
    grid, `reranker_grid(name, grid_name)`, scored on `val_queries` validation items at most),
    reported on test beside `cfg` alone: {"setting", "rerank", "rerank_params", "val_map@r" per
    re-ranker (its best setting), "tried" per re-ranker, "test": metrics, "test_none": metrics}."""
    sv = Searcher(in_memory_index(val[0], val[1], W, normalize))
    chosen = {n: choose_params(sv, cfg, n, val[1], grid_name, val_queries) for n in rerankers}
    on_val = {n: max(t["map@r"] for t in tried) for n, (_, tried) in chosen.items()}
    best = max(on_val, key=lambda n: on_val[n])
    params = chosen[best][0]
    st = Searcher(in_memory_index(test[0], test[1], W, normalize))
    return {"setting": cfg.label(), "rerank": best, "rerank_params": params, "val_map@r": on_val,
            "tried": {n: tried for n, (_, tried) in chosen.items()},
            "test": rerank_split(st, SearchConfig.of(cfg.strategy, cfg.params, cfg.mode, best, params), test[1]),
            "test_none": rerank_split(st, SearchConfig.of(cfg.strategy, cfg.params, cfg.mode), test[1])}
