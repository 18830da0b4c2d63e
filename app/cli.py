"""`python -m app [--index DIR] [--backend faiss|ondisk|milvus] [--host 127.0.0.1] [--port 7860]`:
the retrieval explorer, on any backend `python -m index search` reads."""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from core.cli import Parser
from core.flags import add_shared_args, at_least
from index.backends.flags import backend_args, milvus_token

from .limits import COMPARE_ALL_UP_TO, COMPARE_SAMPLE, DEFAULT_MAX_RERANK_SIZE

DEMO_INDEX = "artifacts/demo/index"
DEMO_ANALYSIS = "artifacts/demo/strategies"
DEFAULT_CONCURRENCY = 2
GRADIO_SUMMARY_EVERY = 1000
# a call to Gradio's API without a session hash (curl) opens a session holding a copy of every
# block's config (bench/serving_costs.py): keep 10³ (Gradio's default 10⁴), the least recently
# used go first; a browser tab idle through 10³ such calls loses its state (docs/app-and-compare.md)
SESSIONS = 1000


def build_parser():
    p = Parser(prog="python -m app", description=__doc__)
    p.add_argument("--index", default=DEMO_INDEX, help=f"index directory (default: the demo's, {DEMO_INDEX}; "
                   "--backend ondisk reads INDEX/ivf_ondisk unless --ivf is given, milvus does not read it)")
    p.add_argument("--checkpoint", help="model for query images (default: the one the index was built with)")
    p.add_argument("--analysis", default=None, help="folder written by `python -m index evaluate` "
                   f"(default: {DEMO_ANALYSIS} for the demo index)")
    p.add_argument("--label", default=None, help="a name for this index in the page header (default: its folder)")
    p.add_argument("--second-index", default=None, help="a second index, served by the same process on --port + 1; "
                   "each page's header links to the other, so one query can be compared across two models "
                   "(the demo's --paper-regime index) (default: none)")
    p.add_argument("--second-analysis", default=None, help="the second index's `index evaluate` folder (default: none)")
    p.add_argument("--second-label", default=None, help="a name for the second index (default: its folder)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s, loopback only)")
    p.add_argument("--port", type=int, default=7860, help="port to serve on (default: %(default)s)")
    p.add_argument("--max-upload-mb", type=float, default=10.0, help="upload size cap (default: %(default)s)")
    p.add_argument("--max-rerank-size", type=at_least(1, "--max-rerank-size"), default=DEFAULT_MAX_RERANK_SIZE,
                   help="the most any re-ranker size parameter may be in one request, in the panels, the Compare "
                        "tab and both HTTP APIs (candidates read, neighbours expanded, a pool); a larger one is "
                        "refused, naming it (default: %(default)s, above every re-ranker's default)")
    p.add_argument("--concurrency", type=at_least(1, "--concurrency"), default=DEFAULT_CONCURRENCY,
                   help="searches served at once (queue) (default: %(default)s)")
    p.add_argument("--no-verify", action="store_true", help="skip index checksum verification at start")
    p.add_argument("--compare-all-up-to", type=at_least(1, "--compare-all-up-to"), default=COMPARE_ALL_UP_TO,
                   help="the Compare tab compares every query of a gallery up to this many items; above, a seeded "
                        "random sample of the queries, with bootstrap 95%% intervals (default: %(default)s)")
    p.add_argument("--compare-sample", type=at_least(1, "--compare-sample"), default=COMPARE_SAMPLE,
                   help="queries in that sample, changeable in the tab (default: %(default)s)")
    p.add_argument("--image-root", default=None,
                   help="folder the gallery's relative image paths are under (default: the index's own; a Milvus "
                        "collection keeps none: without this its thumbnails say the image is not found)")
    backend_args(p)
    # the app serves single queries: the CPU unless asked (a GPU helps batches, not one image);
    # each of the --concurrency searches in flight gets its share of the cores: a one-image
    # forward pass and a one-query search gain little from more threads, and threads that
    # outnumber the cores spin against each other (bench/app_load.py --app-threads).
    # --cache-memory: the one budget of everything the process keeps in memory, the metric spaces'
    # state and what the app draws and computes for display alike (app/cache.py)
    add_shared_args(p, "threads", "device", "cache_memory", defaults={"device": "cpu", "threads": None},
                    shown={"threads": "cores ÷ --concurrency, at least 1; here "
                                      f"{serving_thread_count(DEFAULT_CONCURRENCY)} at the default concurrency"})
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def serving_thread_count(concurrency: int) -> int:
    """Threads per search when `concurrency` searches run at once on this machine's cores."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, concurrency))  # the cores this process may run on (taskset, cgroup cpusets)


def launch(args, block: bool = True):
    # offline: no analytics, and Gradio's start-up self-check of its own URL must not go via a proxy
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    # Gradio's queue re-summarises its last 10⁴ events with pandas after every event, for a
    # monitoring page this app does not use: 12–14 ms per search once the log is full
    # (bench/serving_costs.py).  Once per 1,000 events instead, unless the user set it.
    os.environ.setdefault("GRADIO_ANALYTICS_CACHE_FREQUENCY", str(GRADIO_SUMMARY_EVERY))
    no_proxy = os.environ.get("NO_PROXY", "")
    os.environ["NO_PROXY"] = os.environ["no_proxy"] = ",".join(x for x in (no_proxy, "localhost,127.0.0.1") if x)
    from core.errors import UserError

    from .service import RetrievalService
    from .ui import CSS, KEYS_JS, build_ui, offline_theme

    if args.backend == "faiss" or (args.backend == "ondisk" and not args.ivf):
        if not Path(args.index).is_dir():
            hint = " Run `make demo` (or `python -m demo --no-ui`) to build it." if args.index == DEMO_INDEX else ""
            raise UserError(f"index directory not found: {args.index}.{hint}")
    if args.second_index and not Path(args.second_index).is_dir():
        raise UserError(f"--second-index directory not found: {args.second_index}")
    if args.second_index and not 0 < args.port < 65535:
        raise UserError(f"--second-index is served on --port + 1: --port must be below 65535, got {args.port}")
    analysis = args.analysis or (DEMO_ANALYSIS if args.index == DEMO_INDEX else None)
    from core.flags import apply_threads
    from index.space import set_memory_budget
    from index.threads import serving_threads

    threads = serving_thread_count(args.concurrency) if args.threads is None else args.threads
    apply_threads(threads)  # torch and FAISS, as on every command
    serving_threads(threads or None)  # then numpy's BLAS back to one thread
    set_memory_budget(args.cache_memory)
    # every index is verified and loaded before anything is served
    sites = [(args.index, args.checkpoint, analysis, args.label, args.port)]
    if args.second_index:
        sites.append((args.second_index, None, args.second_analysis, args.second_label, args.port + 1))
    from .backend import open_served

    def serve(ix, ck, an, first: bool) -> RetrievalService:
        # the second index is always an index directory in RAM; the backend flags are the first's
        kind = args.backend if first else "faiss"
        served = open_served(kind, ix if kind != "milvus" else None, ivf=args.ivf if first else None,
                             nprobe=args.nprobe or None, rerank_factor=args.rerank_factor, uri=args.uri,
                             collection=args.collection,
                             token=milvus_token(args),
                             verify=not args.no_verify, image_root=args.image_root if first else None)
        return RetrievalService(ix, ck, an, device=args.device, max_rerank_size=args.max_rerank_size, served=served,
                                compare_all_up_to=args.compare_all_up_to,
                                compare_sample=args.compare_sample)
    services = [serve(ix, ck, an, i == 0) for i, (ix, ck, an, _, _) in enumerate(sites)]
    names = [label or (Path(ix).name if svc.backend == "faiss" else svc.served.where)
             for (ix, _, _, label, _), svc in zip(sites, services, strict=True)]
    max_kb = max(1, int(args.max_upload_mb * 1024))
    from .rest import add_rest_routes

    pages = []
    for i, (svc, (_, _, _, _, port)) in enumerate(zip(services, sites, strict=True)):
        # first searches under each default strategy as fast as later ones (seconds of work, in the background)
        threading.Thread(target=svc.warm, name="warm-strategies", daemon=True).start()
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        others = [(names[j], f"http://{host}:{sites[j][4]}/") for j in range(len(sites)) if j != i]
        page = build_ui(svc, name=names[i] if len(sites) > 1 else None, others=others)
        page.queue(default_concurrency_limit=args.concurrency, max_size=64)
        page.launch(server_name=args.host, server_port=port, share=False, inbrowser=False,
                    max_file_size=f"{max_kb}kb", show_error=True, prevent_thread_lock=True,
                    theme=offline_theme(), css=CSS, js=KEYS_JS, quiet=not args.verbose, allowed_paths=[],
                    ssr_mode=False, state_session_capacity=SESSIONS)
        add_rest_routes(page.app, svc, max_kb * 1024)  # POST /api/search, on the same server
        pages.append(page)
    demo, svc = pages[0], services[0]
    logging.getLogger("app").info("serving on http://%s:%d", args.host, args.port)  # every index is loaded
    # closed with it by callers that hold only the first
    demo.companions = pages[1:]  # type: ignore[attr-defined]  # our attribute on Gradio's Blocks
    if block:
        demo.block_thread()
    return demo, svc


def main(argv=None) -> int:
    from core.logs import setup_logging

    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    launch(args)
    return 0
