"""No re-ranking: the plain search's answer."""
from __future__ import annotations

from .registry import RERANKERS, candidates


@RERANKERS.register("none")
def none(space, queries, first, k, *, self_ids, params):
    """The plain search's ranking and scores, unchanged (the default)."""
    if (self_ids >= 0).any():  # a first search that still holds the query's own row
        return space.hits(*candidates(first, self_ids, k))
    if first.k == k:
        return first  # the same object: bit-identical to the plain search
    return space.hits(first.rows[:, :k], first.scores[:, :k])
