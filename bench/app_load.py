"""Issue-6 load: N concurrent gradio_client clients × Q queries against the app on loopback.

  python bench/app_load.py [--index artifacts/demo/index] [--clients 4] [--queries 50]

Starts the app on a free loopback port in this process, runs the clients in
threads (each its own gradio_client.Client), and reports errors and the p50 /
p95 latency per query.  Queries cycle through gallery images and strategies.
"""
from __future__ import annotations

import argparse
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.atomic import write_json  # noqa: E402

STRATS = [("trained", "cosine"), ("identity", "cosine"), ("diagonal", "bilinear"), ("random", "bilinear"),
          ("shrink", "cosine"), ("spectral", "cosine")]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", default="artifacts/demo/index")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument("--out", default="bench/results/app_load.json")
    args = ap.parse_args()
    from gradio_client import Client, handle_file

    from app.cli import build_parser, launch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo, svc = launch(build_parser().parse_args(["--index", args.index, "--port", str(port)]), block=False)
    url = f"http://127.0.0.1:{port}/"
    images = [str(svc.root / svc.data.items.paths[i]) for i in range(0, len(svc.data.items), 97)][:200]
    lat, errors, lock = [], [], threading.Lock()

    def client(ci):
        c = Client(url, verbose=False)
        for q in range(args.queries):
            strat, mode = STRATS[(ci + q) % len(STRATS)]
            t = time.perf_counter()
            try:
                r = c.predict(handle_file(images[(ci * args.queries + q) % len(images)]), strat, 0.5, q, 0.5, 0.5,
                              mode, 10, api_name="/search")
                assert len(r["results"]) == 10
                with lock:
                    lat.append(time.perf_counter() - t)
            except Exception as e:  # noqa: BLE001 - counted, reported
                with lock:
                    errors.append(repr(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    wall = time.perf_counter() - t0
    demo.close()
    res = {"clients": args.clients, "queries_per_client": args.queries, "ok": len(lat), "errors": len(errors),
           "p50_ms": 1e3 * float(np.percentile(lat, 50)), "p95_ms": 1e3 * float(np.percentile(lat, 95)),
           "throughput_qps": len(lat) / wall, "error_samples": errors[:5],
           "gallery": int(svc.data.manifest["count"])}
    write_json(args.out, res)
    print(res)


if __name__ == "__main__":
    main()
