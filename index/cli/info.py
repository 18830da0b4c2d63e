"""`info`, `list`: what an index holds and a strategy makes of its metric; the registered
strategies and re-rankers with their parameters."""
from __future__ import annotations

import json

from ..refinements import REFINEMENTS
from ..rerankers import RERANKERS
from .flags import strategy_args, strategy_params_from


def info_parser(sub) -> None:
    i = sub.add_parser("info", help="show an index's manifest and a strategy's matrix properties")
    i.add_argument("--index", required=True, help="index directory")
    strategy_args(i)
    i.set_defaults(func=cmd_info)


def cmd_info(args) -> int:
    from ..backends.search import Searcher
    from ..backends.store import read_index

    data = read_index(args.index)
    rep = Searcher(data).metric(args.strategy, strategy_params_from(args)).report
    print(json.dumps({"manifest": data.manifest, "metric": {"strategy": args.strategy} | rep}, indent=2))
    return 0


def list_parser(sub) -> None:
    ls = sub.add_parser("list", help="list the refinement strategies and the re-rankers with their parameters and "
                                     "defaults")
    ls.set_defaults(func=cmd_list)


def cmd_list(args) -> int:
    print(REFINEMENTS.listing())
    print()
    print(RERANKERS.listing())
    return 0
