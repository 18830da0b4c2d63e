"""`report`: one self-contained HTML page comparing two configurations over every query of an
index (left: x, right: y), each a strategy, its parameters, a mode and a re-ranker."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from core.errors import UserError
from core.flags import add_shared_args

from ..refinements import MODES, REFINEMENTS
from ..rerankers import RERANKERS
from ..search_config import SearchConfig
from ..space import set_memory_budget
from ..threads import batch_threads
from .flags import strategy_args, strategy_params_from, threads_arg


def report_parser(sub) -> None:
    rp = sub.add_parser("report", help="one self-contained HTML page: two configurations (trained vs a strategy, "
                                       "by default) over every query")
    rp.add_argument("--index", required=True, help="index directory (every item is a query, leave-one-out)")
    rp.add_argument("--out", required=True, help="the HTML file to write (figures and thumbnails inlined)")
    rp.add_argument("--analysis", help="folder written by `python -m index evaluate`: its strategy table and "
                                       "curves go into the report (default: none)")
    rp.add_argument("--top", type=int, default=20,
                    help="improved and worsened queries shown, each (default: %(default)s)")
    rp.add_argument("--k", type=int, default=8, help="results shown per query and configuration, and the k of "
                                                     "Jaccard@k, their top-k overlap (default: %(default)s)")
    rp.add_argument("--no-verify", action="store_true", help="skip the checksum verification at load")
    add_shared_args(rp, "cache_memory")
    threads_arg(rp)
    g = rp.add_argument_group("left configuration (x; the flags below --strategy set the right one, y)")
    g.add_argument("--left-strategy", default="trained", metavar="NAME",
                   help=f"refinement strategy of the left side, one of {', '.join(REFINEMENTS.names())} "
                        "(default: %(default)s)")
    g.add_argument("--left-param", action="append", default=[], metavar="KEY=VALUE",
                   help="a parameter of --left-strategy, repeated for each (e.g. --left-param r=0.3 --left-param "
                        "seed=1; `python -m index list` shows each strategy's) (default: none: the strategy's own "
                        "defaults)")
    g.add_argument("--left-mode", default=None, metavar="MODE",
                   help=f"mode of the left side, one of {', '.join(MODES)} (default: the right side's --mode, "
                        "cosine unless given, so that a report without left flags compares trained in the same "
                        "mode)")
    rr = ("one of " + "; ".join(f"{e.name}: {e.doc.rstrip('.')}" for e in RERANKERS.entries())).replace("%", "%%")
    rr_params = RERANKERS.params_help().replace("%", "%%")
    g.add_argument("--left-rerank", default="none", metavar="NAME",
                   help=f"query-time re-ranker of the left side over its strategy's search, one of "
                        f"{', '.join(RERANKERS.names())}, as for --rerank (default: %(default)s)")
    g.add_argument("--left-rerank-param", action="append", default=[], metavar="KEY=VALUE",
                   help="a parameter of --left-rerank, repeated for each, as for --rerank-param (default: none: "
                        "the re-ranker's own defaults)")
    strategy_args(rp)
    r = rp.add_argument_group("right re-ranker (y: over the right side's strategy and mode; every query is "
                              "re-ranked with its own item left out)")
    r.add_argument("--rerank", default="none", metavar="NAME",
                   help=f"query-time re-ranker of the right side, {rr} (default: %(default)s)")
    r.add_argument("--rerank-param", action="append", default=[], metavar="KEY=VALUE",
                   help=f"a parameter of --rerank, repeated for each (e.g. --rerank-param n=3 --rerank-param "
                        f"alpha=1; {rr_params}) (default: none: the re-ranker's own defaults)")
    rp.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    from ..analysis.report import write_report
    from ..backends.store import read_index

    batch_threads(args.threads, torch=False)
    set_memory_budget(args.cache_memory)
    analysis = Path(args.analysis) if args.analysis else None
    if analysis is not None and not analysis.is_dir():
        raise UserError(f"--analysis folder not found: {analysis}")
    if args.top < 1 or args.k < 1:
        raise UserError("--top and --k must be at least 1")
    # the left side is checked here, not by argparse: a bad value is one `error:` line
    left_mode = args.mode if args.left_mode is None else args.left_mode
    if left_mode not in MODES:
        raise UserError(f"--left-mode must be one of {', '.join(MODES)}, got {left_mode!r}")
    try:
        REFINEMENTS.get(args.left_strategy)
    except UserError as e:
        raise UserError(f"--left-strategy: {e}") from None
    try:  # strict: a parameter the left strategy does not take is refused, with those it takes
        left = SearchConfig.of(args.left_strategy, args.left_param, left_mode, strict=True)
    except UserError as e:
        raise UserError(f"--left-param: {e}") from None
    right = SearchConfig.of(args.strategy, strategy_params_from(args), args.mode)
    # each side's re-ranker, checked here as the left side is: a bad name or parameter is one `error:` line
    sides = []
    for cfg, flag, name, items in ((left, "--left-rerank", args.left_rerank, args.left_rerank_param),
                                   (right, "--rerank", args.rerank, args.rerank_param)):
        try:
            RERANKERS.get(name)
        except UserError as e:
            raise UserError(f"{flag}: {e}") from None
        try:  # strict: a parameter the re-ranker does not take is refused, with those it takes
            typed = dataclasses.asdict(RERANKERS.params(name, items))
        except UserError as e:
            raise UserError(f"{flag}-param: {e}") from None
        sides.append(dataclasses.replace(cfg, rerank=name, rerank_params=typed))
    left, right = sides

    def progress(done: int, total: int, what: str) -> None:
        if sys.stderr.isatty():  # a re-ranked side re-ranks every query: say how far it is
            print(f"\r{what}: {done:,}/{total:,}", end="\n" if done == total else "", file=sys.stderr, flush=True)

    out = write_report(read_index(args.index, verify=not args.no_verify), args.out, left, right, top=args.top,
                       k=args.k, analysis=analysis, progress=progress)
    print(f"written: {out}")
    return 0
