"""Paper 004's Table 1 on trained trunks: ArcFace, ProxyNCA and Triplet with a trained tail.

  python bench/table1_trained.py [--losses arcface,proxy_nca,triplet] [--seeds 0,1,2] [--epochs 20] [--finetune]
                                 [--runs runs/bench-table1] [--out bench/results/table1_trained]

For each loss and seed: efficientnet_lite0 (ImageNet) on kanji with its last
`--train-blocks` stages trained over the cached frozen prefix (BatchNorm statistics
frozen: the default for pretrained weights), selected on validation classes; with --finetune,
every stage on augmented images instead (after the default probe).  Each
selected checkpoint then gets the strategy evaluation of
`python -m index evaluate --checkpoint CK --grid coarse` (in-process: the same
split_features and run_evaluation calls), on test classes and validation classes.

Reported (mean ± std over seeds, MAP@R and P@1 = R@1, test classes):
  trained [cosine]     the usual evaluation (cosine of the embeddings Wφ)
  trained [bilinear]   φᵀM*φ (our extra view; the paper evaluates cosine, as the row above)
  identity [cosine], identity [bilinear]   M′ = I on the trained trunk features φ
  best diagonal (r), best random (r)   the best restraint degree r > 0 on test, per run (the
                       paper's † oracle); both restraints are bilinear-only (their M′ is
                       indefinite or, for random, not PSD in general), random averaged over
                       restraint seeds as `index evaluate` does
  validation-selected  strategy, parameter and mode chosen by validation MAP@R, reported on test

Also: the MAP@R-vs-r sweeps of both restraints (restraint_sweep.png), and, on the first
seed's test features, how indefinite the diagonal-restraint M′ is (fraction of pairs and of
items with φᵀM′φ < 0) with the MAP@R it gives ranked bilinearly and by the M′-"cosine" (the
sweep's cosine: self-scores below 0 are clamped to a zero norm, as the search path does).
Runs and strategy evaluations are reused when unchanged (train_or_reuse; a checkpoint hash).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from common import ROOT, pm, write_table

from core.atomic import write_json, write_text
from core.flags import apply_threads
from core.logs import setup_logging
from training.config import TrainConfig
from training.trainer import train_or_reuse

NAMES = {"arcface": "ArcFace", "proxy_nca": "ProxyNCA", "triplet": "Triplet"}
METRICS = (("map@r", "MAP@R"), ("precision@1", "P@1"))
VAL_ROW = "validation-selected (honest)"
FROZEN_RESULTS = ROOT / "bench" / "results" / "train" / "results.json"  # train_bench.py's, docs/training.md's


def frozen_neck(path: Path = FROZEN_RESULTS) -> dict[str, tuple[float, float]]:
    """Each loss's frozen-neck test MAP@R, (mean, std) over seeds in %, as train_bench.py stored it
    (for reference beside the trained trunks); {} where it was not run."""
    from train_bench import FROZEN_SETUPS, frozen_model

    if not path.is_file():
        return {}
    rows = {r["model"]: r for r in json.loads(path.read_text())["rows"]}
    out = {}
    for name, kw in FROZEN_SETUPS:
        if frozen_model(name) in rows:
            v = np.asarray(rows[frozen_model(name)]["map@r"], dtype=float) * 100
            out[kw["loss"]] = (float(v.mean()), float(v.std()))
    return out


def rs_text(rs) -> str:
    return "/".join(f"{r:g}" for r in rs)


# ------------------------------------------------------------------ one run
def strategy_eval(ck: Path, out: Path, cache_dir: str, grid: str, seeds: int) -> tuple[dict, float | None, bool]:
    """`index evaluate --checkpoint ck --out out --grid GRID --no-progress` in-process,
    reused when the checkpoint (hash), grid and seeds are unchanged."""
    from core.hashing import sha256_file
    from index.analysis.strategy_eval import run_evaluation
    from index.build import split_features
    from index.refinements import REFINEMENTS

    # the registered strategies too: a strategy added since is evaluated, not missing from a reused table
    stamp_val = json.dumps({"sha": sha256_file(ck), "grid": grid, "seeds": seeds,
                            "strategies": list(REFINEMENTS.names())}, sort_keys=True)
    stamp = out / "stamp.json"
    if stamp.is_file() and stamp.read_text().strip() == stamp_val and (out / "strategies.json").is_file():
        print(f"    reusing strategy evaluation {out}", flush=True)
        took = json.loads((out / "seconds.json").read_text())["seconds"] if (out / "seconds.json").is_file() else None
        return json.loads((out / "strategies.json").read_text()), took, True
    t0 = time.time()
    f, y, W = split_features(ck, None, "test", cache_dir, False)
    vf, vy, _ = split_features(ck, None, "val", cache_dir, False)
    run_evaluation(f, y, W, out, val=(vf, vy), seeds=seeds, progress=False, grid_name=grid)
    took = round(time.time() - t0, 1)
    write_json(out / "seconds.json", {"seconds": took, "note": "features (test, val) + strategy sweep"})
    write_text(stamp, stamp_val + "\n")
    return json.loads((out / "strategies.json").read_text()), took, False  # as written (plain floats)


def metric_norms(ck: Path) -> dict:
    """tr(M*) and ‖M*‖²_F of the checkpoint's M* = WᵀW (paper 004 §4.5 reports 42.72 and 16.03)."""
    from model.checkpoint import load_model

    M = load_model(ck)[0].M.double()
    return {"trace_M": float(M.trace()), "fro2_M": float((M ** 2).sum())}


def pick(rows, strategy, mode, **params):
    from index.analysis.strategy_eval import find

    return find(rows, strategy, mode, **params)


def summarize_run(res: dict) -> dict:
    test = res["test"]
    out = {}
    for key, (name, mode) in {"trained_cos": ("trained", "cosine"), "trained_bil": ("trained", "bilinear"),
                              "identity_cos": ("identity", "cosine"),
                              "identity_bil": ("identity", "bilinear")}.items():
        r = pick(test, name, mode)
        out[key] = {m: r[m] for m, _ in METRICS}
    for name in ("diagonal", "random"):
        rows = sorted([r for r in test if r["strategy"] == name and r["mode"] == "bilinear"],
                      key=lambda r: r["params"]["r"])
        out[f"{name}_sweep"] = [{"r": r["params"]["r"], "seeds": r["seeds"],
                                 **{m: r[m] for m, _ in METRICS}, "map@r_std": r["map@r_std"],
                                 "psd": r["M_psd"]} for r in rows]
        refined = [r for r in rows if r["params"]["r"] > 0]  # r = 0 is M* itself
        best = max(refined, key=lambda r: r["map@r"])
        out[f"best_{name}"] = {"r": best["params"]["r"], "mode": "bilinear", **{m: best[m] for m, _ in METRICS}}
    for reading in ("abs", "clip"):  # the PSD readings of diagonal restraint, scored by cosine
        rows = [r for r in test if r["strategy"] == "diagonal-psd" and r["params"].get("psd") == reading
                and r["mode"] == "cosine" and r["params"]["r"] > 0]
        if rows:
            best = max(rows, key=lambda r: r["map@r"])
            out[f"best_diagonal_{reading}"] = {"r": best["params"]["r"], "mode": "cosine",
                                               **{m: best[m] for m, _ in METRICS}}
    sel = next(t for t in res["table"] if t["row"] == VAL_ROW)
    out["val_selected"] = {"choice": sel["choice"], **{m: sel[m] for m, _ in METRICS}}
    orc = next((t for t in res["table"] if t["row"].startswith("best refined")), None)
    if orc:
        out["best_refined_any"] = {"choice": orc["choice"], **{m: orc[m] for m, _ in METRICS}}
    return out


def indefinite_table(ck: Path, cache_dir: str, r_values) -> list[dict]:
    """Diagonal restraint (restraint seed 0) on one run's test features: how often φᵢᵀM′φⱼ < 0
    (i ≠ j) and φᵢᵀM′φᵢ < 0, and MAP@R ranked bilinearly vs by the M′-cosine."""
    import torch

    from index.analysis.sweep import GramSweep
    from index.backends.search import Searcher
    from index.backends.store import in_memory_index
    from index.build import split_features

    f, y, W = split_features(ck, None, "test", cache_dir, False)
    s = Searcher(in_memory_index(f, y, W, True))  # features as indexed: L2-normalised
    g = GramSweep(np.asarray(s.data.features), s.data.items.labels, s.data.W)
    n = g.n
    rows = []
    for r in r_values:
        rm = s.metric("diagonal", {"r": float(r), "seed": 0})
        S = g.scores(rm.M, rm.op)
        d = np.diagonal(S.numpy()).copy()  # S is consumed by the cosine evaluation below
        neg_self = int((d < 0).sum())
        neg_pairs = int((S < 0).sum().item()) - neg_self
        bil = g.evaluate(S.clone(), "bilinear")
        # hubs of the forced cosine: how many queries share one top-1 item (its self-score beside)
        nrm = torch.sqrt(torch.clamp(torch.diagonal(S).double(), min=0.0))
        inv_x = torch.where(nrm > 0, 1.0 / torch.clamp(nrm, min=1e-30), 0.0).float()  # as GramSweep.evaluate
        inv_q = (1.0 / torch.clamp(nrm, min=1e-30)).float()
        C = S * inv_x[None, :] * inv_q[:, None]
        C.fill_diagonal_(-float("inf"))
        top, counts = np.unique(C.argmax(1).numpy(), return_counts=True)
        del C
        hub = int(top[np.argmax(counts)])
        cos = g.evaluate(S, "cosine")
        rep = rm.report
        rows.append({"r": float(r), "frac_pairs_neg": neg_pairs / (n * (n - 1)), "frac_self_neg": neg_self / n,
                     "n_self_neg": neg_self, "psd": bool(rep["psd"]), "min_eigenvalue": rep["min_eigenvalue"],
                     "trace_ratio": rep["trace"], "bilinear": {m: bil[m] for m, _ in METRICS},
                     "cosine": {m: cos[m] for m, _ in METRICS}, "cosine_top1_distinct": int(len(top)),
                     "cosine_top1_hub": int(counts.max()), "hub_self_score": float(d[hub]),
                     "median_self_score": float(np.median(d))})
        del S
    tr0 = rows[0]["trace_ratio"] if rows and rows[0]["r"] == 0 else None
    for row in rows:
        row["trace_ratio"] = row["trace_ratio"] / tr0 if tr0 else float("nan")
    return rows


# ------------------------------------------------------------------ outputs
def plot_sweeps(losses, per_loss, out: Path, trunk: str = "trained tail") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wide = len(losses) >= 3  # room for a one-line title and legend
    fig, axes = plt.subplots(1, len(losses), figsize=(max(4.6 * len(losses), 6.0), 4.2 if wide else 5.0),
                             squeeze=False, constrained_layout=True)
    handles = None
    for ax, loss in zip(axes[0], losses, strict=True):
        runs = per_loss[loss]
        for name, color, marker in (("diagonal", "tab:blue", "o"), ("random", "tab:orange", "s")):
            x = [p["r"] for p in runs[0][f"{name}_sweep"]]
            ys = np.array([[p["map@r"] for p in run[f"{name}_sweep"]] for run in runs]) * 100
            m, sd = ys.mean(0), ys.std(0)
            ax.plot(x, m, marker=marker, color=color, label=f"{name} restraint [bilinear]")
            ax.fill_between(x, m - sd, m + sd, color=color, alpha=0.2)
        for key, color, ls, lab in (("trained_cos", "tab:red", "-.", "trained M* [cosine]"),
                                    ("trained_bil", "k", "--", "trained M* [bilinear]"),
                                    ("identity_cos", "tab:green", ":", "identity [cosine]")):
            ax.axhline(np.mean([run[key]["map@r"] for run in runs]) * 100, color=color, ls=ls, lw=1.2, label=lab)
        ax.set_title(f"{NAMES.get(loss, loss)}, {trunk} ({len(runs)} seed{'s' if len(runs) > 1 else ''})", fontsize=10)
        ax.set_xlabel("restraint degree r")
        ax.set_ylabel("test MAP@R (%)")
        ax.grid(alpha=0.3)
        handles = ax.get_legend_handles_labels()
    fig.legend(*handles, loc="outside lower center", ncol=5 if wide else 2, fontsize=8)
    fig.suptitle("Kanji test classes: MAP@R vs restraint degree on the trained trunk"
                 + (" " if wide else "\n") + "(mean ± std over seeds)", fontsize=11)
    from core.atomic import write_with

    write_with(out / "restraint_sweep.png", lambda t: fig.savefig(t, format="png", dpi=90))
    plt.close(fig)


def verdicts(losses, per_loss, trunk: str = "trained tail", frozen: dict | None = None) -> list[str]:
    frozen = frozen or {}
    lines = []
    for loss in losses:
        runs = per_loss[loss]
        k = len(runs)
        def col(key):
            return np.array([r[key]["map@r"] for r in runs]) * 100
        tc, tb, ic, bd, br, vs = (col(x) for x in ("trained_cos", "trained_bil", "identity_cos", "best_diagonal",
                                                     "best_random", "val_selected"))
        anyr = np.array([r["best_refined_any"]["map@r"] for r in runs if "best_refined_any" in r]) * 100
        paper_best = max(ic.mean(), bd.mean(), br.mean())
        chosen = [r["val_selected"]["choice"].split(" (val")[0] for r in runs]
        n_refined = sum(not c.startswith("trained") for c in chosen)
        diag = np.array([[p["map@r"] for p in r["diagonal_sweep"]] for r in runs]).mean(0) * 100
        rgrid = [p["r"] for p in runs[0]["diagonal_sweep"]]
        steps = np.diff(diag)
        if np.all(steps >= 0):
            trend = "rises monotonically"
        elif np.all(steps <= 0):
            trend = "falls monotonically"
        else:
            trend = f"is not monotone (peak at r = {rgrid[int(np.argmax(diag))]:g})"
        improves = diag[-1] > diag[0] and diag[-1] >= diag.max() - 1e-9
        def d(v):
            return f"{v.mean() - tc.mean():+.2f}"
        lines.append(
            f"- **{NAMES.get(loss, loss)}** — identity or the paper's refined M′ ≥ trained [cosine]: "
            f"**{'holds' if paper_best >= tc.mean() else 'does not hold'}**. Trained [cosine] {tc.mean():.2f}; "
            f"identity [cosine] {ic.mean():.2f} ({d(ic)}; ≥ trained in {int((ic >= tc).sum())}/{k} seeds); "
            f"best diagonal {bd.mean():.2f} ({d(bd)}) and best random {br.mean():.2f} ({d(br)}), both oracles "
            f"on test, bilinear. Any refinement, oracle (shrink/spectral included): "
            f"{anyr.mean():.2f} ({d(anyr)}, ≥ trained in {int((anyr >= tc).sum())}/{k} seeds). "
            f"Validation picked {', '.join(chosen)} ({n_refined}/{k} a refinement): test {vs.mean():.2f} ({d(vs)}). "
            f"Diagonal restraint (bilinear, mean over seeds) {trend}, {diag[0]:.2f} at r = {rgrid[0]:g} "
            f"(= trained [bilinear]) to {diag[-1]:.2f} at r = {rgrid[-1]:g}: "
            + ("**it improves up to r = 1, as the paper reports**. " if improves
               else "**it does not improve up to r = 1**. ") +
            f"In the bilinear form, our extra view (against trained [bilinear] {tb.mean():.2f}): identity "
            f"{ic.mean():.2f} ({ic.mean() - tb.mean():+.2f}), best random {br.mean():.2f} "
            f"({br.mean() - tb.mean():+.2f}), best diagonal {bd.mean():.2f} ({bd.mean() - tb.mean():+.2f})."
            + (f" {trunk.capitalize()} vs the frozen neck (30 epochs, docs/training.md): "
               f"{tc.mean():.2f} vs {frozen[loss][0]:.2f} "
               f"test MAP@R ({tc.mean() - frozen[loss][0]:+.2f})." if loss in frozen else ""))
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--losses", default="arcface,proxy_nca,triplet", help="metric losses (default: %(default)s)")
    ap.add_argument("--seeds", default="0,1,2", help="training seeds (default: %(default)s)")
    ap.add_argument("--epochs", type=int, default=20, help="training epochs per run (default: %(default)s)")
    ap.add_argument("--train-blocks", type=int, default=2,
                    help="trained stages at the end of the backbone (default: %(default)s)")
    ap.add_argument("--finetune", action="store_true",
                    help="train the whole trunk instead of a tail (--mode finetune: augmented images, the "
                         "default 30-epoch probe first; --train-blocks is then unused)")
    ap.add_argument("--paper-regime", action="store_true",
                    help="paper 004's regime: the neck W stays at nn.Linear's initialisation (--neck-lr-mult 0 "
                         "--neck-init pytorch) while the trunk trains, as its checkpoints' lr 1e-6 leaves it")
    ap.add_argument("--runs", default="runs/bench-table1",
                    help="run folders, reused when finished (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/table1_trained", help="results folder (default: %(default)s)")
    ap.add_argument("--grid", choices=("coarse", "full"), default="coarse",
                    help="strategy grid of the evaluation (default: %(default)s)")
    ap.add_argument("--restraint-seeds", type=int, default=3,
                    help="seeds per random-restraint setting, as index evaluate --seeds (default: %(default)s)")
    ap.add_argument("--features-cache", default=None,
                    help="trunk-feature cache of the trained checkpoints (default: RUNS/features)")
    ap.add_argument("--threads", type=int, default=2,
                    help="torch, faiss and BLAS threads, training included (default: %(default)s; on 2 cores "
                         "shared with other jobs 1 was ~4× faster)")
    return ap.parse_args(argv)


class Plan:
    """What one invocation trains and evaluates, from its flags: losses, seeds, run folders, caches."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.losses = args.losses.split(",")
        self.seeds = [int(s) for s in args.seeds.split(",")]
        self.cache = args.features_cache or f"{args.runs}/features"
        self.out = Path(args.out)
        self.n = args.train_blocks
        self.trunk = "fine-tuned trunk" if args.finetune else "trained tail"
        if args.paper_regime:
            self.trunk += ", neck at its initialisation"

    def run_dir(self, loss: str, seed: int) -> str:
        a = self.args
        return (f"{a.runs}/t1-{loss}-{'finetune' if a.finetune else f'n{self.n}'}"
                f"{'-paper' if a.paper_regime else ''}-s{seed}")

    def train_config(self, loss: str, seed: int) -> TrainConfig:
        a = self.args
        trunk_kw = dict(mode="finetune") if a.finetune else dict(train_blocks=self.n)
        if a.paper_regime:
            trunk_kw |= dict(neck_lr_mult=0.0, neck_init="pytorch")
        return TrainConfig(loss=loss, seed=seed, epochs=a.epochs, out=self.run_dir(loss, seed), progress=False,
                           device="cpu", threads=a.threads, **trunk_kw)


def train_and_evaluate(plan: Plan, t_start: float) -> tuple[dict[str, list[dict]], list[str]]:
    """Every (seed, loss) run trained (or reused) and its strategy evaluation summarised:
    ({loss: [summary per seed]}, anomalies)."""
    args = plan.args
    per_loss: dict[str, list[dict]] = {loss: [] for loss in plan.losses}
    anomalies = []
    for s in plan.seeds:  # seed-major: every method has a first seed early
        for loss in plan.losses:
            run = plan.run_dir(loss, s)
            t0 = time.time()
            print(f"[{time.time() - t_start:6.0f} s] train {loss} seed {s} -> {run}", flush=True)
            m, reused = train_or_reuse(plan.train_config(loss, s))
            apply_threads(args.threads)
            print(f"[{time.time() - t_start:6.0f} s]   {'reused' if reused else 'trained'} "
                  f"in {time.time() - t0:.0f} s: "
                  f"selected epoch {m['selected_epoch']}/{m['epochs']}, val MAP@R {m['val']['map@r'] * 100:.2f}, "
                  f"test MAP@R {m['test']['map@r'] * 100:.2f}", flush=True)
            t1 = time.time()
            res, eval_s, eval_reused = strategy_eval(Path(run) / "best.pt", Path(run) / f"strategies-{args.grid}",
                                                     plan.cache, args.grid, args.restraint_seeds)
            summ = summarize_run(res)
            summ.update(metric_norms(Path(run) / "best.pt"))
            summ.update(seed=s, run=run, selected_epoch=m["selected_epoch"], epochs=m["epochs"],
                        train_seconds=m["train_seconds"], eval_seconds=eval_s, run_reused=reused,
                        eval_reused=eval_reused, epoch_seconds=[h["seconds"] for h in (
                            json.loads(line) for line in (Path(run) / "log.jsonl").read_text().splitlines())],
                        val_map_r=m["val"]["map@r"], trainer_test={k: m["test"][k] for k in ("map@r", "recall@1")})
            if abs(summ["trained_cos"]["map@r"] - m["test"]["map@r"]) > 1e-3:
                anomalies.append(f"{run}: trained [cosine] from the strategy evaluation "
                                 f"{summ['trained_cos']['map@r']:.4f} ≠ the trainer's test MAP@R "
                                 f"{m['test']['map@r']:.4f}")
            bad = [r for r in res["test"] if not np.isfinite(r["map@r"])]
            if bad:
                anomalies.append(f"{run}: non-finite MAP@R in {[(r['strategy'], r['params'], r['mode']) for r in bad]}")
            per_loss[loss].append(summ)
            print(f"[{time.time() - t_start:6.0f} s]   strategies in {time.time() - t1:.0f} s: trained[cos] "
                  f"{summ['trained_cos']['map@r'] * 100:.2f}, identity[cos] {summ['identity_cos']['map@r'] * 100:.2f}, "
                  f"best diag {summ['best_diagonal']['map@r'] * 100:.2f} (r={summ['best_diagonal']['r']:g}), "
                  f"best random {summ['best_random']['map@r'] * 100:.2f} (r={summ['best_random']['r']:g}), "
                  f"val-selected {summ['val_selected']['choice']} -> {summ['val_selected']['map@r'] * 100:.2f}",
                  flush=True)
    return per_loss, anomalies


def indefinite_analysis(plan: Plan, t_start: float) -> dict[str, list[dict]]:
    """indefinite_table() of each loss's first-seed run, reused while its checkpoint and r grid are unchanged."""
    from core.hashing import sha256_file
    from index.refinements import coarse, grid

    print(f"[{time.time() - t_start:6.0f} s] indefinite M′ analysis (seed {plan.seeds[0]})", flush=True)
    r_values = grid("diagonal")["r"] if plan.args.grid == "full" else coarse(grid("diagonal")["r"])
    indef = {}
    for loss in plan.losses:
        ck = Path(plan.run_dir(loss, plan.seeds[0])) / "best.pt"
        stamp = {"sha": sha256_file(ck), "r": list(r_values), "v": 3}
        keep = ck.parent / "indefinite.json"
        old = json.loads(keep.read_text()) if keep.is_file() else {}
        if old.get("stamp") == stamp:
            indef[loss] = old["rows"]
        else:
            indef[loss] = indefinite_table(ck, plan.cache, r_values)
            write_json(keep, {"stamp": stamp, "rows": indef[loss]})
        print(f"[{time.time() - t_start:6.0f} s]   {loss} done", flush=True)
    return indef


# ------------------------------------------------------------------ results.md, section by section
def md_header(plan: Plan, all_runs: list[dict], wall: float, cmd: str) -> list[str]:
    args, n = plan.args, plan.n
    ev = [r["eval_seconds"] for r in all_runs if r["eval_seconds"] is not None]
    return ["# Paper 004, Table 1, on trained trunks (kanji test classes)", "",
            f"`{cmd}`: efficientnet_lite0 (ImageNet), "
            + ("every stage fine-tuned on augmented images after a 30-epoch probe" if args.finetune
               else f"last {n} stages trained")
            + (", the neck W left at nn.Linear's initialisation (paper 004's regime: --neck-lr-mult 0 --neck-init "
               "pytorch)" if args.paper_regime else " with the neck") +
            f" ({args.epochs} epochs, BatchNorm statistics frozen, selected on "
            f"validation MAP@R), seeds {', '.join(map(str, plan.seeds))}; strategy evaluation as "
            f"`python -m index evaluate --checkpoint CK --grid {args.grid}` (test and validation classes; random "
            f"restraint averaged over {args.restraint_seeds} restraint seeds). Mean ± std over training seeds. "
            f"Query = gallery, leave-one-out; trunk features L2-normalised. {args.threads} thread(s) for torch, "
            f"faiss and BLAS, on 2 CPU cores shared with other jobs. Recorded time: training "
            f"{sum(sum(r['epoch_seconds']) for r in all_runs) / 60:.1f} min (epochs of all {len(all_runs)} runs), "
            f"strategy evaluations {sum(ev) / 60:.1f} min ({len(ev)} of {len(all_runs)} recorded); this invocation "
            f"{wall / 60:.1f} min, reusing {sum(r['run_reused'] for r in all_runs)} trained runs and "
            f"{sum(r['eval_reused'] for r in all_runs)} strategy evaluations.", "",
            "Diagonal and random restraint are bilinear-only (`index list`): their M′ is indefinite in general. "
            "\"best diagonal/random\" is the best r > 0 **on test** per run (the paper's † oracle, not an honest "
            "number); the r of each seed is given. \"validation-selected\" chooses strategy, parameter and mode on "
            "validation classes and reports test.", ""]


def md_metric_tables(losses: list[str], per_loss: dict) -> list[str]:
    L = []
    for m, title in METRICS:
        L += [f"## {title}", "",
              "| method | trained [cosine] | trained [bilinear] | identity [cosine] | identity [bilinear] | "
              "best diagonal [bilinear] (r) | best diagonal, \\|M′\\| [cosine] (r) | "
              "best diagonal, clipped [cosine] (r) | best random [bilinear] (r) | validation-selected |",
              "|---|---|---|---|---|---|---|---|---|---|"]
        for loss in losses:
            runs = per_loss[loss]
            def col(k):
                return pm([r[k][m] for r in runs])
            L.append(f"| {NAMES.get(loss, loss)} | {col('trained_cos')} | {col('trained_bil')} | "
                     f"{col('identity_cos')} | {col('identity_bil')} | "
                     f"{col('best_diagonal')} (r = {rs_text([r['best_diagonal']['r'] for r in runs])}) | "
                     + "".join(f"{col(f'best_diagonal_{x}')} "
                               f"(r = {rs_text([r[f'best_diagonal_{x}']['r'] for r in runs])}) | "
                               if all(f"best_diagonal_{x}" in r for r in runs) else "not evaluated | "
                               for x in ("abs", "clip")) +
                     f"{col('best_random')} (r = {rs_text([r['best_random']['r'] for r in runs])}) | "
                     f"{col('val_selected')} |")
        L.append("")
    return L


def md_choices(losses: list[str], per_loss: dict, all_runs: list[dict]) -> list[str]:
    same = all(r["identity_cos"] == r["identity_bil"] for r in all_runs)
    L = [f"identity [bilinear] {'equals' if same else 'differs from'} identity [cosine] in every run"
         f"{' (φ is L2-normalised, so the two rank alike)' if same else ''}.", "",
         "Validation-selected choices per seed:", ""]
    for loss in losses:
        L.append(f"- {NAMES.get(loss, loss)}: " + "; ".join(
            f"seed {r['seed']}: {r['val_selected']['choice']} → test MAP@R {r['val_selected']['map@r'] * 100:.2f}"
            for r in per_loss[loss]))
    L += ["", "Best refinement of any kind on test (oracle, `index evaluate`'s † row), per seed:", ""]
    for loss in losses:
        L.append(f"- {NAMES.get(loss, loss)}: " + "; ".join(
            f"{r['best_refined_any']['choice']} {r['best_refined_any']['map@r'] * 100:.2f}"
            for r in per_loss[loss] if "best_refined_any" in r))
    return L


def md_runs_table(losses: list[str], per_loss: dict, frozen: dict) -> list[str]:
    L = ["", "Training runs (times from each run's log.jsonl, so a resumed run counts every epoch; strategy "
         "evaluation = test and validation features plus the sweep, where recorded):", "",
         "| method | selected epoch | val MAP@R | test MAP@R (trainer) | median epoch s | training s/run | "
         "strategy eval s/run | tr(M*) | ‖M*‖²_F | frozen-neck test MAP@R |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for loss in losses:
        runs = per_loss[loss]
        fr = frozen.get(loss)
        ev = [r["eval_seconds"] for r in runs if r["eval_seconds"] is not None]
        L.append(f"| {NAMES.get(loss, loss)} | {rs_text([r['selected_epoch'] for r in runs])} of {runs[0]['epochs']} | "
                 f"{pm([r['val_map_r'] for r in runs])} | {pm([r['trainer_test']['map@r'] for r in runs])} | "
                 f"{np.median([e for r in runs for e in r['epoch_seconds']]):.1f} | "
                 f"{np.mean([sum(r['epoch_seconds']) for r in runs]):.0f} | "
                 f"{f'{np.mean(ev):.0f}' if ev else 'not recorded'}"
                 f"{f' ({len(ev)} of {len(runs)} recorded)' if ev and len(ev) < len(runs) else ''} | "
                 f"{pm([r['trace_M'] for r in runs], 1.0)} | {pm([r['fro2_M'] for r in runs], 1.0)} | "
                 f"{f'{fr[0]:.2f} ± {fr[1]:.2f}' if fr else 'not measured'} |")
    return L


def md_indefinite(losses: list[str], indef: dict, seed: int) -> list[str]:
    L = ["", "![MAP@R vs restraint degree](restraint_sweep.png)", "",
         f"## Indefinite M′ under diagonal restraint (seed {seed}, restraint seed 0, test features)", "",
         "Fractions over the test split's pairs i ≠ j and items i; tr ratio = tr(M′)/tr(M*). \"cosine\" is "
         "φᵢᵀM′φⱼ/(‖φᵢ‖_M′‖φⱼ‖_M′) with ‖φ‖_M′ = √max(φᵀM′φ, 0), the sweep's and search path's cosine "
         "forced onto an indefinite M′: items with φᵀM′φ < 0 get a zero norm and score 0 as gallery items "
         "(`index evaluate` skips cosine for such M′; `index search` falls back to bilinear).", ""]
    for loss in losses:
        L += [f"**{NAMES.get(loss, loss)}**", "",
              "| r | tr ratio | PSD | min eigenvalue | pairs φᵢᵀM′φⱼ < 0 | items φᵢᵀM′φᵢ < 0 | MAP@R bilinear | "
              "MAP@R cosine | P@1 bilinear | P@1 cosine | cosine: largest top-1 hub (its φᵀM′φ; median) |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in indef[loss]:
            L.append(f"| {row['r']:g} | {row['trace_ratio']:.3f} | {'yes' if row['psd'] else 'no'} | "
                     f"{row['min_eigenvalue']:.3g} | {row['frac_pairs_neg'] * 100:.2f} % | "
                     f"{row['frac_self_neg'] * 100:.2f} % ({row['n_self_neg']}) | "
                     f"{row['bilinear']['map@r'] * 100:.2f} | {row['cosine']['map@r'] * 100:.2f} | "
                     f"{row['bilinear']['precision@1'] * 100:.2f} | {row['cosine']['precision@1'] * 100:.2f} | "
                     f"{row['cosine_top1_hub']} queries "
                     f"({row['hub_self_score']:.2g}; {row['median_self_score']:.2g}) |")
        L.append("")
    L += ["At r = 0 (M′ = M*, PSD) the negative pair scores are only embeddings at obtuse angles. The hub "
          "column counts the queries whose top-1 item, under the forced cosine, is the single most frequent "
          "one: once a few items have φᵀM′φ just above 0, their tiny M′-norm inflates every score they take "
          "part in, and they become everybody's nearest neighbour.", ""]
    return L


def results_markdown(plan: Plan, per_loss: dict, indef: dict, anomalies: list[str], wall: float, cmd: str,
                     frozen: dict) -> str:
    losses = plan.losses
    all_runs = [r for loss in losses for r in per_loss[loss]]
    L = md_header(plan, all_runs, wall, cmd) + md_metric_tables(losses, per_loss)
    L += md_choices(losses, per_loss, all_runs) + md_runs_table(losses, per_loss, frozen)
    L += md_indefinite(losses, indef, plan.seeds[0])
    L += ["## Verdict", "",
          "Claim: identity or a refined M′ ≥ trained [cosine] on unseen classes (computed from the mean "
          "MAP@R rows above; the refined rows are test oracles). And: does diagonal restraint improve up to "
          "r = 1 as the paper reports (on the frozen trunk it fell monotonically, docs/refinement.md)?", ""]
    L += verdicts(losses, per_loss, plan.trunk, frozen)
    if anomalies:
        L += ["", "Anomalies:", ""] + [f"- {a}" for a in anomalies]
    return "\n".join(L) + "\n"


def main(argv=None):
    args = parse_args(argv)
    setup_logging()
    apply_threads(args.threads)
    # numpy's OpenBLAS too (apply_threads sets torch and faiss only): with 2 BLAS threads on 2 busy
    # cores, each 1280 × 1280 eigvalsh of the matrix reports took ~6–12 s instead of ~0.5 s
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=args.threads, user_api="blas")
    t_start = time.time()
    plan = Plan(args)
    per_loss, anomalies = train_and_evaluate(plan, t_start)
    indef = indefinite_analysis(plan, t_start)
    plot_sweeps(plan.losses, per_loss, plan.out, plan.trunk)
    wall = time.time() - t_start
    cmd = "python " + " ".join(["bench/table1_trained.py"] + sys.argv[1:])
    md = results_markdown(plan, per_loss, indef, anomalies, wall, cmd, frozen_neck())
    write_json(plan.out / "results.json", {"losses": plan.losses, "seeds": plan.seeds, "epochs": args.epochs,
                                           "train_blocks": plan.n, "finetune": args.finetune,
                                           "grid": args.grid, "restraint_seeds": args.restraint_seeds,
                                           "wall_seconds": round(wall, 1), "runs": per_loss, "indefinite": indef,
                                           "anomalies": anomalies})
    write_table(plan.out / "results.md", md)


if __name__ == "__main__":
    main()
