"""The four regularizers as their papers define them, with controls, on trained tails (kanji).

  python bench/reg_fidelity.py [--seeds 0,1,2] [--train-blocks 1] [--epochs 10] [--threads 2]
                               [--only NAME] [--runs runs/bench-reg-fidelity]
                               [--out bench/results/regularizers_fidelity]

Every run: efficientnet_lite0 (ImageNet) with its last --train-blocks stages trained over the
cached frozen prefix (the default tail recipe), kanji, selected on validation classes, reported on
test classes.  For each regularizer, three arms on the same base loss:
  plain      the base loss alone;
  control    the regularizer present with weight 0 (for the determinant: flows present, R off,
             ε = 0, g_max without a metric loss, as eq. 11; for CGML: two class-aligned batches, each a full
             --batch-size, graph term off), so a difference from plain is the architecture or the
             batches, not the term;
  chosen     the regularizer's default form (the paper's) at the weight chosen on validation MAP@R
             (seed 0) from a grid holding the paper's value;
and the named variants against it, at the chosen weight (the tail recipe's 30-epoch probe first): the
determinant with g_max's own metric loss attached (control and grid), and on that form logdet vs plus_one,
ε = 0 vs 0.4 and the logdet-tangent form; NIR's nll variant; CGML's split batches.  Each term's
magnitude is logged next to the metric loss's (the last epoch's mean, from each run's log.jsonl).

Finished runs are reused, and so are the measurements already in --out/results.json (same base loss,
regularizer, parameters, weight and seed), so a run folder that is gone is not trained again: delete
results.json to re-measure everything.  Results are merged into results.json after every arm (under
a lock, keeping the other arms' rows), so an interrupted run resumes and `--only` invocations can run
side by side.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from fnmatch import fnmatch
from pathlib import Path

import numpy as np
from common import pm

from core.atomic import write_json, write_text
from core.locks import exclusive_lock
from core.logs import setup_logging
from training.config import TrainConfig
from training.step import Diverged
from training.trainer import train_or_reuse

KEYS = ("map@r", "recall@1", "nmi")
# label, base loss, regularizer (None: plain), its params, weight: a grid (chosen on validation, seed 0),
# a number, or "chosen:LABEL" (the weight chosen for that arm)
PLAN = [  # the cheap arms first, the slow flows (determinant, then NIR: about 10× a plain run) last
    ("proxy_anchor", "plain", None, (), None),
    ("proxy_anchor", "skewed_mean control (weight 0)", "skewed_mean", (), 0.0),
    ("proxy_anchor", "skewed_mean", "skewed_mean", (), [0.01, 0.1, 1.0, 10.0]),
    # whether the term acts at all: the grid's top, where it moves the largest proxy-proxy cosine
    ("proxy_anchor", "skewed_mean, weight 10", "skewed_mean", (), 10.0),
    ("binomial", "plain", None, (), None),
    ("binomial", "cgml control (two full batches, weight 0)", "cgml", (), 0.0),
    ("binomial", "cgml", "cgml", (), "wide"),  # grid: the registry's default weight, a decade below, 3 above
    ("binomial", "cgml, split batches (half a batch each)", "cgml", ("cgml.batches=split",), "chosen:cgml"),
    ("triplet", "plain", None, (), None),
    ("triplet", "cgml control (two full batches, weight 0)", "cgml", (), 0.0),
    # the paper's λ for Triplet is 0.001 (0.002, the registry's default, is its Binomial and N-pair value)
    ("triplet", "cgml", "cgml", (), [0.0002, 0.001, 0.002, 0.02, 0.2, 2.0]),
    # g_max without a metric loss (eq. 11): at weight 0 g_max is idle and the neck and trunk train as plain
    # training through g_min, so control − plain is what g_min and the activation cost
    ("proxy_anchor", "determinant control (flows, R off, ε = 0)", "determinant", ("determinant.epsilon=0",), 0.0),
    # g_max's own metric loss on g_max(u), not detached: a second metric loss on the neck and trunk
    ("proxy_anchor", "determinant control, attached g_max loss", "determinant",
     ("determinant.epsilon=0", "determinant.gmax_loss=attached"), 0.0),
    ("proxy_anchor", "determinant", "determinant", (), [0.01, 0.05, 0.2]),
    ("proxy_anchor", "determinant, attached g_max loss", "determinant", ("determinant.gmax_loss=attached",),
     [0.01, 0.05, 0.2]),
    # the variants of the attached form, at its chosen weight
    ("proxy_anchor", "determinant, attached g_max loss, logdet R", "determinant",
     ("determinant.gmax_loss=attached", "determinant.variant=logdet"), "chosen:determinant, attached g_max loss"),
    ("proxy_anchor", "determinant, attached g_max loss, ε = 0", "determinant",
     ("determinant.gmax_loss=attached", "determinant.epsilon=0"), "chosen:determinant, attached g_max loss"),
    ("proxy_anchor", "determinant, logdet-tangent form (logdet, tangent augmentation into the loss, no activation, "
     "attached g_max loss)", "determinant",
     ("determinant.gmax_loss=attached", "determinant.variant=logdet", "determinant.augment=tangent",
      "determinant.activation=none"), "chosen:determinant, attached g_max loss"),
    # weight 0: the flow gets no gradient, so its learning rate cannot matter
    ("proxy_anchor", "nir control (weight 0)", "nir", (), 0.0),
    ("proxy_anchor", "nir", "nir", (), [0.01, 0.1, 1.0, 10.0]),  # the paper's 1; validation chose 0.1 of 0.1-10
    # the official code's multiplier on our base lr 1e-4: the flow at 5e-3, ten times the official absolute rate
    ("proxy_anchor", "nir, flow at 50 × lr (the official multiplier on our tenfold base lr)", "nir",
     ("nir.flow_lr_mult=50",), [0.1, 1.0, 10.0]),
    ("proxy_anchor", "nir, nll variant (mean NLL, checkered 3-layer flow, no clamp, base loss unscaled)", "nir",
     ("nir.variant=nll", "nir.flow=glow_checkered", "nir.layers=3", "nir.clamp=0", "nir.proxy_lr_scale=1",
      "nir.w_align=1", "nir.flow_lr_mult=50"), 0.001),
]
# the diagnostics shown beside each arm (means of the last epoch's logged parts, when present)
# rows measured before each row recorded its date were all measured on this day
UNDATED = "2026-11-24"
DIAG = ("loss", "determinant", "R_min", "R_max", "R_min_real", "R_max_real", "nir", "nir_nll", "cgml", "L_GC",
        "skewed_mean", "max_proxy_cos")


def default_grid(reg: str, wide: bool = False) -> list[float]:
    """The registry's default weight (the paper's value) with a decade either side (wide: three decades above)."""
    from training.regularizers import REGULARIZERS

    w = float(REGULARIZERS.get(reg).spec.weight)
    return [w / 10, w, w * 10] + ([w * 100, w * 1000] if wide else [])


def die(msg: str):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def arm_key(loss, reg, params, weight, seed) -> str:
    return json.dumps([loss, reg, sorted(params), None if reg is None else float(weight), seed])


def recorded(rows: list[dict]) -> tuple[dict, dict]:
    """Measurements already in results.json: per (loss, regularizer, params, weight, seed), the arm's
    test and validation metrics, and the validation MAP@R (None: diverged) of the weights tuned."""
    arms, tuned = {}, {}
    for r in rows:
        reg, params = r["regularizer"], r["params"]
        for i, s in enumerate(r["seeds"][:len(r["map@r"])]):
            arms[arm_key(r["loss"], reg, params, r["weight"] or 0.0, s)] = {
                "test": {k: r[k][i] for k in KEYS}, "val": {"map@r": r["val_map@r"][i]},
                "train_seconds": r["seconds"][i], "parts": r["parts"][i], "measured": r.get("measured")}
        if r.get("diverged") and len(r["map@r"]) < len(r["seeds"]):  # the seed that diverged
            arms[arm_key(r["loss"], reg, params, r["weight"] or 0.0, r["seeds"][len(r["map@r"])])] = {
                "diverged": r["diverged"], "measured": r.get("measured")}
        for t in r.get("tuning_on_val", []):
            tuned[arm_key(r["loss"], reg, params, t["weight"], r.get("tuning_seed", r["seeds"][0]))] = t
    return arms, tuned


def merge_rows(path: Path, rows: list[dict], seeds, setting) -> list[dict]:
    """Write `rows` into results.json, replacing rows of the same (base, arm), keeping the others, in PLAN order."""
    with exclusive_lock(path, "results", wait=True):  # two `--only` invocations merge in turn
        old = json.loads(path.read_text())["rows"] if path.is_file() else []
        new = {(r["loss"], r["arm"]): r for r in rows}
        merged = {(r["loss"], r["arm"]): r for r in old} | new
        order = {(p[0], p[1]): i for i, p in enumerate(PLAN)}
        out = sorted(merged.values(), key=lambda r: order.get((r["loss"], r["arm"]), len(order)))
        write_json(path, {"seeds": seeds, "setting": setting, "rows": out})
    return out


def run_one(loss, reg, params, weight, seed, runs, setting) -> tuple[dict, Path]:
    tag = "plain" if reg is None else f"{reg}{''.join('+' + p.split('.', 1)[1] for p in params)}-w{weight:g}"
    out = Path(runs) / f"{loss}-{tag}-s{seed}"
    kw = dict(setting)
    if reg is not None:
        kw |= dict(regularizer=(reg,), reg_weight=(float(weight),), reg_param=tuple(params))
    cfg = TrainConfig(out=str(out), seed=seed, loss=loss, progress=False, **kw)
    mark = Path(str(out) + ".diverged")  # beside the run: a later invocation does not train it again
    if mark.is_file():
        return None, out
    try:
        m, _ = train_or_reuse(cfg)
    except Diverged as e:
        write_text(mark, f"{e}\n")
        return None, out
    return m, out


def last_epoch_parts(run: Path) -> dict:
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    last = [r for r in log if r.get("epoch", 0) > 0][-1]
    return {k[len("train_"):]: v for k, v in last.items() if k.startswith("train_")}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2", help="training seeds (default: %(default)s)")
    ap.add_argument("--train-blocks", type=int, default=1, help="trained stages (default: %(default)s)")
    ap.add_argument("--epochs", type=int, default=10, help="epochs per run (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads per run (default: %(default)s)")
    ap.add_argument("--only", help="only the arms of this regularizer, or whose label matches this glob "
                    "(e.g. 'nir, nll*'), and their plain base (default: every arm)")
    ap.add_argument("--variant-seeds", help="seeds for the named variants (the arms labelled "
                    "'NAME, variant'), when fewer than --seeds are affordable (default: --seeds)")
    ap.add_argument("--runs", default="runs/bench-reg-fidelity", help="run folders, reused (default: %(default)s)")
    ap.add_argument("--out", default="bench/results/regularizers_fidelity", help="results (default: %(default)s)")
    args = ap.parse_args()
    setup_logging()
    seeds = [int(s) for s in args.seeds.split(",")]
    variant_seeds = seeds if args.variant_seeds is None else [int(s) for s in args.variant_seeds.split(",")]
    setting = dict(mode="tail", train_blocks=args.train_blocks, epochs=args.epochs, device="cpu", probe_epochs=30,
                   threads=args.threads)
    out_json = Path(args.out) / "results.json"
    old = json.loads(out_json.read_text()) if out_json.is_file() else None
    same = ("mode", "train_blocks", "epochs", "probe_epochs")  # what the runs depend on (not the thread count)
    if old is not None and any(old["setting"].get(k) != setting[k] for k in same):
        die(f"{out_json} holds runs of another setting ({old['setting']}); choose another --out")
    rec_arms, rec_tuned = recorded(old["rows"] if old else [])
    today = time.strftime("%Y-%m-%d")
    t0 = time.time()
    chosen: dict[str, float] = {}
    rows: list[dict] = []
    plan = [p for p in PLAN if args.only is None or p[2] in (None, args.only) or fnmatch(p[1], args.only)]
    if args.only is not None and all(p[2] is None for p in plan):
        die(f"--only {args.only!r} names no regularizer and matches no arm")
    for loss, label, reg, params, weights in plan:
        if reg is not None and weights in (None, "wide"):
            weights = default_grid(reg, wide=weights == "wide")
        tuning = []
        if isinstance(weights, list):
            for w in weights:
                key = arm_key(loss, reg, params, w, seeds[0])
                if key in rec_tuned:  # measured before (its run folder may be gone)
                    tuning.append(rec_tuned[key])
                elif key in rec_arms:
                    tuning.append({"weight": w, "val_map@r": rec_arms[key]["val"]["map@r"],
                                   "measured": rec_arms[key].get("measured") or UNDATED})
                else:
                    m, out = run_one(loss, reg, params, w, seeds[0], args.runs, setting)
                    if m is None:  # a weight whose training diverged is recorded and never chosen
                        tuning.append({"weight": w, "val_map@r": None, "measured": today,
                                       "diverged": Path(str(out) + ".diverged").read_text().strip()})
                    else:
                        tuning.append({"weight": w, "val_map@r": m["val"]["map@r"], "measured": today})
                t = tuning[-1]
                print(f"[{time.time() - t0:6.0f} s]   tune {loss} {label} w={w:g}: " + (
                    "diverged" if t["val_map@r"] is None else f"val MAP@R {100 * t['val_map@r']:.2f}"), flush=True)
            weight = max((t for t in tuning if t["val_map@r"] is not None), key=lambda t: t["val_map@r"])["weight"]
            chosen[f"{loss}:{label}"] = weight
        elif isinstance(weights, str):  # "chosen:LABEL": this invocation's choice, else the recorded one
            ref = weights.split(":", 1)[1]
            if f"{loss}:{ref}" not in chosen:
                prior = [r for r in (old["rows"] if old else []) if r["loss"] == loss and r["arm"] == ref]
                if not prior:
                    die(f"'{loss} | {label}' takes the weight chosen for '{ref}', which is neither in "
                             f"this invocation nor in {out_json}")
                chosen[f"{loss}:{ref}"] = prior[0]["weight"]
            weight = chosen[f"{loss}:{ref}"]
        else:
            weight = weights
        vals: dict = {k: [] for k in KEYS} | {"val_map@r": [], "seconds": [], "parts": []}
        diverged = None
        dates = set()
        arm_seeds = variant_seeds if "," in label.split("(")[0] else seeds  # "determinant, logdet R": a variant
        for s in arm_seeds:
            w = weight if reg is not None else 0.0
            key = arm_key(loss, reg, params, w, s)
            if key in rec_arms:
                m = rec_arms[key]
                dates.add(m.get("measured") or UNDATED)
                if "diverged" in m:
                    diverged = m["diverged"]
                    break
                parts = m["parts"]
            else:
                m, out = run_one(loss, reg, params, w, s, args.runs, setting)
                if m is None:  # diverged: the arm is reported as such, with what diverged
                    diverged = Path(str(out) + ".diverged").read_text().strip()
                    print(f"[{time.time() - t0:6.0f} s] {loss} | {label} | w={weight} | seed {s}: {diverged}",
                          flush=True)
                    dates.add(today)
                    break
                parts = last_epoch_parts(out)
                dates.add(today)
            for k in KEYS:
                vals[k].append(m["test"][k])
            vals["val_map@r"].append(m["val"]["map@r"])
            vals["seconds"].append(m.get("train_seconds", float("nan")))
            vals["parts"].append(parts)
        rows.append({"loss": loss, "arm": label, "regularizer": reg, "params": list(params), "weight": weight,
                     "seeds": arm_seeds, "diverged": diverged, "tuning_on_val": tuning, "tuning_seed": seeds[0],
                     "measured": max(dates | {t.get("measured", UNDATED) for t in tuning}, default=today),
                     **vals})
        merge_rows(out_json, rows, seeds, setting)
        if diverged:
            continue
        print(f"[{time.time() - t0:6.0f} s] {loss} | {label} | w={weight} | test MAP@R {pm(vals['map@r'])}", flush=True)
    rows = merge_rows(out_json, rows, seeds, setting)
    argv = sys.argv[1:]
    for flag in ("--only", "--runs"):  # the table holds every arm, wherever the runs live: name the command
        if flag in argv:               # that measures them all
            i = argv.index(flag)
            argv = argv[:i] + argv[i + 2:]
        argv = [a for a in argv if not a.startswith(flag + "=")]
    cmd = "python " + " ".join(["bench/reg_fidelity.py"] + argv)
    L = ["# Regularizers as their papers define them, with controls (kanji, trained tail)", "",
         f"`{cmd}` (each row's measurement date in its last column) on 2 CPU cores: efficientnet_lite0 "
         f"(ImageNet), last "
         f"{args.train_blocks} stage(s) trained over the cached frozen prefix with the default tail recipe, "
         f"{args.epochs} epochs, seeds {', '.join(map(str, seeds))}, mean ± std; weights chosen on validation "
         "classes (seed 0); test classes reported.", "",
         "Last-epoch terms: the means over seeds of the last epoch's logged parts. A regularizer's own entry "
         "(determinant, nir, cgml, skewed_mean) is its term after its weight, as the step adds it; R_min, R_max, "
         "L_GC and nir_nll are unweighted; loss is the metric loss before any scale (NIR's w_align).", "",
         "| base | arm | seeds | weight | test MAP@R | R@1 | NMI | val MAP@R | last-epoch terms (mean over seeds) "
         "| s/run | measured |",
         "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("diverged"):
            done = r["seeds"][:len(r["map@r"])]
            before = (f"seeds {','.join(map(str, done))}: {pm(r['map@r'])}; " if done else "")
            L.append(f"| {r['loss']} | {r['arm']} | {','.join(map(str, r['seeds']))} | {r['weight']:g} | {before}seed "
                     f"{r['seeds'][len(done)]} diverged: {r['diverged']} | | | | | | "
                     f"{r.get('measured', UNDATED)} |")
            continue
        parts = {k: np.mean([p[k] for p in r["parts"] if k in p]) for k in DIAG if any(k in p for p in r["parts"])}
        terms = ", ".join(f"{k} {v:.4g}" for k, v in parts.items())
        tuned = "/".join(f"{t['weight']:g}" + (" diverged" if t["val_map@r"] is None else "")
                         for t in r["tuning_on_val"])
        tune = f" (from {tuned})" if tuned else ""
        w = "—" if r["regularizer"] is None else f"{r['weight']:g}{tune}"
        arm_seeds = ",".join(map(str, r.get("seeds", seeds)))
        L.append(f"| {r['loss']} | {r['arm']} | {arm_seeds} | {w} | {pm(r['map@r'])} | {pm(r['recall@1'])} | "
                 f"{pm(r['nmi'])} | "
                 f"{pm(r['val_map@r'])} | {terms} | {np.mean(r['seconds']):.0f} | {r.get('measured', UNDATED)} |")
    write_text(Path(args.out) / "results.md", "\n".join(L) + "\n")
    print("\n".join(L))


if __name__ == "__main__":
    main()
