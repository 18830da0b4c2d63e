"""k-reciprocal re-ranking on an on-disk IVF with the gallery's keys in RAM (a memory budget they
fit) against streamed from the memory-mapped features (a budget they exceed: keys are kept only
while they take at most half of it): peak RSS and ms per query, each budget in its own process.

  python bench/ondisk_rerank_memory.py [--n 200000] [--queries 256] [--small 128M] [--threads 1]
                                       [--workdir /tmp/ondisk_rerank_memory]
                                       [--out bench/results/ondisk_rerank_memory]

Synthetic gallery as bench/neighbour_lists.py's (d = 128, around N/30 class centres, L2-normalised,
a random 64 × d neck), written as an index directory and its on-disk IVF (kept in --workdir).
One process fills the offline store (neighbour lists, row extremes, k-reciprocal's sets and
inverted index; default budget); then one process per row loads them (the default budget, the
same with the keys streamed by force — the keys' rule alone — and the small budget), runs one batch of
queries (artefacts read, keys built where they fit), and times the next --queries queries
(k-reciprocal defaults, the whole gallery ranked, trained M′, cosine, k = 10).  Peak RSS: the
process's VmHWM (imports and the gallery's opening included), and /usr/bin/time's figure.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

D, K_EMB, PER_CLASS, K = 128, 64, 30, 10
WARM = 32  # queries of the first, untimed call


def status() -> dict[str, int]:
    """This process's VmHWM, VmRSS, RssAnon and RssFile in KiB."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[name] = int(value.split()[0])
    return out


def mapped(under: str) -> dict[str, int]:
    """KiB resident of each file under `under` this process maps (the features, the IVF lists)."""
    out: dict[str, int] = {}
    name = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+$", head[0]):
            name = head[5] if len(head) > 5 and head[5].startswith(under) else None
        elif name and head[0] == "Rss:":
            out[name[len(under):].lstrip("/")] = out.get(name[len(under):].lstrip("/"), 0) + int(head[1])
    return out


def build(work: Path, n: int) -> Path:
    from index.backends.ondisk import build_for_index
    from index.backends.store import Items, write_index

    idx = work / "index"
    if (idx / "ivf_ondisk" / "ondisk.json").is_file():
        return idx
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((max(1, n // PER_CLASS), D)).astype(np.float32)
    lab = rng.integers(0, len(centres), n)
    x = centres[lab] + 1.2 * rng.standard_normal((n, D)).astype(np.float32)
    W = (rng.standard_normal((K_EMB, D)) / np.sqrt(D)).astype(np.float32)
    items = Items(np.arange(n), lab, [f"x/{i}.png" for i in range(n)], ["test"] * n)
    write_index(idx, x, items, W, normalize=True, info={"backbone": "none"})
    build_for_index(idx)
    return idx


def queries(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, D)).astype(np.float32)


def search(args) -> None:
    """One process: the on-disk gallery under --cache-memory, a warm call, then the timed one."""
    import faiss
    from threadpoolctl import threadpool_limits

    from index.backends.ondisk import OnDiskIVF
    from index.search_config import SearchConfig
    from index.space import set_memory_budget

    faiss.omp_set_num_threads(args.threads)
    threadpool_limits(args.threads)
    set_memory_budget(args.cache_memory)
    if args.stream_keys:  # the keys' rule alone: streamed under a budget they fit
        from index.space import searcher_space

        searcher_space.KEYS_SHARE = 1 << 62
    g = OnDiskIVF(Path(args.workdir) / "index" / "ivf_ondisk")
    cfg = SearchConfig.of("trained", {}, "cosine", "kreciprocal", {})
    opened = status()
    t0 = time.perf_counter()
    cfg.search(g, queries(WARM, 1), K)
    warm = time.perf_counter() - t0
    if args.offline_only:
        print(json.dumps({"offline_s": warm}))
        return
    t0 = time.perf_counter()
    h = cfg.search(g, queries(args.queries, 2), K)
    took = time.perf_counter() - t0
    space = cfg.space(g)
    print(json.dumps({"cache_memory": args.cache_memory, "stream_keys": args.stream_keys,
                      "ms_per_query": 1000 * took / args.queries, "warm_s": warm, "keys_held": space.held("keys"),
                      "keys_fit": space.keys_fit(), "opened_kib": opened, "end_kib": status(),
                      "mapped_kib": mapped(str(Path(args.workdir).resolve())), "rows_digest": int(h.rows.sum())}))


def child(args, cache_memory: str, *extra: str) -> dict:
    cmd = [sys.executable, __file__, "search", "--workdir", args.workdir, "--cache-memory", cache_memory,
           "--queries", str(args.queries), "--threads", str(args.threads), *extra]
    env = {**os.environ, "XDG_CACHE_HOME": str(Path(args.workdir) / "xdg"), "OMP_NUM_THREADS": str(args.threads)}
    p = subprocess.run(["/usr/bin/time", "-v", *cmd], env=env, capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"error: {shlex.join(cmd)} failed:\n{p.stderr[-3000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    peak = re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr)
    out["time_max_rss_kib"] = int(peak.group(1)) if peak else None
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default="run", choices=["run", "search"],
                    help="run: the whole measurement (default); search: one measured process")
    ap.add_argument("--n", type=int, default=200_000, help="gallery size (default: %(default)s)")
    ap.add_argument("--queries", type=int, default=256, help="timed queries (default: %(default)s)")
    ap.add_argument("--small", default="128M", help="the budget the keys exceed (default: %(default)s)")
    ap.add_argument("--cache-memory", default="4G", help="search: this process's budget (default: %(default)s)")
    ap.add_argument("--offline-only", action="store_true", help="search: fill the offline store and stop")
    ap.add_argument("--stream-keys", action="store_true", help="search: stream the keys whatever the budget")
    ap.add_argument("--threads", type=int, default=1, help="FAISS and BLAS threads (default: %(default)s)")
    ap.add_argument("--workdir", default="/tmp/ondisk_rerank_memory", help="(default: %(default)s)")
    ap.add_argument("--out", default="bench/results/ondisk_rerank_memory", help="(default: %(default)s)")
    args = ap.parse_args()
    if args.what == "search":
        return search(args)

    from core.atomic import write_json, write_text
    from core.flags import CACHE_MEMORY_DEFAULT

    work = Path(args.workdir)
    t0 = time.perf_counter()
    build(work, args.n)
    print(f"built in {time.perf_counter() - t0:.0f} s", flush=True)
    offline = child(args, CACHE_MEMORY_DEFAULT, "--offline-only")
    print("offline", offline, flush=True)
    rows = [child(args, CACHE_MEMORY_DEFAULT), child(args, CACHE_MEMORY_DEFAULT, "--stream-keys"),
            child(args, args.small)]
    for r in rows:
        print(r, flush=True)
    assert len({r["rows_digest"] for r in rows}) == 1, "the budgets ranked differently"
    meta = {"command": "python bench/ondisk_rerank_memory.py " + shlex.join(sys.argv[1:]),
            "date": _dt.date.today().isoformat(), "n": args.n, "dim": D, "queries": args.queries,
            "threads": args.threads, "key_mib": args.n * D * 4 / 2**20, "offline_s": offline["offline_s"],
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"}
    out = Path(args.out)
    write_json(out / "results.json", {"meta": meta, "rows": rows})
    lines = [f"# k-reciprocal on the on-disk IVF: keys in RAM against streamed ({meta['date']})", "",
             f"`{meta['command']}`; {meta['machine']}; {args.threads} thread(s); N = {args.n:,}, d = {D} "
             f"(keys: {meta['key_mib']:.0f} MiB); trained M′, cosine, k-reciprocal defaults, k = {K}; "
             f"a first process filled the offline store or, where --workdir held it, read it "
             f"({offline['offline_s']:.0f} s).", "",
             "| --cache-memory | keys | peak RSS (VmHWM) MiB | /usr/bin/time max RSS MiB | RSS after opening MiB "
             "| at the end: anonymous MiB | at the end: features.npy's pages MiB | ms / query | ÷ held |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        keys = "held" if r["keys_held"] else "streamed" + (" (forced, bench only)" if r["stream_keys"] else "")
        lines.append(f"| {r['cache_memory']} | {keys} | {r['end_kib']['VmHWM'] / 1024:.0f} | "
                     f"{(r['time_max_rss_kib'] or 0) / 1024:.0f} | {r['opened_kib']['VmRSS'] / 1024:.0f} | "
                     f"{r['end_kib']['RssAnon'] / 1024:.0f} | "
                     f"{r['mapped_kib'].get('index/features.npy', 0) / 1024:.0f} | {r['ms_per_query']:.1f} | "
                     f"{r['ms_per_query'] / rows[0]['ms_per_query']:.2f} |")
    write_text(out / "results.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
