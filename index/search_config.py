"""One retrieval configuration: what each panel of the app, each side of a comparison and
each side of `python -m index report` searches under.

A configuration is a refinement strategy with its parameters and a mode, plus a query-time
re-ranker axis (`rerank`, `rerank_params`).  The re-ranker fields are carried through labels,
keys, links and exports already, but no search runs a re-ranker yet: `check_searchable`
refuses any but "none", so a result is never labelled with a re-ranking it did not get.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from core.errors import UserError

from .metric import MODES
from .refinements import REFINEMENTS, strategy_key, strategy_label, strategy_params

NO_RERANK = "none"
# the re-rankers a search can run; the re-ranker registry's names once it is wired in
SEARCHABLE_RERANKERS: tuple[str, ...] = (NO_RERANK,)


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
        return cls(strategy, dataclasses.asdict(p), mode, rerank or NO_RERANK, dict(rerank_params or {}))

    def label(self) -> str:
        """`strategy(params) · mode`, and `· rerank(params)` where a re-ranker is set."""
        text = f"{strategy_label(self.strategy, self.params)} · {self.mode}"
        if self.rerank != NO_RERANK:
            args = ", ".join(f"{k}={v}" for k, v in self.rerank_params.items() if v not in (None, ""))
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
        """Refuse a re-ranker no search can run yet (the one place the re-ranker axis is held back)."""
        if self.rerank not in SEARCHABLE_RERANKERS:
            raise UserError(f"re-ranker {self.rerank!r} is not available to this search; "
                            f"choose from {', '.join(SEARCHABLE_RERANKERS)}")

    def to_dict(self) -> dict:
        """As exports write it (JSON-ready)."""
        return {"strategy": self.strategy, "params": dict(self.params), "mode": self.mode, "rerank": self.rerank,
                "rerank_params": dict(self.rerank_params), "label": self.label()}

    @classmethod
    def from_dict(cls, d: dict) -> SearchConfig:
        return cls.of(d.get("strategy", "trained"), d.get("params") or {}, d.get("mode", "cosine"),
                      d.get("rerank", NO_RERANK), d.get("rerank_params") or {}, strict=True)

