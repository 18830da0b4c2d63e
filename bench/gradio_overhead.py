"""What Gradio itself adds to each API call of the app, against one search (issue 14).

  python bench/gradio_overhead.py [--index artifacts/demo/index]

Builds the app's UI on the index, in this process, and times per call (median of --repeat):
- the reference: the app's `/search` handler on one gallery image (embedding + search under
  the trained metric, already built);
- a new session: what Gradio builds for every API call that carries no session hash (curl),
  and the memory it keeps (tracemalloc);
- Gradio's queue summary of its event log (pandas), which it recomputes after every event
  (GRADIO_ANALYTICS_CACHE_FREQUENCY = 1) over up to 10⁴ logged events; the app sets the
  frequency to app.cli.GRADIO_SUMMARY_EVERY, which spreads one summary over that many events.
Each cost is also given as a ratio to the reference.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.atomic import write_json  # noqa: E402


def median_ms(f, repeat: int) -> float:
    f()  # warm
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", default="artifacts/demo/index", help="index directory (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=20, help="timed calls per figure (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/compare/gradio_overhead.json",
                    help="result file (default: %(default)s)")
    args = ap.parse_args()
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    import torch
    from gradio.queueing import Queue
    from gradio.state_holder import SessionState

    from app.cli import GRADIO_SUMMARY_EVERY
    from app.service import RetrievalService
    from app.ui import api_search, build_ui

    torch.set_num_threads(1)  # as the app serves at its default --concurrency on 2 cores
    svc = RetrievalService(args.index, verify=False)
    demo = build_ui(svc)
    image = str(Path(svc.data.root) / svc.data.items.paths[0])
    search = api_search(svc)
    ref = median_ms(lambda: search(image, "trained", mode="cosine", k=10), args.repeat)

    session = median_ms(lambda: SessionState(demo), args.repeat)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = [SessionState(demo) for _ in range(10)]
    session_kb = (tracemalloc.get_traced_memory()[0] - before) / len(kept) / 1024
    tracemalloc.stop()

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
    summary = {}
    for n in (100, 1000, 10000):
        records = [{"time": now, "status": "success", "process_time": 0.05, "function": "search",
                    "session_hash": f"s{i % 50}"} for i in range(n)]
        log = Log()
        summary[n] = median_ms(lambda: log.summarise(records), max(3, args.repeat // 4))
    res = {
        "index": args.index, "gallery": int(svc.data.manifest["count"]), "ui_blocks": len(demo.blocks),
        "reference_search_ms": round(ref, 2),
        "new_session_ms": round(session, 2), "new_session_ratio": round(session / ref, 3),
        "new_session_kb": round(session_kb, 1),
        "summary_ms_by_logged_events": {n: round(v, 2) for n, v in summary.items()},
        "summary_ratio_at_1e4_every_event": round(summary[10000] / ref, 3),
        "summary_ratio_at_1e4_app_setting": round(summary[10000] / GRADIO_SUMMARY_EVERY / ref, 5),
        "app_summary_every": GRADIO_SUMMARY_EVERY,
    }
    write_json(args.out, res)
    print(res)


if __name__ == "__main__":
    main()
