"""Evaluating refinement strategies on a split, the paper's way, plus a validation-based choice.

Each strategy is evaluated with the foundation's evaluator through exactly the
search path (`Searcher.query_view`), query = gallery leaving the query out.
The random restraints are averaged over seeds.  "best refined" is the best
strategy *on test* (the paper's † row: an oracle, reported for comparison);
"validation-selected" picks strategy and parameter by MAP@R on the
validation classes, then reports that choice on test: the honest number.
"""
from __future__ import annotations

import itertools
import json
import logging
from collections import defaultdict
from pathlib import Path

import numpy as np
from tqdm import tqdm

from core.atomic import write_json, write_text, write_with
from evaluation.evaluator import DEFAULT_KS, evaluate_ranking

from ..backends.search import Searcher
from ..backends.store import in_memory_index
from ..refinements import REFINEMENTS, coarse, grid, ranks_like_trained, seeded, strategy_label, sweep, sweepable
from .sweep import MAX_N, GramSweep

log = logging.getLogger("index")
METRICS = ("map@r", "precision@1", "r_precision", "recall@1", "recall@2", "recall@4", "recall@8")
# The reference matrices the summary table reports first (strategy, mode, row title); they
# also lead the sweep, so that among equal scores the reference wins the table's choices.
REFERENCE_ROWS = (("trained", "cosine", "trained M* (cosine of embeddings: the usual evaluation)"),
                  ("trained", "bilinear", "trained M* (bilinear φᵀM*φ: our extra view)"),
                  ("identity", "bilinear", "identity (bilinear)"),
                  ("identity", "cosine", "identity (cosine of trunk features)"))
# Diagonal restraint's raw M′ (indefinite in general: bilinear only) beside its PSD readings,
# each at its best r > 0 and mode on test (oracles, as the paper's † row): (strategy, the params
# it must have, row title; no "|" in titles, which would split a markdown table cell)
READING_ROWS: tuple[tuple[str, dict[str, str], str], ...] = (
    ("diagonal", {}, "diagonal restraint, raw M′ (bilinear; best r > 0 on test)"),
    ("diagonal-psd", {"psd": "abs"}, "diagonal restraint, M′ read PSD by abs (best r > 0, mode on test)"),
    ("diagonal-psd", {"psd": "clip"}, "diagonal restraint, M′ read PSD by clip (best r > 0, mode on test)"))
MARKERS = ("o", "s", "^", "v", "*", "P", "D", "X", "<", ">")


def swept_strategies(only: tuple[str, ...] | None = None) -> list[str]:
    """Every strategy that can be swept (or those of `only`): the references first, then the
    others by name."""
    refs = list(dict.fromkeys(name for name, _, _ in REFERENCE_ROWS))
    names = [n for n in refs + [n for n in REFINEMENTS.names() if n not in refs] if sweepable(n)]
    return [n for n in names if only is None or n in only]


def sweep_configs(seeds: int = 3, strategies: tuple[str, ...] | None = None,
                  grid_name: str = "full") -> list[tuple[str, dict, str]]:
    """(strategy, params, mode) of every setting evaluated: each strategy's registered grid
    (`coarse`: every other value of each parameter)."""
    out = []
    for name in swept_strategies(strategies):
        settings = sweep(name, seeds)
        if grid_name == "coarse":
            keep = {p: coarse(v) for p, v in grid(name).items()}
            settings = [(p, m) for p, m in settings if all(p[k] in vs for k, vs in keep.items())]
        out += [(name, params, mode) for params, mode in settings]
    return out


def evaluate_configs(features, labels, W, configs, normalize=True, progress=True, desc="strategies") -> list[dict]:
    """Each setting's metrics on one split, query = gallery, in the order of `configs`."""
    return evaluate_splits({"split": (features, labels)}, W, configs, normalize, progress, desc)["split"]


def evaluate_splits(splits: dict, W, configs, normalize=True, progress=True, desc="strategies") -> dict:
    """{split: each setting's metrics, query = gallery, in the order of `configs`} for
    splits = {name: (features, labels)}.  Each M′ is built once (its eigendecomposition and
    matrix report do not depend on the split) and scored on every split.  Up to sweep.MAX_N
    items a split shares one batched score computation across settings (index/analysis/sweep.py,
    equal to the search path); above, each setting is searched through the search path."""
    parts = {}
    for name, (features, labels) in splits.items():
        s = Searcher(in_memory_index(features, labels, W, normalize))
        q = np.asarray(s.data.features)
        y = s.data.items.labels
        parts[name] = (s, q, y, GramSweep(q, y, s.data.W) if len(y) <= MAX_N else None)
    maker = next(iter(parts.values()))[0]  # M′ depends only on W: any split's searcher builds it
    # one seed's settings in a row: diagonal restraint's draws are nested in r (index/analysis/sweep.py)
    order = sorted(range(len(configs)), key=lambda i: (configs[i][0], configs[i][1].get("seed", -1)))
    rows: dict[str, dict[int, dict]] = {name: {} for name in splits}  # split → config index → row
    like_trained: dict[str, dict[str, dict]] = {name: {} for name in splits}  # split → mode → metrics
    rm, rm_key = None, None
    for i in tqdm(order, desc=desc, disable=not progress):
        strategy, params, mode = configs[i]
        key = (strategy, json.dumps(params, sort_keys=True))
        if key != rm_key:
            rm, rm_key, scored = maker.metric(strategy, params), key, {}
        assert rm is not None  # made at the first setting: rm_key starts as None
        rep = rm.report
        if mode == "cosine" and not rep["psd"]:
            continue
        for name, (s, q, y, batched) in parts.items():
            if ranks_like_trained(strategy, params) and mode in like_trained[name]:
                res = like_trained[name][mode]  # M′ is a positive multiple of M*: the same ranking
            elif batched is not None:
                if name not in scored:  # the modes of one setting share its score matrix
                    scored[name] = batched.scores(rm.M, rm.op)
                res = batched.evaluate(scored[name], mode)
            else:
                transform, index, _ = s.query_view(strategy, params, mode)
                res = evaluate_ranking(index, transform(q), y, y, same_set=True, ks=DEFAULT_KS)
            if ranks_like_trained(strategy, params):
                like_trained[name].setdefault(mode, res)
            rows[name][i] = {"strategy": strategy, "params": dict(params), "mode": mode,
                             **{m: res[m] for m in METRICS}, "n_queries": res["n_queries"],
                             **{f"M_{k}": v for k, v in rep.items()}}
    return {name: [r[i] for i in sorted(r)] for name, r in rows.items()}


def _group_key(row) -> tuple:
    p = {k: v for k, v in row["params"].items() if k != "seed"}
    return (row["strategy"], json.dumps(p, sort_keys=True), row["mode"])


def aggregate(rows: list[dict]) -> list[dict]:
    """Mean ± std over seeds for each (strategy, non-seed params, mode)."""
    groups = defaultdict(list)
    for r in rows:
        groups[_group_key(r)].append(r)
    out = []
    for (name, p, mode), rs in groups.items():
        agg = {"strategy": name, "params": json.loads(p), "mode": mode, "seeds": len(rs)}
        for m in METRICS + ("M_trace_over_frobenius", "M_frobenius_over_trace", "M_trace", "M_frobenius"):
            v = np.array([r[m] for r in rs], dtype=float)
            agg[m] = float(v.mean())
            agg[m + "_std"] = float(v.std())
        agg["M_psd"] = all(r["M_psd"] for r in rs)
        out.append(agg)
    return out


def label(row) -> str:
    return f"{strategy_label(row['strategy'], row['params'])} [{row['mode']}]"


def find(rows, strategy, mode, **params):
    for r in rows:
        if r["strategy"] == strategy and r["mode"] == mode and all(r["params"].get(k) == v for k, v in params.items()):
            return r
    return None


def is_trained_equivalent(row) -> bool:
    """Rows whose M′ ranks exactly like M* (a positive multiple of it): not a refinement."""
    return ranks_like_trained(row["strategy"], row["params"])


def summary_table(test: list[dict], val: list[dict] | None) -> list[dict]:
    table = []
    for name, mode, title in REFERENCE_ROWS:
        r = find(test, name, mode)
        if r:
            table.append({"row": title, "choice": label(r), **{m: r[m] for m in METRICS}})
    for name, params, title in READING_ROWS:
        rs = [r for r in test if r["strategy"] == name and not is_trained_equivalent(r)
              and all(r["params"].get(k) == v for k, v in params.items())]
        if rs:
            best = max(rs, key=lambda r: r["map@r"])
            table.append({"row": title, "choice": label(best), **{m: best[m] for m in METRICS}})
    refined = [r for r in test if not is_trained_equivalent(r) and (r["strategy"], r["mode"]) not in
               {(n, m) for n, m, _ in REFERENCE_ROWS}]
    if refined:
        best = max(refined, key=lambda r: r["map@r"])
        table.append({"row": "best refined on test (oracle, the paper's †)", "choice": label(best),
                      **{m: best[m] for m in METRICS}})
    if val:
        sel = max(val, key=lambda r: r["map@r"])
        t = next(r for r in test if _group_key(r) == _group_key(sel))
        table.append({"row": "validation-selected (honest)",
                      "choice": label(sel) + f" (val MAP@R {sel['map@r']*100:.2f})",
                      **{m: t[m] for m in METRICS}})
    return table


def table_markdown(table: list[dict]) -> str:
    lines = ["| metric matrix | choice | MAP@R | P@1 | RP | R@4 |", "|---|---|---|---|---|---|"]
    for t in table:
        lines.append(f"| {t['row']} | {t['choice']} | {t['map@r']*100:.2f} | {t['precision@1']*100:.2f} | "
                     f"{t['r_precision']*100:.2f} | {t['recall@4']*100:.2f} |")
    return "\n".join(lines) + "\n"


def plot_sweeps(agg: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trained = find(agg, "trained", "bilinear")
    trained_cos = find(agg, "trained", "cosine")
    ident = find(agg, "identity", "bilinear")
    # one row per random strategy, along its first grid parameter (the restraints: accuracy vs r);
    # one line per setting of its other parameters and mode (the PSD readings: abs, clip × mode)
    swept = {r["strategy"] for r in agg}
    curves = [(n, next(iter(grid(n)))) for n in swept_strategies() if seeded(n) and grid(n) and n in swept]
    if curves:  # none when the evaluation was narrowed to no restraint
        fig, axes = plt.subplots(len(curves), 3, figsize=(12, 3.25 * len(curves)), sharex=True, squeeze=False)
        for row_i, (name, param) in enumerate(curves):
            lines = defaultdict(list)
            for r in agg:
                if r["strategy"] == name:
                    rest = tuple((k, v) for k, v in r["params"].items() if k != param)
                    lines[(rest, r["mode"])].append(r)
            for col, (m, title) in enumerate([("map@r", "MAP@R"), ("precision@1", "P@1"), ("r_precision", "RP")]):
                ax = axes[row_i, col]
                for (rest, mode), rs in lines.items():
                    rs = sorted(rs, key=lambda r: r["params"][param])
                    x = [r["params"][param] for r in rs]
                    mean = np.array([r[m] for r in rs]) * 100
                    std = np.array([r[m + "_std"] for r in rs]) * 100
                    seeds = max(r["seeds"] for r in rs)
                    ax.plot(x, mean, "o-", label=f"{strategy_label(name, dict(rest))} [{mode}] ({seeds} seeds)")
                    ax.fill_between(x, mean - std, mean + std, alpha=0.25)
                if trained:
                    ax.axhline(trained[m] * 100, color="k", ls="--", lw=1, label="trained M* (bilinear)")
                if trained_cos:
                    ax.axhline(trained_cos[m] * 100, color="tab:red", ls="-.", lw=1, label="trained M* (cosine)")
                if ident:
                    ax.axhline(ident[m] * 100, color="tab:green", ls=":", lw=1, label="identity")
                ax.set_title(f"{title} vs {param} ({name})")
                if row_i == len(curves) - 1:
                    ax.set_xlabel(f"{REFINEMENTS.get(name).param_help()[param]} {param}")
                if col == 0:
                    ax.legend(fontsize=7)
        fig.tight_layout()
        write_with(out / "restraint_sweep.png", lambda t: fig.savefig(t, format="png", dpi=90))
        plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    # swept strategies first; the fixed matrices last, drawn on top
    names = sorted(swept_strategies(), key=lambda n: not grid(n))
    for name, marker in zip(names, itertools.cycle(MARKERS)):
        rs = [r for r in agg if r["strategy"] == name and r["mode"] == "bilinear"]
        if not rs:
            continue
        for ax, ratio, title in ((axes[0], "M_trace_over_frobenius", "tr(M′)/‖M′‖_F (principle 1)"),
                                 (axes[1], "M_frobenius_over_trace", "‖M′‖_F/tr(M′) (principle 2)")):
            xs = [r[ratio] for r in rs]
            ax.scatter(xs, [r["map@r"] * 100 for r in rs], marker=marker, label=name, s=22)
            ax.set_xlabel(title)
            ax.set_ylabel("test MAP@R")
    axes[0].legend(fontsize=7)
    from matplotlib.ticker import FuncFormatter

    for ax in axes:
        ax.set_xscale("symlog")
        # plain short numbers (the default symlog labels read like −2.16746×10⁻²)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    fig.tight_layout()
    write_with(out / "principles.png", lambda t: fig.savefig(t, format="png", dpi=90))
    plt.close(fig)


def split_counts(labels) -> dict:
    """What a split's numbers are over: its classes and its queries (query = gallery)."""
    _, counts = np.unique(np.asarray(labels), return_counts=True)
    return {"classes": int(len(counts)), "images": int(counts.sum()), "queries": int(counts[counts > 1].sum())}


def run_evaluation(test_feats, test_labels, W, out, val=None, normalize=True, seeds=1, progress=True,
                   strategies: tuple[str, ...] | None = None, grid_name: str = "coarse", split: str = "test",
                   rerankers: tuple[str, ...] = ()) -> dict:
    """The strategy sweep on `split` (and val), its summary table and plots; with `rerankers`
    beyond "none", also the strategy × re-ranker matrix (index/analysis/rerank_eval.py), each
    re-ranker's parameters chosen on val from its grid (`grid_name`, as the strategies')."""
    out = Path(out)
    configs = sweep_configs(seeds, strategies, grid_name)
    given = {split: (test_feats, test_labels)} | ({} if val is None else {"val": val})
    desc = f"{split}{' + val' if val is not None else ''} strategies"
    res = evaluate_splits(given, W, configs, normalize, progress, desc)
    test_rows = res[split]
    test_agg = aggregate(test_rows)
    val_agg = None
    counts = {split: split_counts(test_labels)}
    if val is not None:
        val_agg = aggregate(res["val"])
        counts["val"] = split_counts(val[1])
    table = summary_table(test_agg, val_agg)
    result = {"test": test_agg, "val": val_agg, "table": table, "test_runs": test_rows, "split": split,
              "counts": counts, "grid": grid_name, "strategies": swept_strategies(strategies)}
    if any(r != "none" for r in rerankers):
        from .rerank_eval import chosen_settings, matrix_markdown, matrix_table, rerank_matrix

        mat = rerank_matrix(given, W, chosen_settings(test_agg, val_agg), rerankers, normalize, progress, grid_name)
        result["rerank"] = matrix_table(mat[split], mat.get("val")) | {"runs": mat}
        write_text(out / "rerank.md", counts_line(counts) + "\n\n" + matrix_markdown(result["rerank"]))
    write_json(out / "strategies.json", result)
    write_text(out / "table.md", counts_line(counts) + "\n\n" + table_markdown(table))
    plot_sweeps(test_agg, out)
    return result


def counts_line(counts: dict) -> str:
    """'test: 250 classes, 5,750 queries · val: …' — validation and test numbers are over
    different classes (and counts), so they say which."""
    return " · ".join(f"{name}: {c['classes']:,} classes, {c['queries']:,} queries" for name, c in counts.items())


def select_strategy(val_feats, val_labels, W, normalize=True, seeds=1, progress=True,
                    strategies: tuple[str, ...] | None = None, grid_name: str = "coarse") -> dict:
    rows = aggregate(evaluate_configs(val_feats, val_labels, W, sweep_configs(seeds, strategies, grid_name),
                                      normalize, progress, "val strategies"))
    best = max(rows, key=lambda r: r["map@r"])
    return {"selected": best, "label": label(best), "all": rows, "counts": {"val": split_counts(val_labels)}}
