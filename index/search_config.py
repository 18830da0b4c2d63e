"""One retrieval configuration: what each panel of the app, each side of a comparison and
each side of `python -m index report` searches under.

A configuration is a refinement strategy with its parameters and a mode, plus a query-time
re-ranker (index/rerankers) with its parameters.  `search` is the one place a configuration is
searched, on any backend (a `Gallery`): the strategy's search, then the re-ranker over its
candidates in the gallery's `MetricSpace`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from core.errors import UserError
from core.params import shown as show

from .backends.gallery import Gallery, Hits
from .metric import MODES
from .refinements import REFINEMENTS, strategy_key, strategy_label, strategy_params
from .rerankers import RERANKERS, reads_by_row, rerank, reranker_params
from .space import MetricSpace, gallery_space
from .threads import request_threads

NO_RERANK = "none"


@dataclass(frozen=True)
class SearchConfig:
    strategy: str = "trained"
    params: dict = field(default_factory=dict)
    mode: str = "cosine"
    rerank: str = NO_RERANK
    rerank_params: dict = field(default_factory=dict)

    @classmethod
    def of(cls, strategy: str = "trained", given=None, mode: str = "cosine", rerank: str = NO_RERANK,
           rerank_params: dict | None = None, *, strict: bool = False) -> SearchConfig:
        """A configuration with the strategy's typed parameters (defaults filled in) from a dict
        or `key=value` strings; `strict`: a key the strategy does not take is refused (else
        ignored: callers that hold every strategy's values at once, as the app's controls)."""
        REFINEMENTS.get(strategy)  # an unknown name is refused with the known ones
        if mode not in MODES:
            raise UserError(f"mode must be one of {list(MODES)}, got {mode!r}")
        p = REFINEMENTS.params(strategy, given or {}, ignore_unknown=not strict)
        rerank = rerank or NO_RERANK
        rp = RERANKERS.params(rerank, dict(rerank_params or {}), ignore_unknown=not strict)
        return cls(strategy, dataclasses.asdict(p), mode, rerank, dataclasses.asdict(rp))

    def label(self) -> str:
        """`strategy(params) · mode`, and `· rerank(params)` where a re-ranker is set."""
        text = f"{strategy_label(self.strategy, self.params)} · {self.mode}"
        if self.rerank != NO_RERANK:
            shown = {f.name: f for f in dataclasses.fields(RERANKERS.get(self.rerank).params)}
            args = ", ".join(f"{k}={show(shown[k], v) if k in shown else v}" for k, v in self.rerank_params.items()
                             if v not in (None, ""))
            text += f" · {self.rerank}({args})" if args else f" · {self.rerank}"
        return text

    def key(self) -> tuple:
        """Hashable identity, for caches: typed strategy parameters, mode, re-ranker."""
        return (strategy_key(self.strategy, self.params), self.mode, self.rerank,
                tuple(sorted((k, str(v)) for k, v in self.rerank_params.items())))

    def normalized(self) -> SearchConfig:
        """The same configuration with every strategy parameter typed and its defaults filled in
        (its label then names them all)."""
        return SearchConfig.of(self.strategy, self.params, self.mode, self.rerank, self.rerank_params)

    def with_mode(self, mode: str) -> SearchConfig:
        return dataclasses.replace(self, mode=mode, params=dict(self.params), rerank_params=dict(self.rerank_params))

    def typed_params(self):
        return strategy_params(self.strategy, self.params)

    def check_searchable(self) -> None:
        """Refuse an unknown re-ranker or parameters it does not take, with the valid ones."""
        reranker_params(self.rerank, self.rerank_params)

    def search(self, gallery: Gallery, queries: np.ndarray, k: int, *, self_ids=None,
               what: str = "queries") -> Hits:
        """The top k under this configuration (its mode as given: resolve it first), each query's
        own gallery row (`self_ids`: a row per query, −1 for none) left out.  Without a re-ranker:
        the gallery's own search, bit for bit; with one: the re-ranker over that search, in the
        gallery's metric space (a backend that cannot hold one refuses, naming itself)."""
        request_threads()
        if self.rerank == NO_RERANK and self_ids is None:
            return gallery.search(queries, self.strategy, self.params, self.mode, k, what)
        q = gallery.prepare_queries(queries, what)
        return rerank(self.rerank, self.space(gallery), q, k, params=self.rerank_params, self_ids=self_ids)

    def space(self, gallery: Gallery) -> MetricSpace:
        """The metric space this configuration's re-ranker runs in (cached per gallery): read by
        row where the re-ranker reads only the rows a query touches (`RerankerSpec.by_row`)."""
        return gallery_space(gallery, self.strategy, self.params, self.mode,
                             reads_by_row(self.rerank, self.rerank_params))

    def without_rerank(self) -> SearchConfig:
        """The same strategy, parameters and mode, no re-ranker: the first search a re-ranker reads."""
        return dataclasses.replace(self, params=dict(self.params), rerank=NO_RERANK, rerank_params={})

    def to_dict(self) -> dict:
        """As exports write it (JSON-ready)."""
        return {"strategy": self.strategy, "params": dict(self.params), "mode": self.mode, "rerank": self.rerank,
                "rerank_params": dict(self.rerank_params), "label": self.label()}

    @classmethod
    def from_dict(cls, d: dict) -> SearchConfig:
        return cls.of(d.get("strategy", "trained"), d.get("params") or {}, d.get("mode", "cosine"),
                      d.get("rerank", NO_RERANK), d.get("rerank_params") or {}, strict=True)

