"""The kanji test split in a large gallery, as the +1M distractor protocol of the revisited
Oxford/Paris sets: the queries and their classes stay the test split's (leave-one-out among the
test items), the gallery is the test items + D distractors, each labelled with a class no query has.

  python bench/distractors.py --checkpoint CK [--data-root R] [--feature-cache C] [--cache DIR]
      [--levels 0,100000,1000000] [--real 100000] [--queries 1000] [--cells SPEC] [--threads 1]
      [--rerank-param NAME.KEY=VALUE ...]
      [--out bench/results/distractors]

Distractors up to --real are real: kanji of none of the data set's 500 classes, in its 23 fonts,
two jittered copies each (data.kanji.render_distractors), embedded with the checkpoint's trunk
(cached under --cache).  Beyond --real they are synthetic trunk features, with no image: a
Gaussian mixture fitted to the real distractors, one equally weighted component per
distractor character with its images' mean and full covariance (so the draws stay in the
subspace the character's images span), clipped at 0 as the real features are.  Each (level,
strategy) runs in its own process (peak RSS = its VmHWM) with an empty re-ranking cache; the
offline passes are timed as each re-ranker's first call builds them (in the order given: a pass
an earlier re-ranker built is not paid again), online ms per query is the re-ranked search of
--queries test queries (a fixed draw, the same at every level).
`--cells` picks the re-rankers per (level, strategy): `LEVEL:STRATEGY:rr+rr;…` (default: all).
The trained strategy [cosine] is searched as identity [cosine] over Wx (the same ranking: cosine
of Wx), so that 10⁶ gallery items are 128-d, not 1280-d.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RERANK_ORDER = ("none", "aqe", "dba", "kreciprocal", "diffusion", "diffusion_offline")
STRATEGIES = ("trained", "identity", "selected")


def vm_hwm_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def clocked(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


# ------------------------------------------------------------------ distractor features

def real_features(args) -> tuple[np.ndarray, np.ndarray]:
    """(features n × d, character of each) of the first --real distractors, embedded once and cached."""
    from core.hashing import sha256_file
    from data.kanji import RENDER_VERSION

    ck = Path(args.checkpoint)
    key = hashlib.sha256(json.dumps({"ck": sha256_file(ck), "n": args.real, "copies": args.copies,
                                     "seed": args.jitter_seed, "v": RENDER_VERSION, "data_seed": 0,
                                     "classes": 500, "size": 64}).encode()).hexdigest()[:12]
    path = Path(args.cache) / f"real-{args.real}-{key}.npz"
    if path.is_file():
        z = np.load(path)
        return z["features"], z["chars"]
    # embedded in --embed-workers processes of one thread, each a contiguous block of the draws
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = [path.with_suffix(f".part{i}.npz") for i in range(args.embed_workers)]
    t = time.time()
    procs = [subprocess.Popen([sys.executable, __file__, "--checkpoint", str(ck), "--real", str(args.real),
                               "--copies", str(args.copies), "--jitter-seed", str(args.jitter_seed),
                               "--embed-part", f"{i}/{args.embed_workers}", "--result", str(part),
                               *(["--data-root", args.data_root] if args.data_root else [])])
             for i, part in enumerate(parts) if not part.is_file()]
    if any(p.wait() for p in procs):
        raise SystemExit("error: embedding the distractors failed")
    zs = [np.load(p) for p in parts]
    F = np.concatenate([z["features"] for z in zs]).astype(np.float32)
    C = np.concatenate([z["chars"] for z in zs])
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, features=F, chars=C, seconds=time.time() - t)
    tmp.rename(path)
    for p in parts:
        p.unlink()
    return F, C


def embed_part(args) -> None:
    """Render and embed block i of n of the --real distractor draws (one process, one thread)."""
    import itertools

    import torch
    from PIL import Image

    from data.kanji import KanjiConfig, render_distractors
    from index.embedder import ImageEmbedder

    torch.set_num_threads(1)
    i, n = (int(v) for v in args.embed_part.split("/"))
    lo, hi = args.real * i // n, args.real * (i + 1) // n
    emb = ImageEmbedder(Path(args.checkpoint))
    cfg = KanjiConfig(root=args.data_root or KanjiConfig.root)
    feats, chars, batch = [], [], []
    t = time.time()

    def flush():
        feats.append(emb.features([Image.fromarray(a).convert("RGB") for a in batch]))
        batch.clear()
    draws = render_distractors(cfg, args.real, copies=args.copies, seed=args.jitter_seed)
    for cp, _, _, a in itertools.islice(draws, lo, hi):
        batch.append(a)
        chars.append(cp)
        if len(batch) == 256:
            flush()
            if len(chars) % 5120 == 0:
                print(f"part {i}: embedded {len(chars):,} of {hi - lo:,} in {time.time() - t:.0f} s", flush=True)
    if batch:
        flush()
    tmp = Path(args.result).with_suffix(".tmp.npz")
    np.savez(tmp, features=np.concatenate(feats).astype(np.float32), chars=np.asarray(chars, np.int64))
    tmp.rename(args.result)


def synthetic_features(real: np.ndarray, chars: np.ndarray, n: int, out: np.ndarray, seed: int = 0,
                       project=None) -> dict:
    """Fill `out` (n rows) with draws of the Gaussian mixture fitted to the real distractors: one
    equally weighted component per character, with its images' mean μ and covariance Σ (full,
    of rank ≤ its image count − 1: the images span the subspace the draws stay in).  A draw is
    μ + Σ_i z_i (x_i − μ) / √m over the character's m images x_i, z ~ N(0, I), whose covariance is
    Σ exactly; clipped at 0 where the real features are all non-negative.  `project` maps each
    block before it is stored (e.g. normalise and × Wᵀ)."""
    uniq, inv = np.unique(chars, return_inverse=True)
    order = np.argsort(inv, kind="stable")
    starts = np.concatenate([np.searchsorted(inv[order], np.arange(len(uniq))), [len(inv)]])
    nonneg = bool((real >= 0).all())
    rng = np.random.default_rng(seed)
    comp = np.sort(rng.integers(0, len(uniq), n))  # each draw's character, the draws grouped by it
    first = np.searchsorted(comp, np.arange(len(uniq) + 1))
    block: list[np.ndarray] = []
    done = held = 0
    for c in range(len(uniq)):
        x = real[order[starts[c]: starts[c + 1]]].astype(np.float32)
        mu = x.mean(0)
        z = rng.standard_normal((first[c + 1] - first[c], len(x)), dtype=np.float32)
        draws = mu + z @ ((x - mu) / np.float32(np.sqrt(len(x))))
        if nonneg:
            np.maximum(draws, 0, out=draws)
        block.append(draws)
        held += len(draws)
        if held >= 65536 or c == len(uniq) - 1:
            b = np.concatenate(block)
            out[done: done + len(b)] = project(b) if project else b
            done += len(b)
            block, held = [], 0
    return {"components": int(len(uniq)), "covariance": "full (the images' own)", "clipped_at_0": nonneg,
            "seed": seed}


# ------------------------------------------------------------------ one (level, strategy)

def run_cell(args) -> dict:
    """One process: the gallery at one level under one strategy, each re-ranker in turn."""
    import index.rerankers.neighbours as nb

    if args.approximate_above is not None:  # the offline passes' switch to the HNSW index
        nb.APPROXIMATE_ABOVE = args.approximate_above
    import faiss
    from threadpoolctl import threadpool_limits

    from core.arrays import l2_normalize
    from data import DataConfig
    from evaluation.evaluator import DEFAULT_KS, per_query_metrics
    from index.backends.search import Searcher
    from index.backends.store import in_memory_index
    from index.build import split_features
    from index.search_config import SearchConfig

    faiss.omp_set_num_threads(args.threads)
    threadpool_limits(args.threads)
    if args.reps > 1:  # k-reciprocal keeps a call's terms for one that differs in λ alone: not a cost
        import index.rerankers.kreciprocal.cache as kr_cache

        kr_cache.TERMS_SHARE = 1 << 62
    level, strategy = args.level, args.strategy
    out: dict = {"level": level, "strategy": strategy, "rerankers": {}}
    dcfg = DataConfig(dataset="kanji", data_root=args.data_root, num_classes=500)
    f, y, W = split_features(args.checkpoint, dcfg, "test", args.feature_cache, progress=False)
    t0 = time.perf_counter()
    real, chars = real_features(args) if level else (np.zeros((0, f.shape[1]), np.float32), None)
    n_real = min(level, len(real))

    def project(x):  # trained: cosine of Wx is the trained [cosine] ranking, in 128-d
        x = l2_normalize(x)
        return x @ W.T if strategy == "trained" else x
    # one gallery array, filled in place and L2-normalised here (in_memory_index then copies it
    # into FAISS only: a 10⁶ × 1280 gallery is 5 GB a copy)
    n = len(y) + level
    X = np.empty((n, W.shape[0] if strategy == "trained" else f.shape[1]), np.float32)
    X[: len(y)] = project(f)
    for s in range(0, n_real, 65536):
        X[len(y) + s: len(y) + min(s + 65536, n_real)] = project(real[s: min(s + 65536, n_real)])
    synth = {}
    if level > n_real:
        synth = synthetic_features(real, chars, level - n_real, out=X[len(y) + n_real:], project=project)
    del real
    labels = np.concatenate([y, np.full(n - len(y), -1, np.int64)])
    Wg = np.eye(X.shape[1], dtype=np.float32) if strategy == "trained" else W
    searcher = Searcher(in_memory_index(X, labels, Wg, normalize=False))
    out |= {"gallery": n, "real_distractors": n_real, "synthetic_distractors": level - n_real,
            "synthetic": synth, "dim": int(X.shape[1]), "load_s": time.perf_counter() - t0,
            "peak_rss_mib_after_load": vm_hwm_mib()}
    del X
    if strategy == "trained":
        cfg = SearchConfig.of("identity", {}, "cosine")
    elif strategy == "identity":
        cfg = SearchConfig.of("identity", {}, "cosine")
    else:
        sel = json.loads(Path(args.selected).read_text())
        cfg = SearchConfig.of(sel["strategy"], sel["params"], sel["mode"])
    out["setting"] = "trained · cosine (identity over Wx)" if strategy == "trained" else cfg.label()
    rr_params = json.loads(args.rerank_params)
    # queries: a fixed draw of test items (the same at every level), each left out of its own ranking
    _, inv, counts = np.unique(y, return_inverse=True, return_counts=True)
    R = counts[inv] - 1
    q = np.sort(np.random.default_rng(0).choice(len(y), min(args.queries, len(y)), replace=False))
    k = int(max(R.max(), max(DEFAULT_KS)))
    Xq = np.asarray(searcher.data.features[q], dtype=np.float32)
    for name in args.rerankers.split(","):
        c = SearchConfig.of(cfg.strategy, cfg.params, cfg.mode, name, rr_params.get(name, {}))
        # the first call builds what the re-ranker caches (its offline passes) on two queries
        _, ow, oc = clocked(lambda c=c: c.search(searcher, Xq[:2], k, self_ids=q[:2]))
        hits, w, cpu = clocked(lambda c=c: c.search(searcher, Xq, k, self_ids=q))
        got = hits.rows
        nbr = np.where(got >= 0, labels[np.maximum(got, 0)], np.iinfo(np.int64).min)
        m = per_query_metrics(nbr, y[q], R[q], DEFAULT_KS)
        out["rerankers"][name] = {
            "params": dict(c.rerank_params), "map@r": float(m["map@r"].mean()),
            "recall@1": float(m["recall@1"].mean()), "ms_per_query_wall": w / len(q) * 1e3,
            "ms_per_query_cpu": cpu / len(q) * 1e3, "offline_s_wall": ow, "offline_s_cpu": oc,
            "peak_rss_mib": vm_hwm_mib()}
        if args.reps > 1 and name != "none":  # the noisy machine: (plain, re-ranker) pairs, the median ratio
            plain = SearchConfig.of(cfg.strategy, cfg.params, cfg.mode)
            pairs = []
            for _ in range(args.reps):
                pw, pc = clocked(lambda: plain.search(searcher, Xq, k, self_ids=q))[1:]
                rw, rc = clocked(lambda c=c: c.search(searcher, Xq, k, self_ids=q))[1:]
                pairs.append((pw, pc, rw, rc))
            a = np.array(pairs)
            out["rerankers"][name]["reps"] = {
                "n": args.reps, "ratio_wall": float(np.median(a[:, 2] / a[:, 0])),
                "ratio_cpu": float(np.median(a[:, 3] / a[:, 1])),
                "plain_ms_per_query_wall": float(np.median(a[:, 0])) / len(q) * 1e3,
                "ms_per_query_wall": float(np.median(a[:, 2])) / len(q) * 1e3}
        print(json.dumps({"level": level, "strategy": strategy, name: out["rerankers"][name]}), flush=True)
        Path(args.result).write_text(json.dumps(out))  # what is measured survives a cell stopped later
    out["queries"] = int(len(q))
    out["approximate_above"] = nb.APPROXIMATE_ABOVE
    # the re-rankers that built the gallery's lists (k-reciprocal within each query's pool builds none)
    readers = {"dba", "diffusion"} | ({"kreciprocal"} if rr_params.get("kreciprocal", {}).get("sets") != "pool"
                                      else set())
    if len(labels) > nb.APPROXIMATE_ABOVE and readers & set(out["rerankers"]):
        # the HNSW lists (built above by the first re-ranker that read them) against an exact
        # scan, on a fixed draw of gallery items: recall of the exact top k1 (the item included)
        space = cfg.space(searcher)
        k1 = int(rr_params.get("kreciprocal", {}).get("k1", 20))
        lists = nb.neighbour_lists(space, k1).rows
        items = np.sort(np.random.default_rng(1).choice(len(labels), args.list_sample, replace=False))
        exact = nb.searched_lists(space, items, k1)["rows"]
        found = (lists[items][:, :, None] == exact[:, None, :]).any(1).sum()
        out["list_recall"] = {"k": k1, "items": int(len(items)), "recall": float(found / exact.size)}
        print(json.dumps(out["list_recall"]), flush=True)
        if "kreciprocal" in out["rerankers"] and "kreciprocal" in readers:
            # the HNSW row extremes against an exact scan of the same items: the least similar item
            # found, and the row maximum of d (s(x, x) − min s) that k-reciprocal scales by
            ext = nb.row_extremes(space)
            exact_min, exact_arg = np.empty(len(items), np.float32), np.empty(len(items), np.int64)
            for a in range(0, len(items), 64):  # 64 full rows at a time: 256 MB at 10⁶ items
                S = space.score(space.gallery_vectors(items[a: a + 64]))
                exact_min[a: a + 64], exact_arg[a: a + 64] = S.min(1), S.argmin(1)
            self_s = ext["self"][items]
            err = 1 - (self_s - ext["min1"][items]) / (self_s - exact_min)
            out["extremes_check"] = {"items": int(len(items)),
                                     "arg1_share": float((ext["arg1"][items] == exact_arg).mean()),
                                     "row_max_rel_err_median": float(np.median(err)),
                                     "row_max_rel_err_max": float(err.max())}
            print(json.dumps(out["extremes_check"]), flush=True)
    return out


# ------------------------------------------------------------------ driver

def parse_cells(spec: str, levels, rerankers) -> dict:
    cells = {(lv, s): list(rerankers) for lv in levels for s in STRATEGIES}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        lv, s, rr = part.split(":")
        if s not in STRATEGIES or (int(float(lv)), s) not in cells:
            raise KeyError(f"{lv}:{s} is not a level and strategy of this run")
        cells[(int(float(lv)), s)] = [r for r in rr.split("+") if r]
    return cells


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="the demo's model (runs/demo-proxy_anchor-tail2/best.pt); required but "
                                       "with --merge")
    ap.add_argument("--strategies-json", default=None,
                    help="the demo's strategies/strategies.json (names the validation-selected strategy); "
                         "default: strategies/ beside the checkpoint's artifacts/demo")
    ap.add_argument("--rerank-row", default=None, help="the demo's strategies/rerank_row.json (k-reciprocal's "
                    "validation-chosen parameters); default: beside --strategies-json")
    ap.add_argument("--data-root", default=None, help="kanji render cache (default: the data set's)")
    ap.add_argument("--feature-cache", default="cache/features", help="split feature cache (default: %(default)s)")
    ap.add_argument("--cache", default=str(Path(tempfile.gettempdir()) / "dml-distractors"),
                    help="where embedded distractor features are cached (default: %(default)s)")
    ap.add_argument("--levels", default="0,100000,1000000")
    ap.add_argument("--real", type=int, default=100000, help="real (rendered, embedded) distractors")
    ap.add_argument("--copies", type=int, default=2, help="jittered copies per (character, font)")
    ap.add_argument("--jitter-seed", type=int, default=0)
    ap.add_argument("--queries", type=int, default=1000, help="test queries (a fixed draw)")
    ap.add_argument("--reps", type=int, default=1,
                    help="above 1: each re-ranker's search timed again this many times, each after a plain "
                         "search, and the median of the (re-ranker ÷ plain) ratios reported in the targets")
    ap.add_argument("--rerankers", default=",".join(RERANK_ORDER))
    ap.add_argument("--list-sample", type=int, default=1000, help="gallery items whose approximate neighbour "
                    "lists are checked against an exact scan (galleries above 200,000 items)")
    ap.add_argument("--rerank-param", action="append", default=[], metavar="NAME.KEY=VALUE",
                    help="a re-ranker's parameter for every cell, e.g. diffusion.truncation=10000 (repeatable; "
                         "on top of the demo's k-reciprocal choice and the defaults)")
    ap.add_argument("--cells", default="", help="re-rankers per (level, strategy), `LEVEL:STRATEGY:rr+rr;…`")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--approximate-above", type=int, default=None,
                    help="gallery size above which the offline passes use the HNSW index (default: the product's, "
                         "index.rerankers.neighbours.APPROXIMATE_ABOVE); 0 measures them approximate at every level")
    ap.add_argument("--embed-workers", type=int, default=1, help="processes embedding the real distractors "
                    "(one thread each; default: %(default)s)")
    ap.add_argument("--embed-only", action="store_true", help="render and embed the real distractors, then stop")
    ap.add_argument("--out", default="bench/results/distractors")
    ap.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                    help="only fold these result folders' rows into --out (per level, strategy and re-ranker; later "
                         "ones win), then stop")
    # one cell, in its own process (set by the driver)
    ap.add_argument("--level", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--strategy", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--selected", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rerank-params", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--embed-part", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.merge and not args.checkpoint:
        ap.error("the following arguments are required: --checkpoint")

    if args.embed_part is not None:
        embed_part(args)
        return

    if args.level is not None:
        res = run_cell(args)
        Path(args.result).write_text(json.dumps(res))
        return
    if args.merge:  # fold other runs' results (run in parallel into other --out folders) into --out
        out = Path(args.out)
        runs, cells = [], []
        for d in [out, *map(Path, args.merge)]:
            if not (d / "results.json").is_file():
                continue
            got = json.loads((d / "results.json").read_text())
            for c in got["cells"]:
                c["run"] += len(runs)
                for r in c["rerankers"].values():
                    r["run"] = r.get("run", c["run"] - len(runs)) + len(runs)
                cells = merged(cells, c)
            runs += got["runs"]
        # the runs some row still comes from, renumbered in order
        used = sorted({c["run"] for c in cells} | {r["run"] for c in cells for r in c["rerankers"].values()})
        new = {old: i for i, old in enumerate(used)}
        for c in cells:
            c["run"] = new[c["run"]]
            for r in c["rerankers"].values():
                r["run"] = new[r["run"]]
        write_results(out, [runs[i] for i in used], cells)
        return
    if args.embed_only:
        F, C = real_features(args)
        print(f"{len(F):,} real distractors, {len(np.unique(C)):,} characters, d = {F.shape[1]}")
        return
    ck = Path(args.checkpoint).resolve()
    sj = Path(args.strategies_json or ck.parents[2] / "artifacts/demo/strategies/strategies.json")
    rr = Path(args.rerank_row or sj.parent / "rerank_row.json")
    res_sj = json.loads(sj.read_text())
    best = max(res_sj["val"], key=lambda r: r["map@r"])
    row = json.loads(rr.read_text())
    rr_params = {row["rerank"]: dict(row["rerank_params"])}  # the demo's validation choice; the others: defaults
    for item in args.rerank_param:
        name, _, kv = item.partition(".")
        key, eq, value = kv.partition("=")
        if not (name and key and eq):
            ap.error(f"--rerank-param wants NAME.KEY=VALUE, got {item!r}")
        rr_params.setdefault(name, {})[key] = value
    levels = [int(float(s)) for s in args.levels.split(",")]
    try:
        cells = parse_cells(args.cells, levels, args.rerankers.split(","))
    except (ValueError, KeyError) as e:
        ap.error(f"--cells wants LEVEL:STRATEGY:rr+rr;… with a strategy of {STRATEGIES} ({e})")
    if any(lv for (lv, _), rrs in cells.items() if rrs):
        real_features(args)  # once, before the cells read it
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # results merge by (level, strategy, re-ranker): a later run replaces the rows it measured
    runs = json.loads((out / "results.json").read_text())["runs"] if (out / "results.json").is_file() else []
    meta = {"command": "python bench/distractors.py " + shlex.join(sys.argv[1:]), "date": _dt.date.today().isoformat(),
            "threads": args.threads, "queries": args.queries, "real": args.real, "copies": args.copies,
            "selected": {k: best[k] for k in ("strategy", "params", "mode", "map@r")}, "rerank_params": rr_params,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}"}
    runs.append(meta)
    results = json.loads((out / "results.json").read_text())["cells"] if (out / "results.json").is_file() else []
    with tempfile.TemporaryDirectory() as tmp:
        sel = Path(tmp) / "selected.json"
        sel.write_text(json.dumps(best))
        for (lv, s), rrs in cells.items():
            if not rrs:
                continue
            res_file = Path(tmp) / f"{lv}-{s}.json"
            env = os.environ | {"XDG_CACHE_HOME": str(Path(tmp) / f"xdg-{lv}-{s}"),
                                "OMP_NUM_THREADS": str(args.threads),
                                "DML_CACHE_MEMORY": os.environ.get("DML_CACHE_MEMORY", "8G")}
            cmd = [sys.executable, __file__, "--checkpoint", str(ck), "--feature-cache", args.feature_cache,
                   "--cache", args.cache, "--real", str(args.real), "--copies", str(args.copies),
                   "--jitter-seed", str(args.jitter_seed), "--list-sample", str(args.list_sample),
                   "--queries", str(args.queries), "--threads", str(args.threads), "--reps", str(args.reps),
                   "--rerankers", ",".join(r for r in RERANK_ORDER if r in rrs) or "none",
                   "--level", str(lv), "--strategy", s, "--selected", str(sel),
                   "--rerank-params", json.dumps(rr_params), "--result", str(res_file)]
            if args.approximate_above is not None:
                cmd += ["--approximate-above", str(args.approximate_above)]
            if args.data_root:
                cmd += ["--data-root", args.data_root]
            t = time.time()
            proc = subprocess.run(cmd, env=env)
            got = json.loads(res_file.read_text()) if res_file.is_file() else {"level": lv, "strategy": s,
                                                                                "rerankers": {}}
            got["wall_s"] = time.time() - t
            if proc.returncode:  # its re-rankers measured before it stopped are kept, the rest named
                got |= {"failed": proc.returncode, "not_run": [r for r in rrs if r not in got["rerankers"]]}
            got["run"] = len(runs) - 1
            results = merged(results, got)
            write_results(out, runs, results)
    print(table(runs, results))


def merged(cells: list[dict], new: dict) -> list[dict]:
    """`cells` with the re-rankers `new` measured replacing those of its (level, strategy); the
    others stay, each row keeping its run and the plain search it is compared with (its run's)."""
    def stamped(c):
        plain = c["rerankers"].get("none", {})
        for r in c["rerankers"].values():
            r.setdefault("run", c["run"])
            r.setdefault("plain_ms_per_query_cpu", plain.get("ms_per_query_cpu"))
            r.setdefault("plain_ms_per_query_wall", plain.get("ms_per_query_wall"))
        return c
    new = stamped(new)
    old = [c for c in cells if (c["level"], c["strategy"]) == (new["level"], new["strategy"])]
    if old:  # a stop is the new run's to report (or not)
        rows = stamped(old[0])["rerankers"] | new["rerankers"]
        new = {k: v for k, v in old[0].items() if k not in ("failed", "not_run")} | new | {
            "rerankers": {n: rows[n] for n in RERANK_ORDER if n in rows}}
    out = [c for c in cells if (c["level"], c["strategy"]) != (new["level"], new["strategy"])] + [new]
    return sorted(out, key=lambda c: (c["level"], STRATEGIES.index(c["strategy"])))


def write_results(out: Path, runs: list[dict], results: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"runs": runs, "cells": results}, indent=1))
    (out / "results.md").write_text(table(runs, results))


def table(runs: list[dict], cells: list[dict]) -> str:
    meta = runs[-1]
    lines = [f"# Kanji test split with distractors ({meta['date']})", "",
             "Runs (each row's run number in its last column):", "",
             *(f"{i}. `{r['command']}` ({r['date']}; {r['threads']} thread(s))" for i, r in enumerate(runs)), "",
             f"{meta['machine']}; CPU time summed over a run's threads; {meta['queries']} test queries "
             f"(a fixed draw), leave-one-out. Distractors up to {meta['real']:,} are real (rendered, embedded); "
             "beyond, synthetic features (a Gaussian mixture fitted to the real ones: each character's "
             "mean and full covariance; no image).", "",
             "| distractors | strategy | re-ranker | MAP@R | R@1 | ms/query (CPU) | offline s (CPU) | peak RSS MiB "
             "| run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        lv = c["level"]
        what = f"{lv:,}" + ("" if not lv else f" ({c.get('real_distractors', 0):,} real"
                                              + (f" + {c['synthetic_distractors']:,} synthetic)"
                                                 if c.get("synthetic_distractors") else ")"))
        if c.get("failed") is not None:
            lines.append(f"| {what} | {c['strategy']} | {', '.join(c.get('not_run', [])) or '—'} | stopped "
                         f"(exit {c['failed']}): not measured | | | | | {c['run']} |")
        for n, r in c["rerankers"].items():
            lines.append(f"| {what} | {c['strategy']} ({c['setting']}) | {n} | {r['map@r'] * 100:.2f} | "
                         f"{r['recall@1'] * 100:.2f} | {r['ms_per_query_cpu']:.2f} | {r['offline_s_cpu']:.1f} | "
                         f"{r['peak_rss_mib']:,.0f} | {r.get('run', c['run'])} |")
    lines += ["", "Targets at each measured level: k-reciprocal's online cost ÷ the plain search of the same cell "
              "(target ≤ 3× at 10⁶), in CPU time and in wall time; the offline passes of the cell together (target "
              "≤ 15 min at 10⁶ on 2 cores), in CPU and wall seconds; the approximate neighbour lists' recall@k1 "
              "against an exact scan of a sample (target ≥ 0.95).", "",
              "| distractors | strategy | run | k-reciprocal ÷ plain, CPU / wall | offline s together, CPU / wall | "
              "re-rankers run | neighbour-list recall | row extremes: least similar item found, row-max error "
              "median / max |",
              "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        rr = c["rerankers"]
        if not rr:
            continue
        kr = rr.get("kreciprocal", {})
        ratio = (f"{kr['ms_per_query_cpu'] / kr['plain_ms_per_query_cpu']:.2f}× / "
                 f"{kr['ms_per_query_wall'] / kr['plain_ms_per_query_wall']:.2f}×"
                 if kr.get("plain_ms_per_query_cpu") else "not measured")
        reps = rr.get("kreciprocal", {}).get("reps")
        if reps:
            ratio += f"; median of {reps['n']} pairs: {reps['ratio_cpu']:.2f}× / {reps['ratio_wall']:.2f}×"
        lr = c.get("list_recall")
        rec = f"{lr['recall']:.4f} (k = {lr['k']}, {lr['items']:,} items)" if lr else "—"
        ex = c.get("extremes_check")
        ext = (f"{ex['arg1_share']:.4f}, {ex['row_max_rel_err_median']:.1e} / {ex['row_max_rel_err_max']:.1e}"
               if ex else "—")
        offline = (f"{sum(r['offline_s_cpu'] for r in rr.values()):.1f} / "
                   f"{sum(r['offline_s_wall'] for r in rr.values()):.1f}")
        lines.append(f"| {c['level']:,} | {c['strategy']} | {c['run']} | {ratio} | {offline} | {', '.join(rr)} | "
                     f"{rec} | {ext} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
