"""The one thing a re-ranker sees: a `MetricSpace`, a gallery searched under one strategy's M′
in one mode, with the state kept for it (its artefacts, built once, in the layer's cache).

Every score is s(v, x) = t(v) · key(x):
  bilinear  t(v) = M′v               key(x) = φ(x)               s = vᵀM′φ(x)
  cosine    t(v) = M′v / ‖v‖_M′      key(x) = φ(x) / ‖φ(x)‖_M′   s = cosine under M′
so a re-ranker that averages vectors (query expansion, database-side augmentation) averages
keys, the vectors the similarity is an inner product of; in cosine mode these are M′-unit, as
the papers' L2-normalised descriptors are unit under M′ = I.  A key is also a valid query:
s(key(x), ·) = s(x, ·) (t is scale-invariant in cosine mode).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

from core.errors import UserError

from .hits import Hits


@runtime_checkable
class MetricSpace(Protocol):
    """A gallery under one (strategy, params, mode).  Rows (positions 0…n−1) name its items;
    −1 is "no item" wherever rows are passed or returned."""

    @property
    def n(self) -> int:
        """The number of gallery items."""

    @property
    def dim(self) -> int:
        """d: the dimension of queries and keys."""

    @property
    def mode(self) -> str:
        """"bilinear" or "cosine"."""

    @property
    def holds_gallery(self) -> bool:
        """Whether this process may hold arrays of the gallery's size for it (False: a gallery an
        engine keeps, read by row; passes over every item are refused there)."""

    @property
    def cache_key(self) -> str:
        """A hash of (index content fingerprint, strategy key with its parameters, mode): the
        offline caches of this space are stored under it."""

    def digest(self, name: str, params: dict | None = None, inputs: tuple[str, ...] = ()) -> str:
        """The identity of artefact `name`: a hash of this space's `cache_key`, the name, its
        parameters and the digests of the artefacts it is computed from (`inputs`).  A value built
        from other inputs has another digest, so it is never read in their place."""

    def artefact(self, name: str, params: dict | None, build: Callable[[], Any], *, inputs: tuple[str, ...] = (),
                 disk: bool = True, max_bytes: int | None = None, reserve: int = 0) -> Any:
        """This space's artefact `name` under `params`, computed from the artefacts whose digests
        are `inputs`, kept under its `digest`: `build()` runs once however many threads ask at once
        (the others wait for it); the result is kept in the process's memory cache
        (core/memory.py: one budget, least recently used evicted first; not kept above
        `max_bytes`) and, where `disk`, in the offline store across processes (a dict of arrays).
        `reserve`: its size where known beforehand, counted against the budget while it is built."""

    def artefact_in_blocks(self, name: str, params: dict | None, columns: dict[str, tuple[int, str]],
                           fill: Callable[[int, int], dict[str, np.ndarray]], *, inputs: tuple[str, ...] = (),
                           block: int = 2048, progress: bool = False, searched: str = "") -> dict[str, np.ndarray]:
        """An artefact of one row per gallery item, `columns` {array: (width, dtype)}, built a
        block of rows at a time by `fill(start, stop)` into memory-mapped files that a build cut
        short (a crash, Ctrl-C) resumes from the last block written, and read memory-mapped (the
        page cache holds it, not the process: it takes none of the memory budget), under its
        digest as `artefact` names one.  `progress`: a bar with an ETA.  `searched`: a column of
        vectors searched by inner product (an engine indexes it; an array is searched as it is)."""

    def held(self, name: str, params: dict | None = None) -> bool:
        """Whether the artefact (without inputs) is in the memory cache now (nothing is built)."""

    def prepare(self, queries: np.ndarray) -> np.ndarray:
        """Query features as the plain search takes them (validated, float32, L2-normalised
        where the index is)."""

    def key(self, v: np.ndarray) -> np.ndarray:
        """Rows v ↦ key(v) (bilinear: v; cosine: v/‖v‖_M′)."""

    def normalise(self, v: np.ndarray) -> np.ndarray:
        """The normalisation the mode gives a vector: cosine v/‖v‖_M′; bilinear as the index
        treats its features (L2 where it normalises them, else none)."""

    def transform(self, v: np.ndarray) -> np.ndarray:
        """Rows v ↦ t(v), so that s(v, x) = t(v) · key(x)."""

    def gallery_vectors(self, rows: np.ndarray) -> np.ndarray:
        """key(φ(x)) of the given rows, float32: usable as queries and summable as keys."""

    def search(self, v: np.ndarray, k: int, exclude: np.ndarray | None = None) -> Hits:
        """The top min(k, n) rows per query v under s, best first; `exclude[i]` (a row, −1 none)
        is left out of query i's list."""

    def item_neighbours(self, rows: np.ndarray, L: int) -> tuple[np.ndarray, np.ndarray]:
        """The top min(L, n) items of each given gallery row (itself included, where its own score
        puts it), as the neighbour-list pass stores them: (int32 rows, float32 exact scores), best
        first.  An array is searched exactly; an engine's gallery through its own index, without
        the hits' metadata."""

    def score(self, v: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """Exact s(v, x): rows None → every item (n_q × n); 1-D → those for every query;
        2-D (n_q × m) → per query (−inf where a row is −1)."""

    def score_blocks(self, v: np.ndarray, width: int | None = None) -> Iterator[tuple[int, int, np.ndarray]]:
        """`score(v)` a block of consecutive rows at a time: (start, stop, n_q × (stop − start)
        scores) covering the gallery in order, `width` rows each (None: the space's own block),
        so that a pass over every item holds one block of scores, not n_q × n."""

    def factor(self) -> np.ndarray | None:
        """F (d × r, float32) with s(key(a), key(b)) = (Fᵀ key(a)) · (Fᵀ key(b)) for every pair of
        keys: M′ = F Fᵀ, so that a symmetric inner-product index over Fᵀ key(x) ranks by s; None
        where M′ is indefinite (no such F)."""

    def hits(self, rows: np.ndarray, scores: np.ndarray) -> Hits:
        """A `Hits` with the gallery's item metadata."""


def as_rows(self_ids, n_queries: int, n: int) -> np.ndarray:
    """self_ids as an int64 array of one gallery row per query (−1: the query is not an item)."""
    if self_ids is None:
        return np.full(n_queries, -1, dtype=np.int64)
    a = np.atleast_1d(np.asarray(self_ids, dtype=np.int64))
    if a.shape != (n_queries,):
        raise UserError(f"self_ids must give one row per query ({n_queries}), got shape {a.shape}")
    if ((a < -1) | (a >= n)).any():
        raise UserError(f"self_ids must be gallery rows in [0, {n}) or −1")
    return a


def drop_rows(rows: np.ndarray, scores: np.ndarray, exclude: np.ndarray, k: int):
    """Each query's list without its excluded row, order kept, cut to k (padded −1 / −inf)."""
    mask = (rows == exclude[:, None]) | (rows < 0)
    rows = np.where(mask, -1, rows)
    scores = np.where(mask, -np.inf, scores).astype(np.float32)
    order = np.argsort(mask, axis=1, kind="stable")[:, :k]  # kept entries first, in their order
    out_r, out_s = np.take_along_axis(rows, order, 1), np.take_along_axis(scores, order, 1)
    if out_r.shape[1] < k:
        pad = k - out_r.shape[1]
        out_r = np.pad(out_r, ((0, 0), (0, pad)), constant_values=-1)
        out_s = np.pad(out_s, ((0, 0), (0, pad)), constant_values=-np.inf)
    return out_r, out_s


