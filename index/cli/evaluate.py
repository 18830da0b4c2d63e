"""`evaluate`, `select`: every strategy's sweep on a split of the checkpoint's data set (tables,
plots, the strategy × re-ranker matrix), and the strategy validation picks."""
from __future__ import annotations

import argparse
import json

from core.atomic import check_file_target, write_json
from core.flags import add_shared_args, at_least

from ..refinements import GRIDS, REFINEMENTS, file_params
from ..rerankers import RERANKERS
from ..space import set_memory_budget
from ..threads import batch_threads
from .flags import data_args, given_data, strategy_list, threads_arg


# ---------------------------------------------------------------- evaluate
def evaluate_parser(sub) -> None:
    e = sub.add_parser("evaluate", help="evaluate all strategies on a split (JSON, plots, table)")
    _checkpoint_arg(e)
    e.add_argument("--out", required=True, help="folder for strategies.json, table.md and plots")
    e.add_argument("--splits", type=_splits, default=("test", "val"), metavar="SPLIT[,val]",
                   help="the split to evaluate on, and val to add the validation-selected row "
                        "(default: test,val)")
    _sweep_args(e)
    RERANKERS.add_argument(e, "--rerankers", many=True, default=("none",), default_help="none",
                           help="re-rankers (comma-separated) applied to one setting per strategy and mode (the "
                                "one validation chose, else its defaults), each with the parameters validation "
                                "chooses from its grid (--grid): the strategy × re-ranker matrix goes to "
                                "OUT/rerank.md")
    e.set_defaults(func=cmd_evaluate)


def cmd_evaluate(args) -> int:
    from ..analysis.strategy_eval import counts_line, run_evaluation, table_markdown
    from ..build import split_features

    if args.json:
        check_file_target(args.json)
    batch_threads(args.threads, one_blas_thread=any(r != "none" for r in args.rerankers))
    set_memory_budget(args.cache_memory)
    splits = args.splits
    split = next((s for s in splits if s != "val"), "val")
    cache = args.cache_dir or None
    f, y, W = split_features(args.checkpoint, given_data(args), split, cache, args.progress, args.device)
    val = None
    if "val" in splits and split != "val":
        vf, vy, _ = split_features(args.checkpoint, given_data(args), "val", cache, args.progress, args.device)
        val = (vf, vy)
    res = run_evaluation(f, y, W, args.out, val=val, normalize=args.normalize, seeds=args.seeds,
                         progress=args.progress, split=split, rerankers=args.rerankers, **_narrowing(args))
    print(counts_line(res["counts"]))
    print(table_markdown(res["table"]))
    if "rerank" in res:
        from ..analysis.rerank_eval import matrix_markdown

        print(matrix_markdown(res["rerank"]))
    print(f"written: {args.out}/strategies.json, table.md{', rerank.md' if 'rerank' in res else ''}, "
          "restraint_sweep.png, principles.png")
    if args.json:
        keys = ("table", "counts", "split", "grid", "strategies")
        write_json(args.json, {k: res[k] for k in keys} | ({"rerank": {k: v for k, v in res["rerank"].items()
                                                                       if k != "runs"}} if "rerank" in res else {}))
    return 0


# ---------------------------------------------------------------- select
def select_parser(sub) -> None:
    e = sub.add_parser("select", help="pick strategy and parameter by MAP@R on validation classes")
    _checkpoint_arg(e)
    _sweep_args(e)
    e.set_defaults(func=cmd_select)


def cmd_select(args) -> int:
    from ..analysis.strategy_eval import counts_line, select_strategy
    from ..build import split_features

    if args.json:
        check_file_target(args.json)
    batch_threads(args.threads, one_blas_thread=False)
    vf, vy, W = split_features(args.checkpoint, given_data(args), "val", args.cache_dir or None, args.progress,
                               args.device)
    res = select_strategy(vf, vy, W, normalize=args.normalize, seeds=args.seeds, progress=args.progress,
                          **_narrowing(args))
    sel = res["selected"]
    out = {"selected": res["label"], "strategy": sel["strategy"], "params": sel["params"], "mode": sel["mode"],
           "val_map@r": sel["map@r"], "val": counts_line(res["counts"]),
           "principles": {"trace_over_frobenius": sel["M_trace_over_frobenius"],
                          "frobenius_over_trace": sel["M_frobenius_over_trace"]}}
    if args.json:
        write_json(args.json, out | {"all": res["all"]})
    print(json.dumps(out, indent=2))
    return 0


# ---------------------------------------------------------------- the flags both take
def _checkpoint_arg(e) -> None:
    e.add_argument("--checkpoint", required=True,
                   help="trained checkpoint whose features are evaluated (its data set, split and "
                        "preprocessing are used unless the data flags below say otherwise)")


def _sweep_args(e) -> None:
    """The flags evaluate and select share: which strategies and settings, and the features."""
    e.add_argument("--strategies", type=strategy_list, default=None, metavar="NAME,...",
                   help="only these strategies (default: every one that needs no file: "
                        f"{', '.join(n for n in REFINEMENTS.names() if not file_params(n))})")
    e.add_argument("--grid", choices=GRIDS, default="coarse",
                   help="every other value of each strategy's and re-ranker's parameter grid (both ends and the "
                        "default kept for re-rankers), or the whole grid "
                        "(`index list`); full with --seeds 3 is the protocol of docs/refinement.md, about 3× "
                        "the time (default: %(default)s)")
    e.add_argument("--seeds", type=at_least(1, "--seeds"), default=1,
                   help="seeds per random strategy setting, averaged (default: %(default)s)")
    e.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=True,
                   help="L2-normalise φ(x), as indexes do by default (default: %(default)s)")
    add_shared_args(e, "json", "progress", "cache_dir", "device", "cache_memory")
    threads_arg(e)
    data_args(e)


def _splits(s: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in s.split(",") if v.strip())
    if not names or len([n for n in names if n != "val"]) > 1:
        raise argparse.ArgumentTypeError(f"--splits wants one evaluated split and optionally val "
                                         f"(e.g. test,val), got {s!r}")
    return names


def _narrowing(args) -> dict:
    return {"strategies": args.strategies, "grid_name": args.grid}
