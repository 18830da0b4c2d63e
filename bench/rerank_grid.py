"""Which re-ranker parameters validation chooses on a data set, and what the choice is worth on
test against the papers' defaults: the choice `python -m index evaluate --rerankers` makes.

  python bench/rerank_grid.py --checkpoint CK [--checkpoint CK ...] [--rerankers kreciprocal,diffusion]
                              [--grid full] [--threads 1] [--out bench/results/rerank]

For each checkpoint (its own data set and split): trained M′ in cosine mode, query = gallery item
left out of its own ranking; each re-ranker's declared grid (`RerankerSpec.grid`; --grid coarse:
every other value, both ends and the default kept) scored on the validation classes, the best by
MAP@R reported on the test classes beside the re-ranker at its defaults and the plain search.
Results: OUT/grid.md and grid.json (rows of other checkpoints measured before are kept).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
import sys
from pathlib import Path

import numpy as np


def describe(y: np.ndarray) -> str:
    counts = np.bincount(np.unique(y, return_inverse=True)[1])
    lo, hi = counts.min(), counts.max()
    each = f"{lo}" if lo == hi else f"{lo}–{hi} (mean {counts.mean():.1f})"
    return f"{len(counts):,} classes, {each} images each"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", action="append", required=True, help="a trained checkpoint (repeat for more)")
    ap.add_argument("--name", action="append", default=[], help="a label per checkpoint (default: its folder)")
    ap.add_argument("--rerankers", default="kreciprocal,diffusion", help="re-rankers (default: %(default)s)")
    ap.add_argument("--grid", choices=("coarse", "full"), default="full", help="grid (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=1, help="FAISS, torch and BLAS threads (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/rerank", help="results folder (default: %(default)s)")
    args = ap.parse_args()

    from core.atomic import write_json, write_text
    from core.flags import apply_threads
    from index.analysis.rerank_eval import params_text, rerank_matrix, rerank_split
    from index.backends.search import Searcher
    from index.backends.store import in_memory_index
    from index.build import split_features
    from index.search_config import SearchConfig

    apply_threads(args.threads)
    from threadpoolctl import threadpool_limits

    threadpool_limits(args.threads)
    names = tuple(s for s in args.rerankers.split(",") if s)
    command = "python bench/rerank_grid.py " + shlex.join(sys.argv[1:])
    rows = []
    for i, ck in enumerate(args.checkpoint):
        label = args.name[i] if i < len(args.name) else Path(ck).parent.name
        f, y, W = split_features(ck, None, "test", "cache/features", progress=False)
        vf, vy, _ = split_features(ck, None, "val", "cache/features", progress=False)
        cfg = SearchConfig.of("trained", {}, "cosine")
        mat = rerank_matrix({"test": (f, y), "val": (vf, vy)}, W, [cfg], names, progress=False, grid_name=args.grid)
        test = {r["rerank"]: r for r in mat["test"]}
        val = {r["rerank"]: r for r in mat["val"]}
        s = Searcher(in_memory_index(f, y, W))
        for n in names:
            default = rerank_split(s, SearchConfig.of("trained", {}, "cosine", n), y)
            rows.append({"data": label, "checkpoint": str(ck), "test_classes": describe(y), "val_classes": describe(vy),
                         "rerank": n, "chosen": test[n]["chosen"], "val_map@r": val[n]["map@r"],
                         "tried": len(test[n]["tried"]), "map@r": test[n]["map@r"], "default_map@r": default["map@r"],
                         "none_map@r": test["none"]["map@r"], "command": command,
                         "date": _dt.date.today().isoformat(), "grid": args.grid})
            print(f"{label}: {n}: chose {params_text(test[n]['chosen'])} (val {100 * val[n]['map@r']:.2f}); test "
                  f"{100 * test[n]['map@r']:.2f}, at its defaults {100 * default['map@r']:.2f}, plain "
                  f"{100 * test['none']['map@r']:.2f}", flush=True)
    out = Path(args.out)
    if (out / "grid.json").is_file():
        done = {(r["data"], r["rerank"]) for r in rows}
        rows = [r for r in json.loads((out / "grid.json").read_text()) if (r["data"], r["rerank"]) not in done] + rows
    write_json(out / "grid.json", rows)
    write_text(out / "grid.md", table(rows, params_text))
    print(table(rows, params_text))


def table(rows: list[dict], params_text) -> str:
    runs = list(dict.fromkeys((r["command"], r["date"]) for r in rows))
    lines = ["# Re-ranker parameters chosen on validation", "",
             "Trained M′, cosine mode; query = gallery item, left out of its own ranking; each re-ranker's grid "
             "scored on the validation classes, the best by MAP@R reported on the test classes. Runs: "
             + "; ".join(f"[{i + 1}] `{c}` ({d})" for i, (c, d) in enumerate(runs)) + ".", "",
             "| data (test classes) | re-ranker | chosen on validation | val MAP@R | test MAP@R: chosen | "
             "at its defaults | plain search | run |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['data']} ({r['test_classes']}) | {r['rerank']} | {params_text(r['chosen'])} "
                     f"({r['tried']} tried, {r['grid']} grid) | {100 * r['val_map@r']:.2f} | {100 * r['map@r']:.2f} | "
                     f"{100 * r['default_map@r']:.2f} | {100 * r['none_map@r']:.2f} | "
                     f"{runs.index((r['command'], r['date'])) + 1} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
