"""Where one served query's time goes, stage by stage, against one whole search.

  python bench/serving_costs.py [--index artifacts/demo/index]

Builds the app's service and UI on the index, in this process, on one thread (what the app
gives each search at its default --concurrency on 2 cores), and times per call (medians):
- the reference: the app's `/search` handler on one gallery image under the trained metric
  (image decode, preprocessing, embedding, search, result rows);
- embedding one image: the backbone in the default layout against channels-last (what
  index/embedder.py runs), interleaved call by call so that both see the same machine;
- a new M′ (a new seed) for random and for diagonal restraint, as the app builds it, against
  the previous implementation (kept below as the reference: zero the drawn entries in the
  d × d matrix, average M′ with M′ᵀ, test M′ − M* for a diagonal with four temporaries),
  interleaved, after checking both give the same M′; and the seeded permutation alone, which
  both must draw;
- a new Gradio session: what Gradio builds for every API call that carries no session hash
  (curl), and the memory it keeps (tracemalloc);
- Gradio's queue summary of its event log (pandas), which it recomputes after every event
  (GRADIO_ANALYTICS_CACHE_FREQUENCY = 1) over up to 10⁴ logged events; the app sets the
  frequency to app.cli.GRADIO_SUMMARY_EVERY, which spreads one summary over that many events.
Every figure is also given as a ratio to the reference.
"""
from __future__ import annotations

import argparse
import copy
import os
import time
import tracemalloc
from pathlib import Path

import numpy as np
from common import interleaved_ms, median_ms

from core.atomic import write_json


def previous_random(M, r: float, seed: int):
    """Random restraint and its dense operator as built before the serving path was reworked (the reference)."""
    from index.refinements.paper import _pair_indices

    out = M.copy()
    upper, lower = _pair_indices(M.shape[0])
    vals = np.take(M, upper)
    order = np.random.default_rng(seed).permutation(np.nonzero(vals != 0)[0])
    sq = 2.0 * vals[order] ** 2
    total = float(sq.sum())
    remaining = total - np.cumsum(sq)
    hit = np.nonzero(remaining <= (1.0 - r) ** 2 * total + 1e-12 * max(abs(total), 1.0))[0]
    sel = order[: int(hit[0]) + 1 if hit.size else len(order)]
    flat = out.reshape(-1)
    flat[upper[sel]] = 0.0
    flat[lower[sel]] = 0.0
    out = (out + out.T) / 2
    return out, np.ascontiguousarray(out, dtype=np.float32)


def previous_diagonal(M, r: float, seed: int):
    """Diagonal restraint and its low-rank operator's check as built before."""
    out = M.copy()
    diag = np.diag(M)
    order = np.random.default_rng(seed).permutation(np.nonzero(diag != 0)[0])
    remaining = float(diag.sum()) - np.cumsum(diag[order])
    hit = np.nonzero(remaining <= (1.0 - r) * float(diag.sum()) + 1e-12 * max(abs(float(diag.sum())), 1.0))[0]
    idx = order[: int(hit[0]) + 1 if hit.size else len(order)]
    out[idx, idx] = 0.0
    out = (out + out.T) / 2
    assert np.array_equal(out - np.diag(np.diag(out)), M - np.diag(np.diag(M)))
    return out, np.ascontiguousarray(out, dtype=np.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", default="artifacts/demo/index", help="index directory (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=40, help="timed calls per figure (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/compare/serving_costs.json",
                    help="result file (default: %(default)s)")
    args = ap.parse_args()
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    import torch
    from gradio.queueing import Queue
    from gradio.state_holder import SessionState

    from app.cli import GRADIO_SUMMARY_EVERY
    from app.handlers import api_search
    from app.service import RetrievalService
    from app.ui import build_ui
    from index.threads import serving_threads

    torch.set_num_threads(1)
    serving_threads(1)
    svc = RetrievalService(args.index, verify=False)
    demo = build_ui(svc)
    image = str(Path(svc.data.root) / svc.data.items.paths[0])
    search = api_search(svc)
    ref = median_ms(lambda: search(image, "trained", mode="cosine", k=10), args.repeat)
    out = {"index": args.index, "gallery": int(svc.data.manifest["count"]), "reference_search_ms": round(ref, 2)}

    def add(name, ms):
        out[f"{name}_ms"] = round(ms, 2)
        out[f"{name}_ratio"] = round(ms / ref, 4)

    # embedding: the default layout against channels-last, same weights, same input
    model = svc.embedder.model
    contiguous = copy.deepcopy(model).to(memory_format=torch.contiguous_format)
    x = svc.embedder.transform(svc.thumbnail(int(svc.data.items.ids[0]), 10**6))[None]
    x_cl = x.contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        emb = interleaved_ms({"contiguous": lambda: contiguous.trunk_features(x),
                              "channels_last": lambda: model.trunk_features(x_cl)}, 5 * args.repeat)
    add("embed_contiguous", emb["contiguous"])
    add("embed_channels_last", emb["channels_last"])

    # a new M′ per call, as a new seed in the app builds one, against the previous implementation
    M_star = svc.searcher._M_star
    for name, previous in (("random", previous_random), ("diagonal", previous_diagonal)):
        for seed in (1, 2):
            now = svc.searcher.metric(name, {"r": 0.5, "seed": seed}).M
            if not np.array_equal(previous(M_star, 0.5, seed)[0], now):
                raise SystemExit(f"{name}: the previous implementation gives another M′ for seed {seed}")
        seeds = iter(range(3, 10**6))
        ms = interleaved_ms(
            {
                "now": lambda: svc.searcher.metric(name, {"r": 0.5, "seed": next(seeds)}),
                "previous": lambda: previous(M_star, 0.5, next(seeds)),
            },
            args.repeat,
        )
        add(f"new_{name}_metric", ms["now"])
        add(f"new_{name}_metric_previous_implementation", ms["previous"])
    pairs = np.flatnonzero(np.ones(M_star.shape[0] * (M_star.shape[0] - 1) // 2))
    add("random_permutation_alone", median_ms(lambda: np.random.default_rng(7).shuffle(pairs), args.repeat))

    add("new_gradio_session", median_ms(lambda: SessionState(demo), args.repeat))
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = [SessionState(demo) for _ in range(10)]
    out["new_gradio_session_kb"] = round((tracemalloc.get_traced_memory()[0] - before) / len(kept) / 1024, 1)
    tracemalloc.stop()
    out["ui_blocks"] = len(demo.blocks)

    class Log:  # the attributes compute_analytics_summary reads, with a summary due every call
        _get_df = staticmethod(Queue._get_df)
        cached_event_analytics_summary: dict = {}
        events_recorded_per_fn: dict = {}
        event_count_at_last_cache = 0
        ANAYLTICS_CACHE_FREQUENCY = 1

        def __init__(self):
            self.events_recorded = 0

        def summarise(self, records):
            self.events_recorded += 1
            Queue.compute_analytics_summary(self, records)

    now = time.time()
    for n in (100, 1000, 10000):
        records = [
            {"time": now, "status": "success", "process_time": 0.05, "function": "search", "session_hash": f"s{i % 50}"}
            for i in range(n)
        ]
        log = Log()
        add(f"gradio_summary_{n}_events", median_ms(lambda: log.summarise(records), max(3, args.repeat // 8)))
    add("gradio_summary_10000_events_app_setting", out["gradio_summary_10000_events_ms"] / GRADIO_SUMMARY_EVERY)
    out["app_summary_every"] = GRADIO_SUMMARY_EVERY
    write_json(args.out, out)
    for k, v in out.items():
        print(f"{k:45s} {v}")


if __name__ == "__main__":
    main()
