"""Candidate routes for cosine mode on an IVF, compared on one gallery (docs/scale-out.md).

  python bench/ondisk_bench.py --n 1000000 --keep --workdir W      # data, queries, exact top-10
  python bench/ondisk_cosine_options.py --workdir W/N1000000

Cosine under M′ = WᵀW scores t·x / ‖x‖_M′; an IVF ranks by t·x.  Every route below is an
in-RAM IVF-SQ8 with the same nlist, and re-ranks its candidates exactly (cosine under M′, from
the features in RAM); what differs is what the lists hold and how candidates are scored:
  z-lists     lists over z = Lx/‖Lx‖, M′ = LᵀL (r = rank M′ dimensions), searched with Lq/‖Lq‖:
              the inner product is the cosine itself (the route index/backends/ondisk.py takes)
  y-lists     lists over y = x/‖x‖_M′ (d dimensions), searched with M′q/‖q‖_M′
  folded      the base lists over x; every code of the probed lists scored by the inner
              product (range search), divided by a stored ‖x‖_M′ (4 bytes × N), best 100 kept
  ip-400/1600 the base lists' inner-product top 400 / 1600 (no per-strategy artefact)
Reported: recall@10 against the exact top-10 (truth.npy, trained cosine) and single-query ms
(1 thread, the best of 3 passes), per nprobe; each route's build seconds and bytes per row.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import faiss
import numpy as np

from core.atomic import write_text

K, POOL = 10, 100


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True, help="a kept ondisk_bench folder (WORKDIR/N…)")
    ap.add_argument("--nlist", type=int, default=1024, help="IVF lists (default: %(default)s)")
    ap.add_argument("--nprobe", default="4,8,16,32", help="nprobe values (default: %(default)s)")
    ap.add_argument("--single", type=int, default=50, help="single queries timed per setting (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/ondisk/cosine_options.md",
                    help="markdown table to write (default: %(default)s)")
    args = ap.parse_args()
    faiss.omp_set_num_threads(1)
    wd = Path(args.workdir)
    X, Q = np.load(wd / "features.npy"), np.load(wd / "queries.npy")
    W = np.load(wd / "W.npy").astype(np.float64)
    truth = np.load(wd / "truth.npy")[-1]          # ondisk_bench's last strategy: trained, cosine
    M = W.T @ W
    ev, V = np.linalg.eigh(M)
    keep = ev > 1e-8 * ev.max()
    L = (V[:, keep] * np.sqrt(ev[keep])).T.astype(np.float32)
    Z = X @ L.T
    m_norm = np.linalg.norm(Z, axis=1)
    Z /= m_norm[:, None]
    zq = Q @ L.T
    zq /= np.linalg.norm(zq, axis=1, keepdims=True)
    qt = Q @ M.astype(np.float32)
    qt /= np.sqrt(np.einsum("ij,ij->i", qt, Q))[:, None]
    sample = np.random.default_rng(0).choice(len(X), 64 * args.nlist, replace=False)

    def ivf(data):
        t = time.perf_counter()
        index = faiss.index_factory(data.shape[1], f"IVF{args.nlist},SQ8", faiss.METRIC_INNER_PRODUCT)
        index.train(data[sample])
        index.add(data)
        return index, time.perf_counter() - t

    built = {"z-lists": ivf(Z), "y-lists": ivf(X / m_norm[:, None]), "base": ivf(X)}

    def rerank(i, cand):
        c = cand[cand >= 0]
        return c[np.argsort(-(X[c] @ qt[i]) / m_norm[c])[:K]]

    def top(name, i, p):
        if name == "folded":
            index = built["base"][0]
            faiss.extract_index_ivf(index).nprobe = p
            _, sc, ids = index.range_search(qt[i: i + 1], -1e30)
            s = sc / m_norm[ids]
            return rerank(i, ids[np.argpartition(-s, min(POOL, len(s) - 1))[:POOL]])
        index, q, kc = {"z-lists": (built["z-lists"][0], zq, POOL), "y-lists": (built["y-lists"][0], qt, POOL),
                        "ip-400": (built["base"][0], qt, 400), "ip-1600": (built["base"][0], qt, 1600)}[name]
        faiss.extract_index_ivf(index).nprobe = p
        return rerank(i, index.search(q[i: i + 1], kc)[1][0])

    nprobes = [int(p) for p in args.nprobe.split(",")]
    routes = ["z-lists", "y-lists", "folded", "ip-400", "ip-1600"]
    base_s = built["base"][1]
    cost = {"z-lists": (built["z-lists"][1], f"{L.shape[0]} + 8"),
            "y-lists": (built["y-lists"][1], f"{X.shape[1]} + 8"),
            "folded": (base_s, "4 (norms; base lists)"),
            "ip-400": (base_s, "0 (base lists)"), "ip-1600": (base_s, "0 (base lists)")}
    md = [f"N = {len(X):,}, d = {X.shape[1]}, rank M′ = {L.shape[0]}, IVF{args.nlist},SQ8 in RAM, {len(Q)} queries, "
          f"k = {K}; ‖x‖_M′ from {m_norm.min():.3f} to {m_norm.max():.3f}. recall@10 / single-query ms (1 thread, "
          "best of 3 passes).", "",
          "| route | build s | bytes per row | " + " | ".join(f"nprobe {p}" for p in nprobes) + " |",
          "|---|---|---|" + "---|" * len(nprobes)]
    for name in routes:
        cells = []
        for p in nprobes:
            got = [top(name, i, p) for i in range(len(Q))]
            rec = np.mean([len(set(a) & set(b)) / K for a, b in zip(got, truth, strict=True)])
            best = np.inf
            for _ in range(3):   # the best of 3 passes: the machine is shared
                t = time.perf_counter()
                for i in range(args.single):
                    top(name, i, p)
                best = min(best, (time.perf_counter() - t) / args.single * 1e3)
            cells.append(f"{rec:.3f} / {best:.2f}")
        md.append(f"| {name} | {cost[name][0]:.0f} | {cost[name][1]} | " + " | ".join(cells) + " |")
        print(md[-1], flush=True)
    write_text(Path(args.out), "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
