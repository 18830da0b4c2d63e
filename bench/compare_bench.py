"""Speed of the Compare tab on a new strategy, where one search request's time goes, and
search latency under concurrent clients.

  python bench/compare_bench.py [--index artifacts/demo/index] [--repeats 5] [--clients 4] [--queries 25]

1. Compare tab on a new strategy: the tab's handler (per-query AP of every query in one batched
   pass, statistics, scatter, tables) for strategies not computed before, the trained baseline
   already cached (as after the first comparison); the first comparison (baseline too) is shown apart,
   on a cold service and after the warm-up the app runs in the background at start.
2. One search request, by stage: upload decode, preprocessing, embedding, refinement build (a
   strategy's M′, its operator and matrix report, cosine norms: once per strategy, then cached),
   search (both panels with the query's AP), rendering (thumbnails, M′ heatmap, 2-D map).
3. p50/p95 of /search under N concurrent gradio_client clients: bench/app_load.py, run as is.
Writes bench/results/compare/{compare_bench.json,compare_bench.md,app_load.json}.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from common import ROOT, timed

from core.atomic import write_json, write_text

NEW_STRATEGIES = [("identity", {}, "cosine"), ("spectral", {"p": 0.5}, "cosine"), ("shrink", {"alpha": 0.3}, "cosine"),
                  ("random", {"r": 0.5, "seed": 1}, "bilinear"), ("diagonal", {"r": 0.3, "seed": 2}, "bilinear")]
CONTROLS = {"r": 0.5, "seed": 0, "psd": "abs", "alpha": 0.5, "p": 0.5, "path": None}


def panels(right: str, mode: str, params: dict | None = None) -> dict:
    """The Compare handler's keyword values: trained on the left (in `mode`), `right` on the right."""
    out = {"left_strategy": "trained", "left_mode": mode, "right_strategy": right, "right_mode": mode}
    for side, given in (("left", {}), ("right", params or {})):
        out |= {f"{side}_{k}": v for k, v in (CONTROLS | given).items()}
    return out


def compare_tab(index: str) -> dict:
    from app.handlers import Handlers
    from app.service import RetrievalService

    svc = RetrievalService(index, verify=False)
    h = Handlers(svc)
    _, first = timed(lambda: h.on_compare(None, "all", 12, "outcome", 1.0, **panels("trained", "bilinear")))
    rows = []
    for name, params, mode in NEW_STRATEGIES:
        svc.comparer.per_query_ap("trained", {}, mode)  # the baseline of this mode, cached
        out, s = timed(lambda: h.on_compare(None, "all", 12, "outcome", 1.0, **panels(name, mode, params)))
        _, again = timed(lambda: h.on_compare(None, "all", 12, "outcome", 1.0, **panels(name, mode, params)))
        rows.append({"strategy": out[0].split("(y)")[0].split("vs")[1].strip(" *"), "seconds": s,
                     "cached_seconds": again})
    warm = RetrievalService(index, verify=False)
    warm.warm()  # what the app does in the background at start
    _, first_warm = timed(lambda: Handlers(warm).on_compare(None, "all", 12, "outcome", 1.0,
                                                            **panels("trained", "bilinear")))
    return {"first_comparison_s": first, "first_comparison_after_warm_s": first_warm, "new_strategy": rows,
            "new_strategy_median_s": float(np.median([r["seconds"] for r in rows])),
            "new_strategy_max_s": float(max(r["seconds"] for r in rows))}


def search_breakdown(index: str, repeats: int) -> dict:
    import torch

    from app.handlers import gallery_items, report_md
    from app.service import Query, RetrievalService, Spec
    from core.images import load_rgb
    from index.backends.search import Searcher

    svc = RetrievalService(index, verify=False)
    emb = svc.embedder
    paths = [svc.root / svc.data.items.paths[i] for i in range(0, len(svc.data.items), 613)][:repeats]
    stages = {k: [] for k in ("upload decode", "preprocessing", "embedding", "refinement build (new strategy)",
                              "search (both panels)", "rendering")}
    spec = Spec("spectral", {"p": 0.5}, "cosine")
    for p in paths:
        img, t = timed(lambda: load_rgb(p))
        stages["upload decode"].append(t)
        # as index/embedder.py runs it: channels-last, no autograd
        x, t = timed(lambda: emb.transform(img)[None].contiguous(memory_format=torch.channels_last))
        stages["preprocessing"].append(t)
        with torch.inference_mode():
            feats, t = timed(lambda: emb.model.trunk_features(x).numpy())
        stages["embedding"].append(t)
        s = Searcher(svc.data)  # nothing cached: the strategy's first use

        def build():
            _ = s.metric(spec.strategy, spec.params).report  # the eigendecomposition the panel shows
            s.query_view(spec.strategy, spec.params, spec.mode)  # cosine norms and index
        stages["refinement build (new strategy)"].append(timed(build)[1])
        q = Query(feats, label=None, image=img)
        svc.compare(q, spec, 12)  # warm
        (left, right), t = timed(lambda: svc.compare(q, spec, 12))
        stages["search (both panels)"].append(t)

        def render():
            gallery_items(svc, left), gallery_items(svc, right)
            svc.heatmap(spec), report_md("right", spec, svc.metric_report(spec)), svc.gallery_map(q)
        stages["rendering"].append(timed(render)[1])
    return {k: {"median_ms": 1e3 * float(np.median(v)), "max_ms": 1e3 * float(np.max(v))} for k, v in stages.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", default="artifacts/demo/index", help="index directory (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=5, help="search requests timed by stage (default: %(default)s)")
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients (default: %(default)s)")
    ap.add_argument("--queries", type=int, default=25, help="queries per client (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/compare", help="results folder (default: %(default)s)")
    args = ap.parse_args()
    from index.threads import serving_threads

    serving_threads()  # as the app serves
    out = Path(args.out)
    res = {"index": args.index, "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(),
           "compare_tab": compare_tab(args.index), "search_breakdown": search_breakdown(args.index, args.repeats)}
    load = subprocess.run([sys.executable, str(ROOT / "bench" / "app_load.py"), "--index", args.index, "--clients",
                           str(args.clients), "--queries", str(args.queries), "--out", str(out / "app_load.json")],
                          capture_output=True, text=True)
    if load.returncode != 0:
        raise SystemExit(f"bench/app_load.py failed:\n{load.stderr[-2000:]}")
    import json

    res["concurrent_search"] = json.loads((out / "app_load.json").read_text())
    write_json(out / "compare_bench.json", res)
    write_text(out / "compare_bench.md", markdown(res))
    print(markdown(res))


def markdown(res: dict) -> str:
    c, b, cs = res["compare_tab"], res["search_breakdown"], res["concurrent_search"]
    md = ["| Compare tab, new strategy | s | cached s |", "|---|---|---|"]
    md += [f"| {r['strategy']} | {r['seconds']:.2f} | {r['cached_seconds']:.2f} |" for r in c["new_strategy"]]
    md += [f"\nfirst comparison of a session (the trained baseline alone): {c['first_comparison_s']:.2f} s cold, "
           f"{c['first_comparison_after_warm_s']:.2f} s after the app's start-up warm-up\n",
           "| one search request, stage | median ms | max ms |", "|---|---|---|"]
    md += [f"| {k} | {v['median_ms']:.1f} | {v['max_ms']:.1f} |" for k, v in b.items()]
    md += [f"\n/search, {cs['clients']} concurrent clients × {cs['queries_per_client']}: p50 {cs['p50_ms']:.0f} ms, "
           f"p95 {cs['p95_ms']:.0f} ms, {cs['throughput_qps']:.1f} queries/s, {cs['errors']} errors "
           f"(load average at start {res['load_average_at_start'][0]:.1f} on {res['cpus']} CPUs); CPU per query: "
           f"the app's process {cs['server_cpu_ms_per_query']:.0f} ms, "
           f"the clients' {cs['client_cpu_ms_per_query']:.0f} ms"]
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    main()
