"""The flags several `python -m index` commands share, so that a flag means the same on each:
the metric (--strategy, a flag per strategy parameter, --mode), the re-ranker (--rerank,
--rerank-param), the threads, the data settings and Milvus's connection."""
from __future__ import annotations

import argparse
import dataclasses

from core.config import add_config_args
from core.errors import UserError
from core.flags import DEFAULTS, at_least
from core.params import convert
from data import DATASETS, DataConfig
from data.config import RUNTIME_FIELDS

from ..refinements import MODES, REFINEMENTS, shared_params
from ..rerankers import RERANKERS
from ..threads import cores

INHERITED = "the checkpoint's"


# ---------------------------------------------------------------- the metric (search, info, report)
def strategy_args(p):
    g = p.add_argument_group("metric (refinement strategy; `python -m index list` shows each one's parameters)")
    REFINEMENTS.add_argument(g, "--strategy", default="trained", help="refinement strategy M* ↦ M′")
    strategy_param_args(g)
    g.add_argument("--mode", choices=MODES, default="cosine",
                   help="cosine under M′, the standard evaluation the paper follows (for M* the cosine of "
                        "the embeddings; an indefinite M′ has none and falls back to bilinear, with a note: "
                        "the *-psd strategies read it as PSD), or bilinear φ(q)ᵀM′φ(x), our extra view "
                        "(default: %(default)s)")


def strategy_param_args(g):
    """One flag per parameter name over all strategies; unset = the chosen strategy's default."""
    for sp in shared_params():
        g.add_argument(sp.flag, dest=sp.name, type=_param_type(sp), default=None,
                       help=sp.describe().replace("%", "%%"))


def _param_type(sp):
    def parse(value: str):
        try:
            return convert(value, sp.type, "value")
        except UserError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = getattr(sp.type, "__name__", "value")
    return parse


def strategy_params_from(args) -> dict:
    """The parameter flags' values; one given that --strategy does not take is refused: ignoring
    it would search another M′ than the one asked for (e.g. --psd on the raw restraint)."""
    given = {sp.name: getattr(args, sp.name) for sp in shared_params()}
    for sp in shared_params():
        if given[sp.name] is not None and args.strategy not in sp.defaults:
            raise UserError(f"strategy {args.strategy} takes no {sp.flag}; {', '.join(sp.defaults)} "
                            f"{'do' if len(sp.defaults) > 1 else 'does'}")
    return given


def strategy_list(s: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in s.split(",") if v.strip())
    try:
        for n in names:
            REFINEMENTS.get(n)
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return names


# ---------------------------------------------------------------- the re-ranker (search)
def rerank_args(p, prefix: str = ""):
    """--rerank NAME and --rerank-param KEY=VALUE[,KEY=VALUE] (prefix "left-": the report's left side)."""
    side = f" ({prefix.rstrip('-')} side)" if prefix else ""
    g = p.add_argument_group(f"re-ranking{side} (query time, over the strategy's ranking; `python -m index list` "
                             "shows each re-ranker's parameters)")
    RERANKERS.add_argument(g, f"--{prefix}rerank", default="none",
                           help="re-ranker applied to the strategy's search (none: the search itself)")
    g.add_argument(f"--{prefix}rerank-param", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help=("the re-ranker's parameters, each unset one at its default: "
                         + RERANKERS.params_help() + " (default: none given)").replace("%", "%%"))


def key_values_from(values: list[str], flag: str = "--rerank-param") -> dict:
    """`k1=20,k2=6` (and repeated flags) → {key: text}, from any KEY=VALUE[,KEY=VALUE] flag (`flag`
    names it in a refusal): their owner types and checks them."""
    out = {}
    for v in values:
        for item in filter(None, (s.strip() for s in v.split(","))):
            key, eq, val = item.partition("=")
            if not eq or not key.strip():
                raise UserError(f"{flag} wants KEY=VALUE, got {item!r}")
            out[key.strip()] = val.strip()
    return out


# ---------------------------------------------------------------- threads (search, evaluate, select)
THREADS_HELP = ("CPU threads for torch, FAISS and the re-rankers' query batches, set once at start-up "
                "(numpy's BLAS runs on one thread in `search` and where re-rankers run: the batches spread "
                "over the threads instead); 0 = $OMP_NUM_THREADS where set, else every core this process "
                "may use")


def threads_arg(p) -> None:
    """--threads of a batch command: the same meaning on every one (`index.threads.batch_threads`)."""
    p.add_argument("--threads", type=at_least(0, "--threads"), default=DEFAULTS["threads"],
                   help=f"{THREADS_HELP} ({cores()} here) (default: %(default)s)")


# ---------------------------------------------------------------- data settings (build, evaluate, select)
def data_args(p, defaults: dict | None = None) -> None:
    """The data settings; each defaults to the checkpoint's (what the model was trained on)."""
    g = p.add_argument_group("data (each defaults to the checkpoint's own; a value that changes what the "
                             "model sees prints a warning)")
    add_config_args(g, DataConfig, defaults=defaults, registries={"dataset": DATASETS}, inherit=INHERITED,
                    skip=RUNTIME_FIELDS)
    # how this machine loads images: this command's own defaults, never the checkpoint's
    add_config_args(g, DataConfig, defaults=defaults,
                    skip=tuple(f.name for f in dataclasses.fields(DataConfig) if f.name not in RUNTIME_FIELDS))


def given_data(args) -> dict:
    """The data settings given on the command line (or in --config); None = the checkpoint's."""
    return {f.name: getattr(args, f.name, None) for f in dataclasses.fields(DataConfig)}


# ---------------------------------------------------------------- Milvus (search, export)
