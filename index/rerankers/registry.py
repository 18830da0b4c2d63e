"""Query-time re-rankers on the one Registry: a re-ranker takes the first search's candidates
under any strategy's M′ and mode and returns a new ranking.

A new re-ranker is one module with `@RERANKERS.register(...)` plus one import line in
`index/rerankers/__init__.py`.  The registered function is the online call

    fn(space: MetricSpace, queries, first: Hits, k, *, self_ids, params) -> Hits

`queries`: n_q × d, as `space.prepare` returns them; `first`: the plain search's top
`first_depth(...)` per query (None for a re-ranker registered with reads_first=False), which may
still hold the query's own row (`candidates` leaves it out); `self_ids`: n_q gallery
rows (−1: none) of queries that are gallery items (leave-one-out evaluation, the Compare tab):
such an item must not help its own re-ranking and is never returned.  `rerank(...)` below runs
the whole thing (prepare, first search, re-rank).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.errors import UserError
from core.registry import Registry, Spec

from ..space import Hits, MetricSpace, as_rows, drop_rows


@dataclass(frozen=True, kw_only=True)
class RerankerSpec(Spec):
    """A re-ranker's registration.

    offline: it needs a gallery–gallery pass (neighbour lists, an augmented gallery) computed
        once per (index, strategy, params, mode) and cached (`space.artefact`); the first query
        under a new space pays for it.
    depth: the parameter naming how many first-search candidates the online part reads (its
        candidate pool); "" when it reads only the top k.
    reads_first: it reads the first search at all (database-side augmentation searches its own
        augmented gallery instead: `first` is then None and no plain search is spent on it).
    pool: the parameter naming how many of the plain search's candidates its ranking holds
        (items beyond them are not ranked by it at all); "" when it ranks the whole gallery (a
        new search: query expansion, database-side augmentation).  A top-k answer with k above
        the pool reads k candidates instead (`ranked_pool`).
    grid: {param: values} a sweep tries (every combination); empty: the defaults only.
    whole_up_to, pool_above: what the pool's `auto` (AUTO) means at a gallery's size: the whole
        gallery up to `whole_up_to` items, the plain search's top `pool_above` candidates in a
        larger one (0, 0: a re-ranker whose pool takes no `auto`).
    by_row: its online part, at its defaults, reads only the rows a query touches (their vectors,
        lists and metadata), so it runs on a gallery an engine keeps (Milvus) read by row, without
        a copy of it in the process; there `auto` means the plain search's top `pool_above`.
    whole_when: {param: values} with which its online part reads the whole gallery after all (a
        by_row re-ranker's paper computation, kept as a choice): it then runs on a space that holds it.
    prepare: prepare(space, params, progress) builds its offline part ahead of its first query
        (`index graph --rerank NAME`), the neighbour lists it reads included; None: it has none
        beyond the lists.
    """
    offline: bool = False
    depth: str = ""
    reads_first: bool = True
    pool: str = ""
    grid: Mapping[str, tuple] = field(default_factory=dict)
    whole_up_to: int = 0
    pool_above: int = 0
    by_row: bool = False
    whole_when: Mapping[str, tuple] = field(default_factory=dict)
    prepare: Any = None  # a callable (Callable has no check in `conforms`)

    def check(self, entry) -> None:
        super().check(entry)
        names = {f.name for f in dataclasses.fields(entry.params)}
        unknown = sorted((set(self.grid) | set(self.whole_when)) - names)
        if unknown:
            raise ValueError(f"{entry.what}: grid or whole_when names {unknown}, which are not its parameters "
                             f"{sorted(names)}")
        for what in ("depth", "pool"):
            value = getattr(self, what)
            if value and value not in names:
                raise ValueError(f"{entry.what}: {what}={value!r} is not one of its parameters {sorted(names)}")
        if self.prepare is not None and not callable(self.prepare):
            raise ValueError(f"{entry.what}: prepare must be callable, got {self.prepare!r}")
        if (self.whole_up_to > 0) != (self.pool_above > 0) or (self.pool_above and not self.pool):
            raise ValueError(f"{entry.what}: whole_up_to and pool_above go together, with a pool parameter")

    def listing_lines(self) -> list[str]:
        lines = ["offline part: computed once per index, strategy and mode, cached"
                 + (" (`index graph --rerank` builds it ahead)" if self.prepare else "")] if self.offline else []
        if self.pool_above and self.whole_up_to >= WHOLE_GALLERY:
            lines.append(f"{self.pool} = auto: every item, and the plain search's top {self.pool_above:,} on a gallery "
                         f"read by row")
        elif self.pool_above:
            lines.append(f"{self.pool} = auto: every item up to {self.whole_up_to:,} items, the plain search's top "
                         f"{self.pool_above:,} above" + (" and on a gallery read by row" if self.by_row else ""))
        if self.by_row:
            unless = ", ".join(f"{k}={'/'.join(map(str, v))}" for k, v in self.whole_when.items())
            lines.append("reads by row: on a Milvus collection it fetches only the rows a query touches (no copy)"
                         + (f", except with {unless}" if unless else ""))
        if self.grid:
            lines.append("grid (`index evaluate --rerankers` chooses on validation): " + ", ".join(
                f"{k} ∈ {{{', '.join(f'{v:g}' if isinstance(v, float) else str(v) for v in vs)}}}"
                for k, vs in self.grid.items()))
        return lines


RERANKERS = Registry("re-ranker", spec=RerankerSpec)
DEFAULT = "none"
# the default of a candidate-pool parameter (`RerankerSpec.pool`): every gallery item, as the
# papers' code ranks them (a pool is clipped to the gallery, like every size)
WHOLE_GALLERY = 1_000_000_000
# a candidate pool that depends on the gallery's size (`RerankerSpec.whole_up_to`, `pool_above`):
# the whole gallery where the paper's default is affordable, the variant the field uses at scale above
AUTO = WHOLE_GALLERY + 1
# the size limit a server should hold requests to (`check_size_limit`), the search's own cap on k:
# above every default and every value of the re-rankers' sweep grids
SIZE_LIMIT = 200


def reads_by_row(name: str, params=None) -> bool:
    """Whether re-ranker `name` with these parameters reads only the rows a query touches
    (`RerankerSpec.by_row`, unless a parameter asks for its whole-gallery computation)."""
    spec = RERANKERS.get(name).spec
    if not spec.by_row:
        return False
    p = reranker_params(name, params)
    return not any(getattr(p, k) in values for k, values in spec.whole_when.items())


def reranker_params(name: str, given=None):
    """The re-ranker's typed parameters from a dict, `key=value` strings or a parameter object."""
    if dataclasses.is_dataclass(given) and not isinstance(given, type):
        if not isinstance(given, RERANKERS.get(name).params):
            raise UserError(f"re-ranker {name!r} takes {RERANKERS.get(name).params.__name__}, "
                            f"not {type(given).__name__}")
        return given
    return RERANKERS.params(name, given or {})


def size_params(name: str) -> list[str]:
    """The re-ranker's parameters that are sizes (declared `param(..., size=True)`): counts of gallery
    items it reads or holds for each query or each item, so its work grows with them.  A size
    above the gallery means the whole gallery (`clipped`)."""
    return [f.name for f in dataclasses.fields(RERANKERS.get(name).params) if f.metadata.get("size")]


def gallery_counts(name: str) -> list[str]:
    """Every parameter that counts gallery items: its sizes and its candidate pool (`RerankerSpec.pool`)."""
    pool = RERANKERS.get(name).spec.pool
    return size_params(name) + ([pool] if pool and pool not in size_params(name) else [])


def resolved(name: str, params, n: int, whole: bool = True):
    """The parameters with an `auto` candidate pool (AUTO) made the size it means in a gallery of
    `n` items: every item up to the re-ranker's `whole_up_to`, its `pool_above` beyond, and in a
    gallery read by row (`whole` False: no process holds it whole) its `pool_above` at any size."""
    p = reranker_params(name, params)
    spec = RERANKERS.get(name).spec
    if not spec.pool or int(getattr(p, spec.pool)) != AUTO:
        return p
    return dataclasses.replace(p, **{spec.pool: WHOLE_GALLERY if whole and n <= spec.whole_up_to
                                     else spec.pool_above})


def clipped(name: str, params, n: int, whole: bool = True):
    """The parameters with an `auto` pool resolved at the gallery size `n` (`resolved`) and every
    count of gallery items above `n` set to `n` (they mean the same there: the whole gallery), so
    that no re-ranker loops or allocates by a larger number than the gallery holds."""
    p = resolved(name, params, n, whole)
    over = {f: max(1, int(n)) for f in gallery_counts(name) if int(getattr(p, f)) > n}
    return dataclasses.replace(p, **over) if over else p


def check_size_limit(name: str, params, limit: int) -> None:
    """Refuse a size parameter above `limit` (a server's bound on one request's work), naming it.
    A candidate pool (`RerankerSpec.pool`) is not held to it: a pool cuts the ranking to the plain
    search's top candidates, and no pool costs more than the default, the whole gallery."""
    p = reranker_params(name, params)
    for s in size_params(name):
        v = int(getattr(p, s))
        if v > limit:
            raise UserError(f"re-ranker {name!r}: {s} must be ≤ {limit} (this server's limit), got {v}")


def first_depth(name: str, params, k: int, n: int | None = None) -> int:
    """How many first-search candidates the re-ranker reads for a top-k answer in a gallery of
    `n` items: its depth, and a candidate pool smaller than the gallery (a pool cut to the plain
    search's top candidates is read from that search; `params` as `clipped` gives them)."""
    spec = RERANKERS.get(name).spec
    depth = max(int(k), int(getattr(params, spec.depth)) if spec.depth else 0)
    if spec.reads_first and spec.pool and n is not None and int(getattr(params, spec.pool)) < n:
        depth = max(depth, int(getattr(params, spec.pool)))
    return depth


def ranked_pool(name: str, params, k: int, n: int) -> int | None:
    """How many items a top-k answer of re-ranker `name` ranks at most in a gallery of `n` items
    (its candidate pool, at least k); None when it ranks the whole gallery."""
    p = RERANKERS.get(name).spec.pool
    return max(int(k), int(getattr(resolved(name, params, n), p))) if p else None


def candidates(first: Hits, self_ids: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """The first search's rows and scores, each query's own row left out, cut to `depth`."""
    return drop_rows(first.rows, first.scores, self_ids, depth)


def rerank(name: str, space: MetricSpace, queries: np.ndarray, k: int = 10, *, params=None, self_ids=None,
           first: Hits | None = None) -> Hits:
    """Search `queries` in `space` and re-rank with re-ranker `name`: the top min(k, n) per query.
    `first`: the plain search's answer when the caller has it already (deep enough: at least
    `first_depth` rows, one more where it may hold the query's own row); otherwise it is
    searched here."""
    if k < 1:
        raise UserError(f"k must be ≥ 1, got {k}")
    entry = RERANKERS.get(name)
    p = clipped(name, reranker_params(name, params), space.n, whole=space.holds_gallery)
    q = space.prepare(queries)
    ids = as_rows(self_ids, len(q), space.n)
    k = max(1, min(int(k), space.n - int((ids >= 0).any())))
    depth = min(first_depth(name, p, k, space.n), space.n)
    # a first search given by the caller may still hold the query's own row: one more then
    if not entry.spec.reads_first:
        first = None
    elif first is None or first.k < min(depth + int((ids >= 0).any()), space.n):
        first = space.search(q, depth, exclude=ids)
    return entry.builder(space, q, first, k, self_ids=ids, params=p)
