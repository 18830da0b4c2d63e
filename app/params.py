"""The app's search parameters: a configuration from the controls' or an API call's values
(`spec_from`), the search API's parameter names in their stable order (`api_params`), and how
the APIs read a re-ranker's parameters and an integer field.  A size that means "the whole
gallery" (the re-rankers' `WHOLE_GALLERY`) is shown as "all", and one that depends on the gallery's
size (`AUTO`) as "auto" (`shown`; a label shows them through the parameter's named values)."""
from __future__ import annotations

import dataclasses
import json
import re

from core.errors import UserError
from core.params import parse_items
from index.refinements import REFINEMENTS, file_params, shared_params, strategy_params
from index.rerankers import AUTO, WHOLE_GALLERY, reranker_params
from index.search_config import NO_RERANK, SearchConfig

DEFAULT_RIGHT = SearchConfig("identity")  # the right panel's first configuration (the left's: SearchConfig())
# The search API's parameters in their stable order.  Gradio's /search takes them positionally
# (gradio_client), so this order only ever grows at the end: a strategy parameter registered
# later follows these, in registry order.
API_ORDER = ("image", "strategy", "r", "seed", "alpha", "p", "mode", "k", "psd", "rerank", "rerank_params")
API_FIXED = ("image", "strategy", "mode", "k", "rerank", "rerank_params")  # the rest: strategy parameters
ALL = "all"  # how a whole-gallery size is shown
AUTO_WORD = "auto"  # how a size that depends on the gallery's is shown


def api_params() -> list[str]:
    """The search API's parameter names (Gradio's /search, POST /api/search) in their stable order:
    API_ORDER, then each file-free strategy parameter not in it, in registry order."""
    strategy = [sp.name for sp in shared_params() if not sp.metadata.get("file")]
    return ([n for n in API_ORDER if n in API_FIXED or n in strategy]
            + [n for n in strategy if n not in API_ORDER])


def spec_from(strategy, mode, values: dict, rerank: str = NO_RERANK, rerank_params: dict | None = None) -> SearchConfig:
    """A configuration from the parameter controls' or an API call's values (every strategy's, by
    name; the others are not read): the chosen strategy's typed parameters, so that its label shows
    exactly what was searched, and the re-ranker's (only its own: another key is refused with the
    ones it takes).  "all" for a size is the whole gallery."""
    for name in file_params(strategy):
        if not values.get(name):
            raise UserError(f"strategy {strategy}: upload {REFINEMENTS.get(strategy).param_help()[name]} first")
    rerank = rerank or NO_RERANK
    given = {k: v for k, v in (rerank_params or {}).items() if v is not None}  # "all": the parameter's word
    return SearchConfig(strategy, dataclasses.asdict(strategy_params(strategy, values)), mode, rerank,
                        dataclasses.asdict(reranker_params(rerank, given)))


def shown(value):
    """A parameter value as the user sees it: the whole-gallery size is "all", the size-dependent one "auto"."""
    if not isinstance(value, int) or isinstance(value, bool) or value < WHOLE_GALLERY:
        return value
    return AUTO_WORD if value == AUTO else ALL


def shown_params(params: dict) -> dict:
    return {k: shown(v) for k, v in params.items()}


def config_dict(cfg: SearchConfig) -> dict:
    """`SearchConfig.to_dict` as the app's exports and API echo it: sizes "all" where whole."""
    d = cfg.to_dict()
    return d | {"rerank_params": shown_params(d["rerank_params"]), "label": cfg.label()}


def rerank_params_from(given) -> dict:
    """A re-ranker's parameters as the APIs take them: a dict, a JSON object, or `key=value`
    pairs separated by commas or spaces ("n=3, alpha=1"); empty: none (its defaults)."""
    if given is None:
        return {}
    if isinstance(given, dict):
        return dict(given)
    text = str(given).strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            out = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"rerank_params: not a JSON object ({e.msg})") from None
        if not isinstance(out, dict):
            raise UserError("rerank_params: want a JSON object or key=value pairs")
        return out
    return parse_items([t for t in re.split(r"[,\s]+", text) if t], "rerank_params")


def whole_number(value, name: str) -> int:
    """An API's integer field, given as a number or as its text (a form field)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if isinstance(value, bool) or not number.is_integer():
        raise UserError(f"{name} must be a whole number, got {value!r}")
    return int(number)
