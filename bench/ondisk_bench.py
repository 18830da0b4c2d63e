"""IVF with on-disk inverted lists (index/backends/ondisk.py) on synthetic data.

  python bench/ondisk_bench.py --n 1000000 [--threads 1] [--workdir /tmp/ondisk_bench] [--out bench/results/ondisk]

Data: N unit vectors in d = 128 from 1000 classes (centre + noise, rows in random
class order); the class centres vary mostly in a 32-d subspace U, and the neck W
(k = 32) reads mostly U, so M* = WᵀW differs from the identity as a trained one does.
200 queries are fresh draws from the same classes.

Each phase runs in its own subprocess, so its peak RSS (VmHWM: anonymous memory plus
the file pages it has mapped, e.g. the memory-mapped features and lists) is its own;
a sampler thread also records the peak anonymous RSS (RssAnon, every 20 ms).
  gen     features.npy written in chunks
  build   build_ondisk_ivf: train on a sample, one shard per 10⁶ rows, merge_ondisk
  cosine  build_cosine_lists for trained: the same route over Lx/‖Lx‖ (M* = LᵀL, 32 dimensions)
  truth   exact top-10 per strategy, streaming the features in chunks (batched brute force)
  search  recall@10 per strategy × nprobe (all queries); then single-query ms/query, 1 FAISS
          thread, interleaved with exact FAISS Flat over the same features in RAM (the ratio
          is the figure to read: the machine is shared) when RAM allows it.  Cosine (from its
          cosine lists) against the inner-product search (trained, bilinear), each at its
          smallest nprobe reaching a recall target, timed interleaved; and cosine from inner-
          product candidates of the base lists (no cosine lists), for comparison
  cold    the features' and lists' pages evicted (posix_fadvise DONTNEED on our own files),
          then single queries on a freshly opened index: ms/query and MB read from disk
Results are merged by N into OUT/results.json and OUT/results.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import faiss
import numpy as np

from core.atomic import write_json, write_text
from index.backends.gallery import exact_top
from index.backends.ondisk import OnDiskIVF, build_cosine_lists, build_ondisk_ivf, default_nlist
from index.refinements import refine

D, K_EMB, CLASSES, SUB, K = 128, 32, 1000, 32, 10
CHUNK = 262_144
STRATEGIES = [("trained", {}, "bilinear"), ("identity", {}, "bilinear"),
              ("diagonal", {"r": 0.5, "seed": 0}, "bilinear"), ("random", {"r": 0.5, "seed": 0}, "bilinear"),
              ("trained", {}, "cosine")]


def label(s) -> str:
    name, params, mode = s
    return name + (f"(r={params['r']})" if "r" in params else "") + ("" if mode == "bilinear" else " cosine")


# ---------------------------------------------------------------- measuring
def status_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


class AnonPeak:
    """Peak RssAnon, sampled every 20 ms (the kernel keeps a peak only of the total RSS)."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, status_kb("RssAnon"))
            self._stop.wait(0.02)

    def stop(self) -> dict:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, status_kb("RssAnon"))
        return {"peak_rss_mb": status_kb("VmHWM") / 1024, "peak_anon_rss_mb": self.peak / 1024}


def disk_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- data
def model(seed: int = 0):
    rng = np.random.default_rng(seed)
    U, _ = np.linalg.qr(rng.standard_normal((D, SUB)))
    centres = U @ rng.standard_normal((SUB, CLASSES)) + 0.3 * rng.standard_normal((D, CLASSES))
    centres = (centres / np.linalg.norm(centres, axis=0)).T.astype(np.float32)
    W = (rng.standard_normal((K_EMB, SUB)) / np.sqrt(SUB)) @ U.T + 0.05 * rng.standard_normal((K_EMB, D)) / np.sqrt(D)
    return centres, W.astype(np.float32)


def draw(centres: np.ndarray, n: int, rng) -> np.ndarray:
    x = centres[rng.integers(0, CLASSES, n)] + 0.07 * rng.standard_normal((n, D), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def metrics(W: np.ndarray):
    Wd = W.astype(np.float64)
    M_star = Wd.T @ Wd
    return [(s, refine(s[0], M_star, s[1])) for s in STRATEGIES]


# ---------------------------------------------------------------- phases (each in its own process)
def phase_gen(wd: Path, n: int) -> dict:
    centres, W = model()
    np.save(wd / "W.npy", W)
    np.save(wd / "queries.npy", draw(centres, 200, np.random.default_rng(10**9)))
    t = time.perf_counter()
    out = np.lib.format.open_memmap(wd / "features.tmp.npy", mode="w+", dtype=np.float32, shape=(n, D))
    for i, s in enumerate(range(0, n, CHUNK)):
        e = min(n, s + CHUNK)
        out[s:e] = draw(centres, e - s, np.random.default_rng(i + 1))
    out.flush()
    del out
    os.replace(wd / "features.tmp.npy", wd / "features.npy")
    return {"gen_s": time.perf_counter() - t}


def phase_build(wd: Path, n: int, nlist: int) -> dict:
    mon = AnonPeak()
    t = time.perf_counter()
    build_ondisk_ivf(wd / "features.npy", wd / "ivf", nlist=nlist, normalize=True)
    build_s = time.perf_counter() - t
    sizes = {f.name: f.stat().st_size for f in (wd / "ivf").iterdir()}
    return {"build_s": build_s, **mon.stop(), "index_bytes": sum(sizes.values()), "files": sizes,
            "features_bytes": (wd / "features.npy").stat().st_size}


def phase_cosine(wd: Path, n: int) -> dict:
    mon = AnonPeak()
    W = np.load(wd / "W.npy").astype(np.float64)
    t = time.perf_counter()
    out = build_cosine_lists(wd / "ivf", "trained", M=W.T @ W)   # the bench's IVF keeps no neck: M* given
    build_s = time.perf_counter() - t
    man = json.loads((out / "cosine.json").read_text())
    return {"build_s": build_s, **mon.stop(), "rank": man["rank"],
            "bytes": sum(f.stat().st_size for f in out.iterdir())}


def phase_truth(wd: Path, n: int) -> dict:
    W, Q = np.load(wd / "W.npy"), np.load(wd / "queries.npy")
    ms = metrics(W)
    qts = []
    for (_, _, mode), M in ms:
        qt = Q @ M.astype(np.float32)
        if mode == "cosine":
            qt /= np.sqrt(np.einsum("ij,ij->i", qt, Q))[:, None]
        qts.append(qt)
    heaps = [faiss.ResultHeap(len(Q), K, keep_max=True) for _ in ms]
    X = np.load(wd / "features.npy", mmap_mode="r")
    t = time.perf_counter()
    for s in range(0, n, CHUNK):
        x = np.array(X[s: s + CHUNK])
        ids = np.broadcast_to(np.arange(s, s + len(x), dtype=np.int64), (len(Q), len(x)))
        for ((_, _, mode), M), qt, heap in zip(ms, qts, heaps, strict=True):
            sc = qt @ x.T
            if mode == "cosine":
                sc /= np.sqrt(np.maximum(np.einsum("ij,ij->i", x @ M.astype(np.float32), x), 1e-30))[None]
            heap.add_result(np.ascontiguousarray(sc), np.ascontiguousarray(ids))
    for h in heaps:
        h.finalize()
    np.save(wd / "truth.npy", np.stack([h.I for h in heaps]))
    return {"truth_s": time.perf_counter() - t,
            "exact_stream_ms_per_query": (time.perf_counter() - t) / (len(Q) * len(ms)) * 1e3}


def recall_of(got: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / K for a, b in zip(got, truth, strict=True)]))


def cosine_from_ip_candidates(ivf: OnDiskIVF, qm, Q: np.ndarray, kc: int, nprobe: int) -> np.ndarray:
    """Cosine without cosine lists: kc candidates by the inner product with M′q/‖q‖_M′ from the
    base lists (blind to 1/‖x‖_M′), re-ranked exactly; the rows of the top K."""
    qt = qm.transform(ivf.prepare_queries(Q))
    _, cand = ivf._search(qt, kc, params=faiss.SearchParametersIVF(nprobe=nprobe))
    out = []
    for q, c in zip(qt, cand, strict=True):
        c = np.sort(c[c >= 0])
        X = np.asarray(ivf.features[c])
        out.append(exact_top(q, c, X, qm.norms(X), K)[0])
    return np.stack(out)


def phase_search(wd: Path, n: int, nprobes: list[int], single: int, threads: int = 2,
                 targets: tuple[float, ...] = (0.95, 0.99)) -> dict:
    from threadpoolctl import threadpool_limits

    mon = AnonPeak()
    W, Q, truth = np.load(wd / "W.npy"), np.load(wd / "queries.npy"), np.load(wd / "truth.npy")
    ivf = OnDiskIVF(wd / "ivf")
    nprobes = [p for p in nprobes if p <= ivf.manifest["nlist"]]
    qms = [(s, ivf.metric(M, s[2])) for s, M in metrics(W)]
    faiss.omp_set_num_threads(threads)
    recall = {}
    for (s, qm), tr in zip(qms, truth, strict=True):
        for p in nprobes:
            recall[f"{label(s)}|{p}"] = recall_of(ivf.search_metric(Q, qm, K, nprobe=p).rows, tr)
    out = {"recall": recall, "nprobes": nprobes}
    p_mid = nprobes[len(nprobes) // 2]
    (cs, cqm), ctr = [(sq, t) for sq, t in zip(qms, truth, strict=True) if sq[0][2] == "cosine"][0]
    (bs, bqm), = [sq for sq in qms if sq[0][0] == "trained" and sq[0][2] == "bilinear"]
    # cosine from the base lists' inner-product candidates (blind to 1/‖x‖_M′) against a wider pool
    out["cosine_ip_candidates"] = {}
    for kc in (400, 1600, 6400):
        t = time.perf_counter()
        got = cosine_from_ip_candidates(ivf, cqm, Q, min(kc, n), p_mid)
        out["cosine_ip_candidates"][kc] = {"recall": recall_of(got, ctr), "nprobe": p_mid,
                                           "batch_ms_per_query": (time.perf_counter() - t) / len(Q) * 1e3}
    # single queries: FAISS on 1 thread and numpy BLAS on 1 thread, as a serving process runs
    faiss.omp_set_num_threads(1)
    blas = threadpool_limits(1, "blas")
    ms = {}
    for s, qm in qms:
        for p in nprobes:
            ivf.search_metric(Q[:1], qm, K, nprobe=p)
            t = time.perf_counter()
            for i in range(single):
                ivf.search_metric(Q[i: i + 1], qm, K, nprobe=p)
            ms[f"{label(s)}|{p}"] = (time.perf_counter() - t) / single * 1e3
    # cosine vs the inner-product search at the same recall: each at its smallest nprobe reaching
    # the target, single queries interleaved so that the shared machine's load hits both alike
    out["cosine_vs_ip"] = {}
    for target in targets:
        pick = {}
        for name, s in (("cosine", cs), ("ip", bs)):
            ok = [p for p in nprobes if out["recall"][f"{label(s)}|{p}"] >= target]
            pick[name] = ok[0] if ok else None
        if None in pick.values():
            out["cosine_vs_ip"][str(target)] = {"not_reached": [k for k, v in pick.items() if v is None]}
            continue
        t_c = t_b = 0.0
        for i in range(single):
            q = Q[i: i + 1]
            t = time.perf_counter()
            ivf.search_metric(q, cqm, K, nprobe=pick["cosine"])
            t_c += time.perf_counter() - t
            t = time.perf_counter()
            ivf.search_metric(q, bqm, K, nprobe=pick["ip"])
            t_b += time.perf_counter() - t
        out["cosine_vs_ip"][str(target)] = {
            "cosine_nprobe": pick["cosine"], "cosine_recall": out["recall"][f"{label(cs)}|{pick['cosine']}"],
            "ip_nprobe": pick["ip"], "ip_recall": out["recall"][f"{label(bs)}|{pick['ip']}"],
            "cosine_ms": t_c / single * 1e3, "ip_ms": t_b / single * 1e3, "ratio": t_c / t_b}
    out |= {"ms_per_query": ms, **mon.stop()}
    avail = status_meminfo("MemAvailable")
    need = (wd / "features.npy").stat().st_size
    if avail < 3 * need:
        out["flat"] = f"skipped: exact Flat in RAM needs {need / 2**30:.1f} GiB; {avail / 2**30:.1f} GiB available"
        blas.restore_original_limits()
        return out
    flat = faiss.IndexFlatIP(D)
    X = np.load(wd / "features.npy", mmap_mode="r")
    for s in range(0, n, CHUNK):
        flat.add(np.array(X[s: s + CHUNK]))
    # interleaved: ours at the median nprobe vs Flat, query by query, so load on the shared machine hits both
    pairs = {}
    for s, qm in qms:
        t_o = t_f = 0.0
        for i in range(single):
            q = Q[i: i + 1]
            t = time.perf_counter()
            ivf.search_metric(q, qm, K, nprobe=p_mid)
            t_o += time.perf_counter() - t
            t = time.perf_counter()
            flat.search(qm.transform(q), K)
            t_f += time.perf_counter() - t
        pairs[label(s)] = {"nprobe": p_mid, "ours_ms": t_o / single * 1e3, "flat_ms": t_f / single * 1e3,
                           "ratio": t_o / t_f}
    out["vs_flat"] = pairs
    blas.restore_original_limits()
    return out


def status_meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def phase_cold(wd: Path, n: int, nprobe: int, single: int) -> dict:
    from threadpoolctl import threadpool_limits

    W, Q = np.load(wd / "W.npy"), np.load(wd / "queries.npy")
    (s, M), = [m for m in metrics(W) if m[0][0] == "trained" and m[0][2] == "bilinear"]
    for f in ("features.npy", "ivf/ivf.ivfdata"):
        evict(wd / f)
    faiss.omp_set_num_threads(1)
    blas = threadpool_limits(1, "blas")
    r0 = disk_read_bytes()
    t = time.perf_counter()
    ivf = OnDiskIVF(wd / "ivf")
    open_s = time.perf_counter() - t
    qm = ivf.metric(M)
    r1 = disk_read_bytes()
    t = time.perf_counter()
    for i in range(single):
        ivf.search_metric(Q[100 + i: 101 + i], qm, K, nprobe=nprobe)
    ms = (time.perf_counter() - t) / single * 1e3
    blas.restore_original_limits()
    return {"strategy": label(s), "nprobe": nprobe, "open_s": open_s, "ms_per_query": ms,
            "mb_read_per_query": (disk_read_bytes() - r1) / single / 2**20, "open_mb_read": (r1 - r0) / 2**20}


PHASES = {"gen": phase_gen, "build": phase_build, "cosine": phase_cosine, "truth": phase_truth,
          "search": phase_search, "cold": phase_cold}


def run_phase(name: str, wd: Path, reuse: bool = False, **kw) -> dict:
    if reuse and (wd / f"{name}.json").is_file():
        print(f"{wd.name}: {name} reused from {wd / f'{name}.json'}", file=sys.stderr, flush=True)
        return json.loads((wd / f"{name}.json").read_text())
    print(f"[{time.strftime('%H:%M:%S')}] {wd.name}: {name} …", file=sys.stderr, flush=True)
    t = time.perf_counter()
    r = subprocess.run([sys.executable, __file__, "--phase", name, "--workdir", str(wd), "--kw", json.dumps(kw)],
                       stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        raise SystemExit(f"phase {name} failed:\n{r.stderr[-3000:]}")
    res = json.loads((wd / f"{name}.json").read_text())
    print(f"   {time.perf_counter() - t:.0f} s  {json.dumps(res)[:300]}", file=sys.stderr, flush=True)
    return res


# ---------------------------------------------------------------- report
def markdown(results: dict) -> str:
    md = ["Synthetic unit vectors, d = 128, 1000 classes, W: 32 × 128; 200 queries; k = 10. "
          "IVF-SQ8 with on-disk lists; candidates re-ranked exactly under M′ from the memory-mapped features.",
          "Cosine mode searches the trained strategy's cosine lists (an IVF-SQ8 over Lx/‖Lx‖, M* = LᵀL, 32-d).",
          "", "| N | nlist | build s | peak RSS MB (anon) | features MB | index on disk MB | cosine lists: build s, "
          "peak RSS MB (anon), MB on disk | gen s |",
          "|---|---|---|---|---|---|---|---|"]
    for n, r in sorted(results.items(), key=lambda kv: int(kv[0])):
        b, c = r["build"], r["cosine"]
        md.append(f"| {int(n):,} | {r['nlist']} | {b['build_s']:.0f} | "
                  f"{b['peak_rss_mb']:.0f} ({b['peak_anon_rss_mb']:.0f}) "
                  f"| {b['features_bytes'] / 2**20:.0f} | {b['index_bytes'] / 2**20:.0f} "
                  f"| {c['build_s']:.0f}, {c['peak_rss_mb']:.0f} ({c['peak_anon_rss_mb']:.0f}), "
                  f"{c['bytes'] / 2**20:.0f} "
                  f"| {r['gen']['gen_s']:.0f} |")
    for n, r in sorted(results.items(), key=lambda kv: int(kv[0])):
        s = r["search"]
        md += ["", f"N = {int(n):,}: recall@10 vs exact / single-query ms (1 thread, warm page cache); search-phase "
               f"peak RSS {s['peak_rss_mb']:.0f} MB ({s['peak_anon_rss_mb']:.0f} anon)", "",
               "| strategy | " + " | ".join(f"nprobe {p}" for p in s["nprobes"]) + " |",
               "|---|" + "---|" * len(s["nprobes"])]
        for st in STRATEGIES:
            lb = label(st)
            md.append(f"| {lb} | " + " | ".join(f"{s['recall'][f'{lb}|{p}']:.3f} / {s['ms_per_query'][f'{lb}|{p}']:.2f}"
                                                for p in s["nprobes"]) + " |")
        md += ["", "Cosine (trained) at the same recall as the inner-product search (trained, bilinear): each at "
               "its smallest nprobe reaching the target, single queries interleaved in one run.", "",
               "| recall target | cosine nprobe | cosine recall / ms | inner product nprobe "
               "| inner product recall / ms | ratio (cosine / inner product) |", "|---|---|---|---|---|---|"]
        for target, v in s["cosine_vs_ip"].items():
            if "not_reached" in v:
                md.append(f"| {target} | not reached by {', '.join(v['not_reached'])} | | | | |")
                continue
            md.append(f"| {target} | {v['cosine_nprobe']} | {v['cosine_recall']:.3f} / {v['cosine_ms']:.2f} "
                      f"| {v['ip_nprobe']} | {v['ip_recall']:.3f} / {v['ip_ms']:.2f} | {v['ratio']:.2f} |")
        md += ["", "Cosine (trained) from the base lists' inner-product candidates instead (no cosine lists): "
               + "; ".join(
            f"{kc} candidates → recall {v['recall']:.3f} ({v['batch_ms_per_query']:.2f} ms/query batched)"
            for kc, v in s["cosine_ip_candidates"].items())
            + f" at nprobe {next(iter(s['cosine_ip_candidates'].values()))['nprobe']}."]
        if isinstance(s.get("flat"), str):
            md += ["", f"Exact Flat reference: {s['flat']}."]
        else:
            md += ["", "| strategy | nprobe | on-disk IVF ms/query | exact Flat (RAM) ms/query | ratio |",
                   "|---|---|---|---|---|"]
            md += [f"| {lb} | {v['nprobe']} | {v['ours_ms']:.2f} | {v['flat_ms']:.2f} | {v['ratio']:.3f} |"
                   for lb, v in s["vs_flat"].items()]
        c = r["cold"]
        md += ["", f"Cold page cache ({c['strategy']}, nprobe {c['nprobe']}): open {c['open_s']:.2f} s, "
               f"{c['ms_per_query']:.1f} ms/query, {c['mb_read_per_query']:.2f} MB read from disk per query. "
               f"Exact brute force streamed from the features (batched, all queries): "
               f"{r['truth']['exact_stream_ms_per_query']:.2f} ms/query."]
    return "\n".join(md) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="gallery rows (default: %(default)s)")
    ap.add_argument("--nlist", type=int, default=0,
                    help="IVF lists (default 0: index.backends.ondisk.default_nlist(N))")
    ap.add_argument("--nprobe", default="4,8,16,32,64,128", help="nprobe values (default: %(default)s)")
    ap.add_argument("--single", type=int, default=50, help="single queries timed per setting (default: %(default)s)")
    ap.add_argument("--workdir", default="/tmp/ondisk_bench",
                    help="scratch folder for data and index (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/ondisk", help="results folder (default: %(default)s)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch data (default: deleted after the run)")
    ap.add_argument("--reuse", action="store_true",
                    help="reuse the phases a kept WORKDIR/N… already holds results of (default: run every phase)")
    ap.add_argument("--threads", type=int, default=2,
                    help="FAISS threads of the batched recall searches; single queries use 1 (default: %(default)s)")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--kw", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        wd = Path(args.workdir)
        write_json(wd / f"{args.phase}.json", PHASES[args.phase](wd, **json.loads(args.kw)))
        return
    wd = Path(args.workdir) / f"N{args.n}"
    wd.mkdir(parents=True, exist_ok=True)
    nlist = args.nlist or default_nlist(args.n)
    nprobes = [int(p) for p in args.nprobe.split(",")]
    r = {"nlist": nlist}
    re = args.reuse
    r["gen"] = run_phase("gen", wd, re, n=args.n)
    r["build"] = run_phase("build", wd, re, n=args.n, nlist=nlist)
    r["cosine"] = run_phase("cosine", wd, re, n=args.n)
    r["truth"] = run_phase("truth", wd, re, n=args.n)
    r["search"] = run_phase("search", wd, re, n=args.n, nprobes=nprobes, single=args.single, threads=args.threads)
    r["cold"] = run_phase("cold", wd, re, n=args.n, nprobe=nprobes[len(nprobes) // 2], single=min(args.single, 20))
    out = Path(args.out)
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {}
    results[str(args.n)] = r
    write_json(path, results)
    write_text(out / "results.md", markdown(results))
    print(markdown(results))
    if not args.keep:
        import shutil

        shutil.rmtree(wd)


if __name__ == "__main__":
    main()
