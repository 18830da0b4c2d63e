"""The neighbour graph in the engine, and the re-rankers that read by row, against a Milvus server.

  milvus-server --data DIR &        # the `milvus` package (requirements-milvus.txt): gRPC on 19530
  python bench/milvus_graph.py --uri http://127.0.0.1:19530 [--n 100000] [--queries 200]
                               [--index-type HNSW] [--out bench/results/milvus_graph]

Data: bench/ondisk_bench.py's synthetic gallery (N unit vectors, d = 128, 1000 classes, neck W
32 × 128), exported to a new collection (HNSW M = 16, efConstruction = 100, or FLAT), searched
under the trained strategy's M′ (bilinear).  Measured, in this one process (FAISS and BLAS on
one thread, as a serving process runs):
- the neighbour lists (L = 64) built through the server's search into the lists collection
  (`index graph`'s pass): wall seconds; their recall of the exact top 51 (the in-RAM index's exact
  scan) on 200 items, at any size;
- αDBA's augmented gallery built in a collection beside the gallery's (its first query's pass):
  wall seconds; decoupled diffusion's rows (diffusion_offline, each item's row as wide as the
  lists allow: --item-truncation 63) built and written to a collection beside it: wall seconds;
- single queries through the collection read by row (`MilvusSpace`), each re-ranker at its
  defaults there: none, αQE, αDBA (its augmented collection searched), k-reciprocal (its sets
  within each query's pool, the top 1,000), diffusion (each query's graph cut to its top 10,000),
  diffusion_offline (its top 10 items' rows summed):
  p50 and p95 wall ms, and each one's top-10 agreement with the in-RAM index running the same
  re-ranker (the same variant) — up to --reference-up-to items: the in-RAM reference computes
  exact lists, N² work;
- this process's peak RSS (VmHWM) and its private memory after the queries, before the in-RAM
  reference is loaded into it, under `--cache-memory` (the one budget the by-row reads are kept
  in: `core.memory`), and what the cache held then.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from ondisk_bench import draw, model

from core.atomic import write_json, write_text
from core.flags import CACHE_MEMORY_DEFAULT
from core.memory import CACHE, set_memory_budget
from index.backends.milvus_space import MilvusSpace
from index.backends.milvus_store import MilvusGallery, export_index
from index.backends.search import Searcher
from index.backends.store import Items, read_index, write_index
from index.rerankers import rerank, reranker_params
from index.rerankers.diffusion_offline import offline_rows
from index.rerankers.kreciprocal import POOL_BY_ROW
from index.rerankers.neighbours import neighbour_lists, searched_lists
from index.space import SearcherSpace
from index.threads import serving_threads

RERANKERS = [("none", {}), ("aqe", {}), ("dba", {}), ("kreciprocal", {}), ("diffusion", {}), ("diffusion_offline", {})]
# the same variants in the in-RAM index, where the defaults read the gallery whole
IN_RAM = {"kreciprocal": {"sets": "pool", "pool": POOL_BY_ROW}, "diffusion": {"truncation": 10_000}}
L, K = 64, 10


def memory_mib() -> dict:
    """This process's peak RSS and private (anonymous) memory now, MiB."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kb = {k: int(v.split()[0]) for k, v in status.items() if k in ("VmHWM", "VmRSS", "RssAnon")}
    return {"peak_rss": kb["VmHWM"] / 1024, "rss": kb["VmRSS"] / 1024, "private": kb["RssAnon"] / 1024}


def reusable(args, idx: Path) -> bool:
    """Whether the collection holds this bench's gallery already (exported from the same vectors)."""
    from index.backends.store import read_index

    sha = read_index(idx).manifest["files"]["features.npy"]["sha256"]
    try:
        g = MilvusGallery(args.uri, args.collection)
    except Exception:
        return False
    try:
        return g.info.get("source_index", {}).get("features_sha256") == sha and len(g) == args.n
    finally:
        g.close()


def run(args, wd: Path) -> dict:
    from threadpoolctl import threadpool_limits

    centres, W = model()
    n = args.n
    X = draw(centres, n, np.random.default_rng(1))
    Q = draw(centres, args.queries, np.random.default_rng(10**9))
    items = Items(np.arange(n, dtype=np.int64), np.zeros(n, np.int64), [f"{i}.jpg" for i in range(n)], ["g"] * n)
    idx = write_index(wd / "idx", X, items, W, normalize=True, info={}, factory="Flat")
    del X, items  # what the process holds from here on is the by-row reads alone
    params = {"M": 16, "efConstruction": 100} if args.index_type == "HNSW" else {}
    out: dict = {"n": n, "d": 128, "queries": args.queries, "index_type": args.index_type, "L": L,
                 "cache_memory": args.cache_memory, "item_truncation": args.item_truncation}
    if not (args.reuse and reusable(args, idx)):
        t0 = time.perf_counter()  # the rows inserted and indexed by the server
        export_index(idx, args.uri, args.collection, index_type=args.index_type, index_params=params,
                     overwrite=True, progress=True)
        out["export_s"] = time.perf_counter() - t0
    serving_threads(1)
    blas = threadpool_limits(1, "blas")
    g = MilvusGallery(args.uri, args.collection)
    for c in g.client.list_collections():  # artefacts of an earlier run of this bench
        if c.startswith(f"{args.collection}__") and not (args.keep_lists and c.startswith(f"{args.collection}__knn_")):
            g.client.drop_collection(c)
    g.wait_indexed(args.collection, "vector", progress=True)
    out["memory_opened"] = memory_mib()
    space = MilvusSpace(g, "trained", {}, "bilinear")
    chosen = [(name, p | ({"item_truncation": args.item_truncation} if name == "diffusion_offline" else {}))
              for name, p in RERANKERS if name in args.rerankers.split(",")]
    lists = None
    if {"dba", "diffusion", "diffusion_offline"} & {name for name, _ in chosen}:  # the re-rankers that read the lists
        t0 = time.perf_counter()
        lists = neighbour_lists(space, L, progress=True)
        out["lists_reused" if lists.rows.table.whole and args.keep_lists else "lists_s"] = time.perf_counter() - t0
        out["memory_lists"] = memory_mib()
    if "dba" in dict(chosen):
        t0 = time.perf_counter()
        rerank("dba", space, Q[:1], K)  # its augmented gallery, built in the engine
        out["dba_s"] = time.perf_counter() - t0
    if "diffusion_offline" in dict(chosen):
        t0 = time.perf_counter()
        offline_rows(space, reranker_params("diffusion_offline", dict(chosen)["diffusion_offline"]), progress=True)
        out["diffusion_offline_s"] = time.perf_counter() - t0  # every item's row, written to the engine
        out["memory_diffusion_offline"] = memory_mib()
    out["rerankers"] = {}
    answers = {}
    for name, p in chosen:
        rerank(name, space, Q[:1], K, params=p)  # warm: M′, the gRPC channel
        times, answers[name] = [], []
        for q in Q[:, None]:
            t0 = time.perf_counter()
            answers[name].append(rerank(name, space, q, K, params=p).rows[0])
            times.append(time.perf_counter() - t0)
        ms = np.array(times) * 1e3
        out["rerankers"][name] = {"p50_ms": float(np.median(ms)), "p95_ms": float(np.percentile(ms, 95))}
    out["memory_queries"] = memory_mib()  # before the in-RAM reference below is loaded
    out["cache_held_mib"] = {"all": CACHE.used / 2**20, "rows": CACHE.rows_used / 2**20}
    # the in-RAM index, the reference: the lists' recall (200 items scanned exactly, at any size),
    # each re-ranker's top-10 overlap (up to --reference-up-to: its lists are exact, N² work)
    ram = SearcherSpace(Searcher(read_index(idx)), "trained", {}, "bilinear", cache_dir=wd / "cache")
    sample = np.sort(np.random.default_rng(2).choice(n, 200, replace=False))
    if lists is not None:
        exact = searched_lists(ram, sample, 51)["rows"]
        got = lists.rows[sample][:, :51]
        out["list_recall@51"] = float((got[:, :, None] == exact[:, None, :]).any(1).mean())
    if n > args.reference_up_to:
        blas.restore_original_limits()
        g.close()
        return out
    for name, p in chosen:
        want = rerank(name, ram, Q, K, params=p | IN_RAM.get(name, {})).rows
        out["rerankers"][name]["top10_overlap"] = float(np.mean(
            [len(set(a) & set(b)) / K for a, b in zip(answers[name], want, strict=True)]))
        print(name, out["rerankers"][name], flush=True)
    blas.restore_original_limits()
    g.close()
    return out


def markdown(r: dict, command: str) -> str:
    md = [f"`{command}` ({time.strftime('%Y-%m-%d')}): N = {r['n']:,}, d = {r['d']}, a Milvus 2.3.5 standalone "
          f"server on this 2-core machine, collection {r['index_type']}, trained strategy (bilinear), "
          f"{r['queries']} single queries.", "",
          (f"- export and its index: {r['export_s']:.0f} s; " if "export_s" in r else "- export: reused; ") +
          (f"the neighbour lists (L = {r['L']}) through the server's search: {r['lists_s']:.0f} s"
           if "lists_s" in r else f"the neighbour lists (L = {r['L']}): kept from an earlier run"
           if "lists_reused" in r else "no neighbour lists (no re-ranker run reads them)") +
          (f", recall@51 of the exact lists {r['list_recall@51']:.4f} (200 items)" if "list_recall@51" in r else "")
          + (f"; αDBA's augmented collection: {r['dba_s']:.0f} s" if "dba_s" in r else "")
          + (f"; decoupled diffusion's rows (item_truncation = {r['item_truncation']}): "
             f"{r['diffusion_offline_s']:.0f} s" if "diffusion_offline_s" in r else ""),
          f"- this process, before the in-RAM reference: peak RSS {r['memory_queries']['peak_rss']:.0f} MiB; private "
          f"{r['memory_opened']['private']:.0f} MiB after opening the collection, "
          + (f"{r['memory_lists']['private']:.0f} after the lists, " if "memory_lists" in r else "")
          + f"{r['memory_queries']['private']:.0f} after the queries (`--cache-memory {r['cache_memory']}`; the cache "
          f"held {r['cache_held_mib']['all']:.0f} MiB then, {r['cache_held_mib']['rows']:.0f} of them rows read by "
          f"row)", "",
          "| re-ranker (read by row) | p50 ms | p95 ms | top-10 overlap with the in-RAM index |",
          "|---|---|---|---|"]
    md += [f"| {k} | {v['p50_ms']:.0f} | {v['p95_ms']:.0f} | "
           f"{format(v['top10_overlap'], '.1%') if 'top10_overlap' in v else '— (not computed at this size)'} |"
           for k, v in r["rerankers"].items()]
    return "\n".join(md) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--uri", required=True, help="the Milvus server (http://127.0.0.1:19530)")
    ap.add_argument("--collection", default="bench_graph", help="collection to (re)create (default: %(default)s)")
    ap.add_argument("--n", type=int, default=100_000, help="gallery rows (default: %(default)s)")
    ap.add_argument("--queries", type=int, default=200, help="single queries per re-ranker (default: %(default)s)")
    ap.add_argument("--index-type", default="HNSW", choices=["HNSW", "FLAT"],
                    help="the collection's index (default: %(default)s)")
    ap.add_argument("--reference-up-to", type=int, default=200_000,
                    help="compare with the in-RAM index up to this many rows (its exact lists: N² work) "
                         "(default: %(default)s)")
    ap.add_argument("--rerankers", default=",".join(name for name, _ in RERANKERS),
                    help="the re-rankers measured, comma-separated (the lists are built only for dba, "
                         "diffusion and diffusion_offline) (default: %(default)s)")
    ap.add_argument("--item-truncation", type=int, default=L - 1,
                    help="diffusion_offline's item_truncation: each item's row as wide as the graph's lists allow "
                         "(L − 1: one entry kept for a left-out item; its default, 1,000, needs lists that wide) "
                         "(default: %(default)s)")
    ap.add_argument("--reuse", action="store_true",
                    help="keep a collection that holds this gallery already (its lists are built afresh) "
                         "(default: export afresh)")
    ap.add_argument("--keep-lists", action="store_true",
                    help="keep the neighbour lists an earlier run built in the engine (their digest matches; "
                         "their build is then not timed) (default: build them afresh)")
    ap.add_argument("--cache-memory", default=CACHE_MEMORY_DEFAULT,
                    help="the process's memory budget, as on the index commands (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/milvus_graph", help="results folder (default: %(default)s)")
    args = ap.parse_args()
    set_memory_budget(args.cache_memory)
    with tempfile.TemporaryDirectory(prefix="milvus_graph_") as wd:
        r = run(args, Path(wd))
    command = "python bench/milvus_graph.py --uri URI" + (f" --n {args.n}" if args.n != 100_000 else "") + (
        f" --index-type {args.index_type}" if args.index_type != "HNSW" else "") + (
        f" --rerankers {args.rerankers}" if args.rerankers != ap.get_default("rerankers") else "") + (
        f" --item-truncation {args.item_truncation}" if args.item_truncation != L - 1 else "") + (
        " --reuse" if args.reuse else "") + (" --keep-lists" if args.keep_lists else "") + (
        f" --cache-memory {args.cache_memory}" if args.cache_memory != CACHE_MEMORY_DEFAULT else "")
    write_json(Path(args.out) / "results.json", r)
    write_text(Path(args.out) / "results.md", markdown(r, command))
    print(markdown(r, command))


if __name__ == "__main__":
    main()
