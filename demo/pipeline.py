"""The demo pipeline behind `make demo` (`python -m demo`): each step reuses what a previous run made.

The only package that imports training, index and app together.

1. prepare kanji  2. evaluate the raw pretrained trunk (and the random floor)
3. train ProxyAnchor on frozen efficientnet_lite0 features (the neck only)
4. train ProxyAnchor with a trained tail: efficientnet_lite0's last 2 stages, over the cached
   frozen prefix, plus the neck; evaluate it on test under its trained metric and under identity
   (cosine of the trained trunk features: paper 004's comparison on a trained trunk)
5. build the demo index over the test split with the trained-tail model
6. evaluate the refinement strategies on it  7. launch the app (unless --no-ui)
With --tune DURATION, also an Optuna study of the training recipe on validation classes
(`python -m training tune`); its best trial's model gets an index and strategy evaluation of its own,
its row stands beside the defaults', and the app serves it with the default model beside it.
--dataset and --data-root run the same steps on another data set (an ImageFolder of the user's).
With --paper-regime, also paper 004's regime (every stage fine-tuned, the neck left at its
initialisation), a second index built from it, and the app serving both, each page linking to the other.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from core.atomic import write_json
from data import DataConfig, load_data
from training.config import TrainConfig

log = logging.getLogger("demo")


TAIL_BLOCKS = 2    # head conv + the last block group: trains in ~2.5 s an epoch on 2 cores at 64 px
# validation MAP@R has flattened by then: 48.58 after 6 epochs, as after 8; 48.53 after 10, 48.75 after 15
# (seed 0, 2026-11-26); 6 keep `make demo` from a fresh clone, installs included, under 4 minutes
TAIL_EPOCHS = 6


def demo_data(num_classes: int = 500, dataset: str = "kanji", data_root: str | None = None,
              image_size: int = 0) -> DataConfig:
    return DataConfig(dataset=dataset, data_root=data_root, num_classes=num_classes, image_size=image_size)


def data_tag(data: DataConfig) -> str:
    """'' for the default kanji set (the demo's run folders keep their names), else '-DATASET-DIGEST':
    the runs of another data set never replace the kanji demo's."""
    if data == demo_data():
        return ""
    digest = hashlib.sha256(json.dumps(data.data_fields(), sort_keys=True, default=str).encode()).hexdigest()[:8]
    return f"-{data.dataset}-{digest}"


def demo_train_config(num_classes: int = 500, out: str = "runs/demo-proxy_anchor",
                      data: DataConfig | None = None) -> TrainConfig:
    """The frozen-neck baseline: ProxyAnchor on cached efficientnet_lite0 features."""
    data = data or demo_data(num_classes)
    return TrainConfig(**data.data_fields(), backbone="efficientnet_lite0", loss="proxy_anchor", mode="frozen",
                       out=out + data_tag(data), seed=0, device="cpu")


def demo_tail_config(num_classes: int = 500, out: str = "runs/demo-proxy_anchor-tail2",
                     data: DataConfig | None = None) -> TrainConfig:
    """The demo's model: ProxyAnchor with efficientnet_lite0's last TAIL_BLOCKS stages trained."""
    data = data or demo_data(num_classes)
    return TrainConfig(**data.data_fields(), backbone="efficientnet_lite0", loss="proxy_anchor", mode="tail",
                       train_blocks=TAIL_BLOCKS, epochs=TAIL_EPOCHS, out=out + data_tag(data), seed=0, device="cpu")


def tuned_config(data: DataConfig, budget: str, cache_dir: str):
    """The recipe study the demo runs with --tune, on the demo's data."""
    from training.tune import TuneConfig

    return TuneConfig(**data.data_fields(), out="runs/demo-tune" + data_tag(data), budget=budget, seed=0,
                      device="cpu", cache_dir=cache_dir)


def recipe(cfg: TrainConfig) -> str:
    """'efficientnet_lite1, fine-tuned, binomial, 12 epochs, lr 3.2e-04, d 256': a trial's recipe in words."""
    mode = {"frozen": "frozen trunk", "finetune": "fine-tuned"}.get(cfg.resolved_mode(),
                                                                    f"tail of {cfg.train_blocks} stages")
    reg = f", {cfg.regularizer[0]} ×{cfg.reg_weight[0]:.3g}" if cfg.regularizer else ""
    params = f" ({', '.join(_short(item) for item in cfg.loss_param)})" if cfg.loss_param else ""
    return (f"{cfg.backbone}, {mode}, {cfg.loss}{params}{reg}, {cfg.epochs} epochs, lr {cfg.lr:.2g}, "
            f"batch {cfg.batch_size}/{cfg.m_per_class} per class, d {cfg.embed_dim}")


PAPER_EPOCHS = 3   # after the 30-epoch probe: ~3.5 min on 2 cores


def demo_paper_config(num_classes: int = 500, out: str = "runs/demo-proxy_anchor-paper") -> TrainConfig:
    """Paper 004's regime: every stage fine-tuned while the neck stays at nn.Linear's initialisation
    (its checkpoints train the neck at lr 1e-6, so W barely moves); the same loss and data as the demo."""
    return TrainConfig(dataset="kanji", num_classes=num_classes, backbone="efficientnet_lite0",
                       loss="proxy_anchor", mode="finetune", epochs=PAPER_EPOCHS, neck_lr_mult=0.0,
                       neck_init="pytorch", out=out, seed=0, device="cpu")


def _short(item: str) -> str:
    """'alpha=1.0225424974549604' → 'alpha=1.02'."""
    key, _, value = item.partition("=")
    try:
        return f"{key}={float(value):.3g}"
    except ValueError:
        return item


@contextmanager
def _stage(times: dict, name: str):
    """Wall time per step, printed at the end: the 5-minute budget is spent where it says."""
    t = time.time()
    yield
    times[name] = time.time() - t


# the re-ranker the demo runs on top of the validation-selected strategy, with the parameters validation
# chooses from its coarse grid: k-reciprocal, the one validation prefers on kanji (docs/reranking.md: AQE,
# DBA and diffusion gain less); trying the others here would add about 10 s per re-ranker
DEMO_RERANKERS = ("kreciprocal",)


def _row(name: str, res: dict) -> str:
    return (f"| {name} | {res['map@r']*100:.2f} | {res['recall@1']*100:.2f} | "
            f"{res['r_precision']*100:.2f} | {res['nmi']*100:.2f} |")


def pretrained_baselines(cfg: DataConfig, splits, cache_dir: str) -> dict:
    """Raw trunk features (through the same feature cache training uses).  The pretrained trunk's
    pass over every split also stores the trained tail's frozen prefix (the first stages but
    TAIL_BLOCKS), so the frozen neck and the tail then read caches instead of running it again."""
    from evaluation import evaluate
    from evaluation.evaluator import DEFAULT_KS
    from model.backbones import build_backbone
    from model.features import backbone_features
    from model.preprocess import transform_for

    out = {}
    for name, bb_name, weights in [
            ("efficientnet_lite0 trunk, ImageNet, no training", "efficientnet_lite0", "imagenet"),
            ("small_cnn, random init (floor)", "small_cnn", "none")]:
        torch.manual_seed(0)
        bb = build_backbone(bb_name, weights=weights).eval()
        spec = transform_for(bb, cfg)
        if weights == "imagenet":
            for sub in (splits.train, splits.val):
                backbone_features(bb, splits, sub, spec, cfg, cache_dir, prefix_stages=len(bb.stages()) - TAIL_BLOCKS)
        f, y, _ = backbone_features(bb, splits, splits.test, spec, cfg, cache_dir,
                                    prefix_stages=len(bb.stages()) - TAIL_BLOCKS if weights == "imagenet" else None)
        out[name] = evaluate(f, y, ks=DEFAULT_KS)
    return out


def run_demo(args) -> int:
    from evaluation import evaluate
    from index.build import split_features
    from training.trainer import train_or_reuse

    t0 = time.time()
    data = demo_data(args.num_classes, args.dataset, args.data_root, args.image_size)
    out = Path(args.out or "artifacts/demo" + data_tag(data))
    fcfg = demo_train_config(data=data)
    tcfg = demo_tail_config(data=data)
    tune_cfg = tuned_config(data, args.tune, tcfg.cache_dir) if args.tune else None
    if tune_cfg is not None:
        tune_cfg.validate()  # before anything is written
    times: dict = {}
    with _stage(times, f"1 prepare {data.dataset}"):
        splits = load_data(tcfg.data_config())
    log.info("%s: %s", data.dataset, splits.split_summary())
    with _stage(times, "2 raw trunk and floor"):
        results = pretrained_baselines(tcfg.data_config(), splits, tcfg.cache_dir)
    with _stage(times, "3 frozen neck"):
        frozen, _ = train_or_reuse(fcfg)
    results["ProxyAnchor, frozen efficientnet_lite0, trained neck only"] = frozen["test"]
    with _stage(times, "4 trained tail"):
        metrics, reused = train_or_reuse(tcfg)
        results[f"ProxyAnchor, trained tail (last {TAIL_BLOCKS} stages) + neck: trained [cosine]"] = metrics["test"]
        # identity on the same trained trunk: cosine of its trunk features φ (no neck)
        f, y, _ = split_features(Path(tcfg.out) / "best.pt", tcfg.data_config(), "test", tcfg.cache_dir)
        results["same trained trunk, identity [cosine] (no neck)"] = evaluate(f, y)
    tuned = None
    if tune_cfg is not None:
        from training.checkpoints import recorded_config
        from training.tune import tune

        with _stage(times, "4a tune"):
            summary = tune(tune_cfg)
        if "best" not in summary:
            from core.errors import UserError

            raise UserError(f"the recipe study in {tune_cfg.out} completed no trial within --tune {args.tune}")
        run = Path(summary["best"]["run"])
        tuned = TrainConfig(**(recorded_config(run) or {}))
        tm = json.loads((run / "metrics.json").read_text())
        results[f"tuned on validation ({recipe(tuned)}): trained [cosine]"] = tm["test"]
    paper = None
    if args.paper_regime:
        pcfg = demo_paper_config(args.num_classes)
        with _stage(times, "4b paper regime"):
            pm, _ = train_or_reuse(pcfg)
            results["paper 004's regime (every stage fine-tuned, neck at init): trained [cosine]"] = pm["test"]
            f, y, _ = split_features(Path(pcfg.out) / "best.pt", pcfg.data_config(), "test", pcfg.cache_dir)
            results["same fine-tuned trunk, identity [cosine] (no neck)"] = evaluate(f, y)
    write_json(out / "eval.json", results)
    index_dir, strategies = build_demo_index(tcfg, out, times)
    tuned_index = build_demo_index(tuned, out, times, suffix="-tuned") if tuned is not None else None
    if args.paper_regime:
        paper = build_demo_index(pcfg, out, times, suffix="-paper")
    test = splits.test
    print(f"\n{data.dataset} test classes ({len(test.classes):,} classes, {len(test):,} queries; "
          "query = gallery, leave-one-out)")
    print("| model | MAP@R | R@1 | RP | NMI |\n|---|---|---|---|---|")
    for name, res in results.items():
        print(_row(name, res))
    print(f"\ntrained-tail run: {tcfg.out} ({'reused' if reused else 'trained now'}, "
          f"selected epoch {metrics['selected_epoch']} of {tcfg.epochs} on validation); frozen-neck run: {fcfg.out}")
    print_strategies(strategies, "the default recipe's model")
    if tuned is not None and tuned_index is not None:
        print_strategies(tuned_index[1], f"the tuned recipe's model ({tuned.out})")
    print(f"demo pipeline took {time.time() - t0:.1f} s ("
          + ", ".join(f"{k} {v:.0f} s" for k, v in times.items()) + f"); results in {out}/, index in {index_dir}")
    if args.no_ui:
        return 0
    from app.cli import build_parser, launch

    extra = []
    if tuned_index is not None:  # the tuned model first, the default recipe's beside it
        extra = ["--label", "tuned recipe", "--second-index", str(index_dir), "--second-analysis", str(strategies),
                 "--second-label", "default recipe"]
        index_dir, strategies = tuned_index
    elif paper:
        extra = ["--label", "neck trained (the demo's model)", "--second-index", str(paper[0]),
                 "--second-analysis", str(paper[1]),
                 "--second-label", "paper 004's regime (neck at its initialisation)"]
    launch(build_parser().parse_args(["--index", str(index_dir), "--analysis", str(strategies), *extra]))
    return 0


def print_strategies(strategies: Path, what: str) -> None:
    print(f"\nrefinement strategies on the test classes, {what} ({strategies}/table.md):")
    print((Path(strategies) / "table.md").read_text().rstrip("\n"))
    rr_file = Path(strategies) / "rerank_row.json"
    if rr_file.is_file():
        rr = json.loads(rr_file.read_text())
        t, b = rr["test"], rr["test_none"]
        which = (f"the re-ranker validation prefers ({rr['rerank']})" if len(DEMO_RERANKERS) > 1
                 else f"{rr['rerank']} re-ranking, parameters chosen on validation")
        print(f"| validation-selected + {which} | {rr['setting']} · "
              f"{rr['rerank']} | {t['map@r']*100:.2f} ({(t['map@r'] - b['map@r'])*100:+.2f}) | "
              f"{t['precision@1']*100:.2f} | {t['r_precision']*100:.2f} | {t['recall@4']*100:.2f} |\n")


def build_demo_index(tcfg: TrainConfig, out: Path, times: dict, suffix: str = "") -> tuple[Path, Path]:
    """The demo index (test split) and strategy evaluation, rebuilt only when the model changed."""

    from core.hashing import sha256_file
    from index.analysis.strategy_eval import run_evaluation
    from index.build import build_from_dataset, split_features
    from index.rerankers import RERANKERS

    ck = Path(tcfg.out) / "best.pt"
    sha = sha256_file(ck)
    index_dir, strat = out / f"index{suffix}", out / f"strategies{suffix}"
    try:
        built = json.loads((index_dir / "manifest.json").read_text())["checkpoint_sha256"] == sha
    except (OSError, ValueError, KeyError):
        built = False
    t = time.time()
    if built:
        log.info("reusing demo index %s", index_dir)
    else:
        build_from_dataset(ck, tcfg.data_config(), index_dir, split="test", cache_dir=tcfg.cache_dir)
    times[f"5 index{suffix}"] = time.time() - t
    stamp = strat / "checkpoint.sha256"
    # what the stored evaluation was made from: the checkpoint, and the re-rankers tried on top with
    # their defaults and grids (a change of either re-measures the row)
    tried = {n: [RERANKERS.get(n).param_defaults(), dict(RERANKERS.get(n).spec.grid)] for n in DEMO_RERANKERS}
    made_from = f"{sha}\nrerankers {json.dumps(tried, sort_keys=True, default=str)}"
    t = time.time()
    if stamp.is_file() and stamp.read_text().strip() == made_from and (strat / "table.md").is_file():
        log.info("reusing strategy evaluation %s", strat)
    else:
        dcfg = tcfg.data_config()
        f, y, W = split_features(ck, dcfg, "test", tcfg.cache_dir)
        vf, vy, _ = split_features(ck, dcfg, "val", tcfg.cache_dir)
        # `python -m index evaluate`'s default run (coarse grid, one seed); `--grid full --seeds 3`
        # is the whole sweep
        res = run_evaluation(f, y, W, strat, val=(vf, vy))
        from core.atomic import write_text
        from index.analysis.rerank_eval import best_reranker
        from index.search_config import SearchConfig

        sel = max(res["val"], key=lambda r: r["map@r"])
        t_rr = time.time()
        row = best_reranker((f, y), (vf, vy), W, SearchConfig.of(sel["strategy"], sel["params"], sel["mode"]),
                            DEMO_RERANKERS)
        write_json(strat / "rerank_row.json", row | {"seconds": time.time() - t_rr})
        write_text(stamp, made_from + "\n")
    times[f"6 strategies{suffix}"] = time.time() - t
    return index_dir, strat


def build_parser():
    import argparse

    from core.cli import Parser

    p = Parser(prog="python -m demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from data.registry import DATASETS

    p.add_argument("--out", default=None, help="where results, index and strategy evaluation are written "
                   "(default: artifacts/demo, or artifacts/demo-DATASET-DIGEST for other data)")
    DATASETS.add_argument(p, "--dataset", default="kanji", help="data set")
    p.add_argument("--data-root", default=None, help="data-set folder (imagefolder: ROOT/<class>/<image>; kanji: "
                   "its render cache, default cache/kanji) (default: %(default)s)")
    p.add_argument("--image-size", type=int, default=0, help="input size in pixels; 0 = the data set's default "
                   "(kanji 64, others the backbone's own) (default: %(default)s)")
    p.add_argument("--num-classes", type=int, default=500, help="kanji characters to render (default: %(default)s)")
    p.add_argument("--tune", metavar="DURATION", default=None, help="also choose the training recipe on "
                   "validation classes within DURATION (30m, 2h: python -m training tune --budget), and index, "
                   "evaluate and serve its best model beside the default recipe's (default: no study)")
    p.add_argument("--no-ui", action="store_true", help="non-interactive: do not launch the app at the end")
    p.add_argument("--paper-regime", action="store_true", help="also train paper 004's regime (every stage "
                   "fine-tuned, the neck left at its initialisation; a few more minutes on 2 cores), build a "
                   "second index from it, and serve it beside the demo's (on the next port; each page links to the "
                   "other), so identity's gain over the trained metric can be seen to appear and vanish")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def main(argv=None) -> int:
    from core.logs import setup_logging

    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    return run_demo(args)
