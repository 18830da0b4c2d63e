"""What k-reciprocal re-ranking keeps in the metric-space layer's memory cache beyond the
offline sets: the gallery's whole similarity matrix while it is small (a lookup for the pairs
the lists miss), and the latest calls' d_J and d, so that calls differing in λ alone rank them
again.  Both are sized as fractions of the one memory budget (`--cache-memory`)."""
from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

from ...space import MetricSpace, memory_budget

PAIR_SHARE = 32   # the similarity matrix is kept while it takes at most 1/32 of the budget (4 GiB: 128 MB)
TERMS_SHARE = 64  # one call's d_J and d are kept while they take at most 1/64 of it (4 GiB: 64 MB)


def gallery_similarities(space: MetricSpace) -> np.ndarray | None:
    """s(x, y) for every pair of gallery rows (n × n float32), kept in the space's memory while it
    fits its share of the budget: the pairs missing from the cached lists (members that an
    expansion brings in) are then a lookup, not a gather of d-dimensional keys.  None above it."""
    if space.n * space.n * 4 > memory_budget() // PAIR_SHARE:
        return None

    def build():
        S = np.empty((space.n, space.n), dtype=np.float32)
        for a in range(0, space.n, 2048):
            rows = np.arange(a, min(a + 2048, space.n))
            S[rows] = space.score(space.gallery_vectors(rows))
        return {"S": S}
    return space.artefact("kreciprocal-pairs", None, build, disk=False)["S"]


def digest(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a)
    return hashlib.blake2b(a.data.cast("B"), digest_size=16).hexdigest() + str((a.dtype.str, a.shape))


def remembered_terms(space: MetricSpace, call: dict, compute: Callable[[], dict], inputs: tuple[str, ...]) -> dict:
    """The terms (d_J and d per batch: {start: (pools, d_J, d)}) of a call identified by `call`
    (every parameter but λ, the queries' and self_ids' digests) and by the digests of the
    offline artefacts it reads (`inputs`): computed by `compute()` once however many threads
    ask, and kept while within TERMS_SHARE of the budget."""
    return space.artefact("kreciprocal-terms", call, compute, inputs=inputs, disk=False,
                          max_bytes=memory_budget() // TERMS_SHARE)
