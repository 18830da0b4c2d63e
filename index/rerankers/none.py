"""No re-ranking: the plain search's answer."""
from __future__ import annotations

import numpy as np

from core.registry import NoParams

from ..space import Hits, MetricSpace
from .registry import RERANKERS, candidates


@RERANKERS.register("none", by_row=True)
def none(space: MetricSpace, queries: np.ndarray, first: Hits | None, k: int, *, self_ids: np.ndarray,
         params: NoParams) -> Hits:
    """The plain search's ranking and scores, unchanged (the default)."""
    assert first is not None  # registered with reads_first
    if (self_ids >= 0).any():  # a first search that still holds the query's own row
        return space.hits(*candidates(first, self_ids, k))
    if first.k == k and first.items is not None:
        return first  # the same object: bit-identical to the plain search
    return space.hits(first.rows[:, :k], first.scores[:, :k])
