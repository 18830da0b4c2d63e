"""Load: N concurrent clients × Q queries against the app on loopback.

  python bench/app_load.py [--index artifacts/demo/index] [--clients 4] [--queries 50]
                           [--client gradio|gradio-rest|http] [--strategies spectral:cosine]
                           [--backend faiss|ondisk|milvus] [--ivf DIR] [--nprobe N] [--cache-memory SIZE]
                           [--uri URI --collection NAME] [--rerank NAME [--rerank-param K=V]]

Starts the app (`python -m app`) on a free loopback port in its own process, waits until it
answers and has warmed its default strategies (--settle seconds), runs each client in its own
process (a gradio_client.Client on Gradio's /search, the same endpoint through Gradio's HTTP
API with httpx, or plain HTTP POSTs to /api/search), and
reports errors and the p50 / p95 latency per query, the app's start-up seconds (launch until
its page answers: every index read, the page built) and its resident memory (VmRSS, its
anonymous part RssAnon and its file-backed part RssFile, after start-up and after the load;
VmHWM, the peak).  Query images are the gallery's items that have one.
Queries cycle through gallery images and strategies; random and diagonal restraint get a new
seed on every query (a new M′ each time) unless --no-new-seeds.  With --backend milvus the app
serves the collection `index export --to milvus` wrote from --index (whose image paths the
queries are drawn from); with --rerank every query asks that re-ranker (http client only).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from common import ROOT, free_port

from core.atomic import write_json

STRATS = [("trained", "cosine"), ("identity", "cosine"), ("diagonal", "bilinear"), ("random", "bilinear"),
          ("shrink", "cosine"), ("spectral", "cosine")]


def memory_mb(pid: int) -> dict:
    """VmRSS, RssAnon, RssFile and VmHWM of a process, in MB (Linux /proc)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = round(int(line.split()[1]) / 1024, 1)
    return out


def gradio_args(strat: str, mode: str, seed: int) -> list:
    """Gradio's /search after the image, in its stable order (app.service.api_params): strategy, r,
    seed, alpha, p, mode, k, psd, rerank, rerank_params."""
    return [strat, 0.5, seed, 0.5, 0.5, mode, 10, "abs", "none", ""]


def client(job) -> tuple[list[tuple[str, float]], list[str], float]:
    """One client: `queries` searches in a row, cycling images and strategies;
    ([(strategy, seconds)], errors, the client's CPU seconds)."""
    from gradio_client import Client, handle_file

    url, images, ci, queries, kind, new_seeds, strats, rerank = job
    if kind == "gradio":
        c = Client(url, verbose=False)

        def search(path, strat, mode, q):
            return c.predict(handle_file(path), *gradio_args(strat, mode, q), api_name="/search")
    elif kind == "gradio-rest":  # Gradio's own HTTP API, as curl uses it: the UI's handler and queue
        import json

        import httpx

        h = httpx.Client(timeout=120)
        session = f"bench-{ci}-{os.getpid()}"  # one session per client, as a browser tab or gradio_client has

        def search(path, strat, mode, q):
            up = h.post(url + "gradio_api/upload", files={"files": (Path(path).name, Path(path).read_bytes())})
            up.raise_for_status()
            image = {"path": up.json()[0], "meta": {"_type": "gradio.FileData"}}
            ev = h.post(url + "gradio_api/call/search", json={"data": [image, *gradio_args(strat, mode, q)],
                                                                "session_hash": session})
            ev.raise_for_status()
            body = h.get(url + "gradio_api/call/search/" + ev.json()["event_id"]).text
            events = body.split("event: ")
            done = [e for e in events if e.startswith("complete")]
            if not done:
                raise RuntimeError(body[-300:])
            return json.loads(done[0].split("data: ", 1)[1])[0]
    else:  # one multipart POST to /api/search (app/rest.py)
        import httpx

        h = httpx.Client(timeout=120)

        def search(path, strat, mode, q):
            r = h.post(url + "api/search", files={"image": Path(path).read_bytes()},
                       data={"strategy": strat, "mode": mode, "k": "10", "r": "0.5", "seed": str(q),
                             "alpha": "0.5", "p": "0.5", **rerank})
            r.raise_for_status()
            return r.json()
    lat, errors = [], []
    cpu0 = time.process_time()
    for q in range(queries):
        strat, mode = strats[(ci + q) % len(strats)]
        t = time.perf_counter()
        try:
            r = search(images[(ci * queries + q) % len(images)], strat, mode, q if new_seeds else 0)
            assert len(r["results"]) == 10
            lat.append((strat, time.perf_counter() - t))
        except Exception as e:
            errors.append(repr(e))
    return lat, errors, time.process_time() - cpu0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--index", default="artifacts/demo/index")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=2, help="the app's --concurrency (default: %(default)s)")
    ap.add_argument("--client", choices=("gradio", "gradio-rest", "http"), default="gradio",
                    help="gradio: gradio_client on Gradio's /search; gradio-rest: the same endpoint through Gradio's "
                         "HTTP API (upload, call, event stream: what curl does) with a light client; http: one POST "
                         "to our /api/search (default: %(default)s)")
    ap.add_argument("--new-seeds", action=argparse.BooleanOptionalAction, default=True,
                    help="a new seed, hence a new M′, for random and diagonal restraint on every query; "
                         "--no-new-seeds: seed 0 throughout, every M′ built once (default: %(default)s)")
    ap.add_argument("--app-threads", type=int, default=None,
                    help="the app's --threads (default: the app's own default, cores ÷ --concurrency)")
    ap.add_argument("--settle", type=float, default=10.0,
                    help="seconds to wait after the app answers, while it warms its strategies (default: %(default)s)")
    ap.add_argument("--strategies", default=",".join(f"{s}:{m}" for s, m in STRATS),
                    help="the strategy:mode pairs queries cycle through; random, diagonal, shrink and spectral at "
                         "r = alpha = p = 0.5 (default: %(default)s)")
    ap.add_argument("--backend", choices=("faiss", "ondisk", "milvus"), default="faiss", help="the app's --backend "
                    "(default: %(default)s)")
    ap.add_argument("--uri", default=None, help="the app's --uri (milvus)")
    ap.add_argument("--collection", default=None, help="the app's --collection (milvus)")
    ap.add_argument("--rerank", default="none", help="the re-ranker every query asks (http client; default: "
                    "%(default)s)")
    ap.add_argument("--rerank-param", default="", help="its parameters, KEY=VALUE[,KEY=VALUE] (default: none)")
    ap.add_argument("--ivf", default=None, help="the app's --ivf (ondisk; default: INDEX/ivf_ondisk)")
    ap.add_argument("--nprobe", type=int, default=0, help="the app's --nprobe (default: %(default)s, the app's own)")
    ap.add_argument("--cache-memory", default=None,
                    help="the app's --cache-memory (default: the app's own, $DML_CACHE_MEMORY else 4G)")
    ap.add_argument("--out", default="bench/results/app_load.json")
    args = ap.parse_args()
    strats = [tuple(x.split(":")) for x in args.strategies.split(",")]
    if args.rerank != "none" and args.client != "http":
        ap.error("--rerank is sent by the http client only")
    if args.backend == "milvus" and not (args.uri and args.collection):
        ap.error("--backend milvus needs --uri and --collection")
    rerank = {} if args.rerank == "none" else {"rerank": args.rerank, "rerank_params": args.rerank_param}

    port = free_port()
    # the app in its own process, as users run it: the clients' HTTP work does not share its GIL
    backend = ["--backend", args.backend, *(["--ivf", args.ivf] if args.ivf else []),
               *(["--nprobe", str(args.nprobe)] if args.nprobe else [])]
    if args.backend == "milvus":  # the collection; the index folder gives only the query images
        meta0 = json.loads((Path(args.index) / "metadata.json").read_text())
        backend += ["--uri", args.uri, "--collection", args.collection, "--image-root", str(meta0.get("root", ""))]
    started = time.perf_counter()
    index_arg = [] if args.backend == "milvus" else ["--index", args.index]
    server = subprocess.Popen([sys.executable, "-m", "app", *index_arg, "--port", str(port),
                               "--concurrency", str(args.concurrency), *backend,
                               *([] if args.app_threads is None else ["--threads", str(args.app_threads)]),
                               *([] if args.cache_memory is None else ["--cache-memory", args.cache_memory])], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 300
    while True:
        try:
            urllib.request.urlopen(url, timeout=5).read(1)
            break
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                server.kill()
                raise SystemExit(f"the app did not start:\n{server.stderr.read()[-2000:]}") from None
            time.sleep(0.2)
    startup_s = time.perf_counter() - started
    time.sleep(args.settle)
    memory_started = memory_mb(server.pid)
    meta = json.loads((Path(args.index) / "metadata.json").read_text())  # not the features: only the paths
    root, paths = Path(meta.get("root", "")), meta["paths"]
    pictured = [p for p in paths if p]
    images = [str(root / p) for p in pictured[:: max(1, len(pictured) // 200)]][:200]
    server_cpu0 = cpu_seconds(server.pid)
    t0 = time.perf_counter()
    # each client in its own process, as separate users are: client threads would share one GIL
    # with each other's HTTP and SSE handling and measure the bench as much as the app
    with ProcessPoolExecutor(args.clients, mp_context=multiprocessing.get_context("spawn")) as pool:
        runs = list(pool.map(client, [(url, images, ci, args.queries, args.client, args.new_seeds, strats, rerank)
                              for ci in range(args.clients)]))
    by_strategy = {}
    for r in runs:
        for strat, x in r[0]:
            by_strategy.setdefault(strat, []).append(x)
    lat = [x for r in runs for _, x in r[0]]
    errors = [e for r in runs for e in r[1]]
    server_cpu = cpu_seconds(server.pid) - server_cpu0
    client_cpu = sum(r[2] for r in runs)
    wall = time.perf_counter() - t0
    memory_loaded = memory_mb(server.pid)
    server.terminate()
    server.wait(timeout=30)
    res = {"clients": args.clients, "queries_per_client": args.queries, "ok": len(lat), "errors": len(errors),
           "p50_ms": 1e3 * float(np.percentile(lat, 50)), "p95_ms": 1e3 * float(np.percentile(lat, 95)),
           "throughput_qps": len(lat) / wall, "error_samples": errors[:5],
           # which queries make the tail: random and diagonal restraint build a new M′ (--new-seeds)
           "p50_p95_ms_by_strategy": {s: [round(1e3 * float(np.percentile(v, q)), 1) for q in (50, 95)]
                                      for s, v in by_strategy.items()},
           # where the 2 cores went, per query: the app's process (Gradio + our handler) and the clients'
           "server_cpu_ms_per_query": 1e3 * server_cpu / max(len(lat), 1),
           "client_cpu_ms_per_query": 1e3 * client_cpu / max(len(lat), 1),
           "gallery": len(paths), "concurrency": args.concurrency,
           "client": args.client, "new_seeds": args.new_seeds,
           "app_threads": args.app_threads, "backend": args.backend, "strategies": args.strategies,
           "cache_memory": args.cache_memory, "rerank": args.rerank, "rerank_param": args.rerank_param,
           "startup_s": round(startup_s, 2), "memory_mb_started": memory_started,
           "memory_mb_after_load": memory_loaded, "loadavg_1_5_15": list(os.getloadavg())}
    write_json(args.out, res)
    print(res)


if __name__ == "__main__":
    main()
