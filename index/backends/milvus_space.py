"""A Milvus gallery as a re-ranker reads it, by row: `MilvusSpace`, the `MetricSpace` whose
searches are the collection's own, whose vectors and item metadata are fetched by row for the
items a query touches (the process's memory cache keeps the recent rows, within
`--cache-memory`), and whose per-item artefacts (the neighbour lists) live in collections
beside the gallery's (`EngineTable`), built through its search a block of items at a time and
read by row.  No array of the gallery's size is held in
the process: what a query costs is bounded by the re-ranker's parameters, not by N.

Every re-ranker at its defaults runs here (registered `by_row`): none, αQE, αDBA (its augmented
gallery a collection of its own, searched there), k-reciprocal within each query's pool, and
diffusion on each query's cut graph.  k-reciprocal's whole-gallery sets (`sets=gallery`) read
the gallery whole, from the copy `MilvusGallery.metric_space` makes.  The layout and the
measurements: docs/scale-out.md ("Milvus").
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm import tqdm

from core.arrays import l2_normalize
from core.errors import UserError
from core.memory import CACHE

from ..metric import psd_factor
from ..refinements import strategy_key
from ..space import Hits, as_rows, key_hash
from . import milvus_found
from .gallery import refined_metric
from .store import Items

if TYPE_CHECKING:
    from .milvus_store import MilvusGallery  # noqa: F401  (the annotations' name)

BLOCK = 1024            # items per block of an artefact built in the engine (one insert each)
SEARCH_CELLS = 1 << 16  # queries × candidates asked of the collection at once (re-scored ones come with
# their vectors: a 64 MiB gRPC message holds about 10⁵ of 128-d)
ITEMS_UP_TO = 1024      # a re-scored list this long or shorter comes with its items' metadata
# the offline list pass searches LIST_WIDTH × L candidates wide (HNSW's ef) for each item's top L
LIST_WIDTH = 6
ARRAY_MAX = 4096        # Milvus's largest ARRAY capacity (max_capacity)
WINDOW = 16384          # Milvus's largest result window: one query's rows at most
ARTEFACT = "dml.artefact"  # the property naming what an artefact collection holds, and whether it is whole
PART_POLL_S = 5.0       # how often a part that is done looks whether the others are
PART_WAIT_S: float | None = None  # how long it waits for them (None: as long as they take)
CREATOR_MARK_S = 30.0   # how long a builder that found the collection just made waits for its maker's first mark
# (i, n): this process builds part i of n of every artefact it builds in the engine (`building_part`)
_PART: contextvars.ContextVar[tuple[int, int]] = contextvars.ContextVar("engine_build_part", default=(0, 1))


def check_part(i: int, n: int) -> None:
    """Refuse a part I/N outside 0 ≤ I < N, in one line."""
    if not (n >= 1 and 0 <= i < n):
        raise UserError(f"--part wants I/N with 0 ≤ I < N, got {i}/{n}")


@contextlib.contextmanager
def building_part(i: int, n: int) -> Iterator[None]:
    """Within this block, an artefact built in the engine is built by n processes together (on one
    machine or many, each with its own i): this one stores the rows of its i-th n-th of the blocks,
    records how far it got under its own property, and waits until every part is stored; then the
    last part (n − 1) seals the collection (flush, index, load, marked whole) while the others wait
    for that, and each goes on to the next artefact.  A part cut short resumes from its last block."""
    check_part(i, n)
    token = _PART.set((int(i), int(n)))
    try:
        yield
    finally:
        _PART.reset(token)


def set_properties(client, collection: str, properties: dict[str, str]) -> None:
    """Write a collection's properties so that they survive a server restart.  Milvus 2.3.5 (the
    `milvus` package's server) reloads each collection with the properties it had before its last
    alter (milvus-io/milvus#30144, fixed in 2.3.6): the same alter a second time makes the first
    one the one reloaded.  On a fixed server the second is a no-op."""
    for _ in range(2):
        client.alter_collection_properties(collection, properties=properties)


def artefacts_of(client, collection: str) -> list[str]:
    """The artefact collections built beside gallery `collection` (`NAME__…` whose `dml.artefact`
    names it as their gallery): what replacing the gallery leaves stale.  A collection whose name
    merely starts so, without that property, is another's and is not listed."""
    out = []
    for c in client.list_collections():
        if not c.startswith(f"{collection}__"):
            continue
        props = client.describe_collection(c).get("properties", {})
        try:
            owner = json.loads(props[ARTEFACT]).get("gallery") if ARTEFACT in props else None
        except (ValueError, AttributeError):
            owner = None
        if owner == collection:
            out.append(c)
    return sorted(out)


class EngineColumn:
    """One column of an `EngineTable` as a read-only n × width array: `col[rows]` (an int array)
    fetches those rows, `col[:, :w]` narrows it; a whole read (as an array) is refused."""

    def __init__(self, table: EngineTable, name: str, width: int):
        self.table, self.name, self.width = table, name, width

    @property
    def shape(self) -> tuple[int, int]:
        return self.table.n, self.width

    @property
    def ndim(self) -> int:
        return 2

    def __len__(self) -> int:
        return self.table.n

    def __getitem__(self, key):
        if (isinstance(key, tuple) and len(key) == 2 and key[0] == slice(None) and isinstance(key[1], slice)
                and key[1].start in (None, 0) and key[1].step in (None, 1)):
            w = self.width if key[1].stop is None else min(self.width, int(key[1].stop))
            return EngineColumn(self.table, self.name, w)
        if isinstance(key, slice) or isinstance(key, tuple):
            raise UserError(f"the engine's {self.table.what} are read by row (an array of rows), not by {key!r}")
        rows = np.asarray(key, dtype=np.int64)
        return self.table.take(rows.reshape(-1))[self.name][:, : self.width].reshape(*rows.shape, self.width)

    def __array__(self, dtype=None, copy=None):
        raise UserError(f"the engine's {self.table.what} are read by row, not the whole gallery's at once")

    def nearest(self, t: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The engine's top-k rows of this vector column by inner product with each row of `t`:
        (scores, rows), −inf and −1 where it has fewer (as faiss.knn returns them)."""
        return self.table.nearest(self.name, t, k)

    def holding(self, value: int) -> np.ndarray:
        """The rows whose list in this column holds `value`, found by the engine (sorted)."""
        return self.table.holding(self.name, value)


class EngineTable:
    """A per-item artefact (`columns` {name: (width, dtype)}) in its own collection: one entity per
    gallery row, each column an ARRAY field (Milvus asks for a vector field too: a 2-d zero,
    never searched).  Built by `fill(start, stop)` a block at a time (inserts: a build cut short
    deletes what it stored past the last block it recorded, and resumes there),
    marked whole last (`dml.artefact`: its digest, columns and row count); read by row, the
    recent rows kept in the memory cache (`CACHE.rows_get`, within the one budget).  A
    `searched` column is a vector field instead, indexed as the gallery's vectors are and searched
    by inner product (`nearest`)."""

    def __init__(self, gallery: MilvusGallery, name: str, digest: str, columns: dict[str, tuple[int, str]],
                 what: str, searched: str = ""):
        if searched and searched not in columns:
            raise ValueError(f"searched column {searched!r} is not one of {sorted(columns)}")
        wide = [(c, w) for c, (w, _) in columns.items() if c != searched and w > ARRAY_MAX]
        if wide:  # refused before anything is written
            raise UserError(f"Milvus keeps at most {ARRAY_MAX:,} entries in an ARRAY field: {what} of "
                            f"{wide[0][1]:,} a row cannot be stored there (give a length ≤ {ARRAY_MAX:,})")
        self.gallery, self.digest, self.columns, self.what = gallery, digest, dict(columns), what
        self.searched = searched
        self.collection = f"{gallery.collection}__{name.replace('-', '_')}_{digest[:16]}"
        self.n = len(gallery)
        self._rows_key = ("milvus-rows", gallery.uri, self.collection)  # its rows in the memory cache
        self.lock = threading.Lock()
        self.whole = False  # known to hold every row (found so, or built here)

    # ------------------------------------------------------------ identity
    def _facts(self) -> dict:
        return {"digest": self.digest, "gallery": self.gallery.collection, "content": self.gallery.content_key,
                "n": self.n, "columns": {k: [w, t] for k, (w, t) in self.columns.items()}, "searched": self.searched}

    def _state(self) -> dict | None:
        """What the collection says it holds (None: no such collection); refused when it is not ours."""
        client = self.gallery.client
        if not client.has_collection(self.collection):
            return None
        props = self._props()
        if ARTEFACT not in props:  # made, and the build cut short before its first mark: nothing stored
            return self._facts() | {"whole": False, "done": 0}
        got = json.loads(props[ARTEFACT])
        if {k: got.get(k) for k in self._facts()} != self._facts():
            raise UserError(f"Milvus collection {self.collection!r} holds another artefact than this gallery's "
                            f"{self.what} (drop it, or export the gallery under another name)")
        return got

    def _mark(self, **state) -> dict:
        """Record the build's state in the collection's properties; returns it."""
        state = self._facts() | state
        set_properties(self.gallery.client, self.collection, {ARTEFACT: json.dumps(state)})
        return state

    # ------------------------------------------------------------ build
    def _schema(self):
        pm = self.gallery.pm
        s = pm.MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        s.add_field("row", pm.DataType.INT64, is_primary=True)
        if not self.searched:
            s.add_field("_v", pm.DataType.FLOAT_VECTOR, dim=2)
        for col, (width, dtype) in self.columns.items():
            if col == self.searched:
                s.add_field(col, pm.DataType.FLOAT_VECTOR, dim=width)
                continue
            element = pm.DataType.INT64 if np.dtype(dtype).kind in "iu" else pm.DataType.FLOAT
            s.add_field(col, pm.DataType.ARRAY, element_type=element, max_capacity=max(1, width))
        return s

    def _part_key(self, i: int, n: int) -> str:
        return f"{ARTEFACT}.part.{i}.{n}"

    def _part_range(self, i: int, n: int) -> tuple[int, int]:
        """Part i of n: blocks [lo, hi) of the artefact's ⌈N / BLOCK⌉."""
        blocks = -(-self.n // BLOCK)
        return blocks * i // n, blocks * (i + 1) // n

    def _props(self) -> dict:
        return self.gallery.client.describe_collection(self.collection).get("properties", {})

    def _parts_next(self, n: int, epoch: int, props: dict | None = None) -> dict[int, int]:
        """Each of the n parts' next block to store under layout `epoch` (its first where it has
        recorded none: a part's record from another layout is not its progress in this one)."""
        props = self._props() if props is None else props
        out = {}
        for i in range(n):
            got = json.loads(props.get(self._part_key(i, n), "{}"))
            ok = got.get("epoch") == epoch and "next" in got
            out[i] = int(got["next"]) if ok else self._part_range(i, n)[0]
        return out

    def _layout(self, props: dict) -> tuple[int, int, bool]:
        """(parts, epoch, whole) as the collection's mark records them."""
        got = json.loads(props[ARTEFACT]) if ARTEFACT in props else {}
        return int(got.get("parts", 1)), int(got.get("epoch", 0)), bool(got.get("whole"))

    def build(self, fill: Callable[[int, int], dict[str, np.ndarray]], progress: bool = False) -> EngineTable:
        """Every row's values, from `fill`, stored unless the collection holds them whole already;
        within `building_part(i, n)`, the rows of part i alone, then waiting for the other parts.

        The mark records the layout the progress was recorded under: `parts` (1: one process, its
        progress `done`; N: each part's under its own property) and an `epoch`, raised whenever a
        build comes with another layout than the recorded one.  Such a build starts over (its
        range's rows deleted first): progress recorded under one layout never counts in another."""
        pm, client = self.gallery.pm, self.gallery.client
        part, parts = _PART.get()
        try:
            state = self._state()
            if state is None:
                ip = client.prepare_index_params()
                if self.searched:  # indexed as the gallery's vectors are (its type and build parameters)
                    idx = client.describe_index(self.gallery.collection, "vector")
                    ip.add_index(self.searched, index_type=idx.get("index_type", "FLAT"), metric_type="IP",
                                 params=self.gallery.index_build_params())
                else:
                    ip.add_index("_v", index_type="FLAT", metric_type="IP")
                try:
                    client.create_collection(self.collection, schema=self._schema(), index_params=ip)
                    fresh = True
                except pm.exceptions.MilvusException:
                    if not client.has_collection(self.collection):  # not another builder's, made first
                        raise
                    fresh = False
                # only its creator marks it new: a builder that lost the race to create it reads
                # what the others have recorded (and may have sealed), once the creator's mark is there
                if fresh:
                    state = self._mark(whole=False, done=0, parts=parts, epoch=0)
            else:
                fresh = False
            if not fresh and ARTEFACT not in self._props():  # made by another just now: its mark comes next
                since = time.monotonic()
                while ARTEFACT not in self._props() and time.monotonic() - since < CREATOR_MARK_S:
                    time.sleep(0.05)
                state = self._state()
            assert state is not None
            if state.get("whole"):
                client.load_collection(self.collection)  # as the gallery is (a restarted server releases it)
                self.whole = True
                return self
            recorded, epoch = int(state.get("parts", 1)), int(state.get("epoch", 0))
            if recorded != parts:  # another layout's progress: start over under a new epoch
                epoch += 1
                state = self._mark(whole=False, done=0, parts=parts, epoch=epoch)
            # the blocks are inserted in order, and the rows stored so far recorded after each (in the
            # collection's properties, which every reader sees at once): a build cut short goes on from
            # there, first deleting what it stored past that mark (a block it had begun).  Inserts, not
            # upserts: an upsert deletes its rows first, and a server applies every delete to every
            # segment, so a pass of upserts slows as the collection grows (at 10⁶ items, 1.5 s a block
            # became 3.7 s halfway)
            starts = range(0, self.n, BLOCK)
            lo, hi = self._part_range(part, parts)
            if parts == 1:
                done = min(int(state.get("done", 0)) // BLOCK, len(starts))
            else:  # each part records its own progress: parts never write one another's property
                done = min(max(lo, self._parts_next(parts, epoch)[part]), hi)
            if not fresh and done < hi:
                upto = f" and row < {starts[hi]}" if hi < len(starts) else ""
                client.load_collection(self.collection)  # a server deletes by filter from a loaded collection
                client.delete(self.collection, filter=f"row >= {starts[done]}{upto}")
            label = f"{self.what} in {self.collection}" + (f" (part {part}/{parts})" if parts > 1 else "")
            with tqdm(total=hi - lo, initial=done - lo, desc=label, unit="block", disable=not progress) as bar:
                for j in range(done, hi):
                    a = starts[j]
                    b = min(a + BLOCK, self.n)
                    got = fill(a, b)
                    dummy = {} if self.searched else {"_v": [0.0, 0.0]}
                    client.insert(self.collection, [
                        {"row": r, **dummy, **{c: got[c][r - a].tolist() for c in self.columns}}
                        for r in range(a, b)])
                    if parts == 1:
                        self._mark(whole=False, done=b, parts=1, epoch=epoch)
                    else:
                        self._mark_part(part, parts, epoch, j + 1)
                    bar.update(1)
            if parts > 1 and not self._await_parts(part, parts, epoch, progress):
                client.load_collection(self.collection)  # sealed by the last part
                self.whole = True
                return self
            client.flush(self.collection)
            if self.searched:  # searched at once: not over rows the server has yet to index
                self.gallery.wait_indexed(self.collection, self.searched, progress)
            client.load_collection(self.collection)
            self._mark(whole=True, done=self.n, parts=parts, epoch=epoch)
            self.whole = True
        except pm.exceptions.MilvusException as e:
            raise UserError(f"building {self.what} in Milvus collection {self.collection!r} failed: "
                            f"{e.message}") from None
        return self

    def _mark_part(self, part: int, parts: int, epoch: int, nxt: int) -> None:
        set_properties(self.gallery.client, self.collection,
                       {self._part_key(part, parts): json.dumps({"next": nxt, "epoch": epoch})})

    def _await_parts(self, part: int, parts: int, epoch: int, progress: bool) -> bool:
        """Wait until every part is stored.  The last part (N − 1, whose range is never empty)
        seals the collection (True); the others wait for its seal (False)."""
        since, hi = time.monotonic(), self._part_range(part, parts)[1]
        with tqdm(total=parts, desc=f"parts of {self.what} stored", unit="part", disable=not progress) as bar:
            while True:
                props = self._props()
                layout = self._layout(props)
                if layout[2]:
                    return False
                if layout[:2] != (parts, epoch):
                    raise UserError(f"another build of {self.what} in {self.collection!r} started meanwhile "
                                    f"(--part …/{layout[0]}): run every part of one layout, then this one again")
                nxt = self._parts_next(parts, epoch, props)
                if nxt[part] < hi:  # our own record lost to a concurrent write: written again
                    self._mark_part(part, parts, epoch, hi)
                    nxt[part] = hi
                stored = sum(nxt[i] >= self._part_range(i, parts)[1] for i in range(parts))
                bar.update(stored - bar.n)
                if stored == parts and part == parts - 1:
                    return True
                if PART_WAIT_S is not None and time.monotonic() - since > PART_WAIT_S:
                    where = f"{self.what} in {self.collection!r}"
                    if stored < parts:
                        raise UserError(f"{parts - stored} of the {parts} parts of {where} were not stored within "
                                        f"{PART_WAIT_S:g} s: run them, then this part again")
                    raise UserError(f"every part of {where} is stored, but the last part ({parts - 1}), which seals "
                                    f"them, did not within {PART_WAIT_S:g} s: run it again")
                time.sleep(PART_POLL_S)

    # ------------------------------------------------------------ read
    def nearest(self, column: str, t: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The top-k rows by inner product with each row of `t` in the searched column (scores, rows)."""
        if column != self.searched:
            raise ValueError(f"column {column!r} of {self.collection!r} is not searched")
        k = max(1, min(int(k), self.n))
        width = self.gallery.search_width(max(k, self.gallery.rerank_factor * k))
        rows, scores = self.gallery.top_rows(t, k, width, self.collection, column, SEARCH_CELLS)
        return scores, rows

    def holding(self, column: str, value: int) -> np.ndarray:
        """The rows whose `column` list holds `value` (the engine scans for them: no index needed)."""
        try:
            got = milvus_found.query(self.gallery.client, self.collection, f"array_contains({column}, {int(value)})",
                                     ["row"], WINDOW)["row"]
        except self.gallery.pm.exceptions.MilvusException as e:
            raise UserError(f"Milvus query in {self.collection!r} failed: {e.message}") from None
        if len(got) >= WINDOW:
            raise UserError(f"{WINDOW:,} or more rows of {self.collection!r} hold row {value}: more than one "
                            f"query returns")
        return np.sort(np.asarray(got, dtype=np.int64))

    def take(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """{column: len(rows) × width} of the given rows (any order, repeats allowed)."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.n):
            raise IndexError(f"row out of range for a gallery of {self.n}")
        uniq, back = np.unique(rows, return_inverse=True)

        def fetch(missing: np.ndarray) -> list:
            got = self.gallery.query_rows(missing, list(self.columns), collection=self.collection)
            return [tuple(np.asarray(got[c][i], dtype=t) for c, (_, t) in self.columns.items())
                    for i in range(len(missing))]
        values = CACHE.rows_through(self._rows_key, uniq, fetch)  # kept: a query reads the same rows again
        out = {}
        for j, (c, (w, t)) in enumerate(self.columns.items()):
            block = np.stack([v[j] for v in values]) if values else np.zeros((0, w), dtype=t)
            out[c] = block[back.reshape(-1)]
        return out


    def read(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """{column: (stop − start) × width} of rows start…stop − 1, in order, past the memory cache
        (an offline pass reading every row once)."""
        got = self.gallery.query_rows(np.arange(start, stop, dtype=np.int64), list(self.columns),
                                      collection=self.collection)
        return {c: np.stack([np.asarray(v, dtype=t) for v in got[c]]) if stop > start else np.zeros((0, w), dtype=t)
                for c, (w, t) in self.columns.items()}


class MilvusSpace:
    """A `MetricSpace` (index/space/protocol.py) over a Milvus collection, read by row."""
    holds_gallery = False  # no N-sized array: whole-gallery passes are refused (re-rankers by_row only)

    def __init__(self, gallery: MilvusGallery, strategy: str = "trained", params: dict | None = None,
                 mode: str = "bilinear"):
        self.gallery = gallery
        self.strategy, self.params, self._mode = strategy, dict(params or {}), mode
        # raises UserError for cosine under an indefinite M′ (resolve the mode first, as for search)
        self.metric = gallery.strategy_metric(strategy, self.params, mode)
        self._rm = refined_metric(gallery.W, strategy, self.params, gallery.neck)
        name, items = strategy_key(strategy, self.params)
        self._cache_key = key_hash("milvus", gallery.uri, gallery.collection, gallery.content_key, gallery.neck,
                                   gallery.info.get("index_type"), gallery.nprobe, gallery.rerank_factor, LIST_WIDTH,
                                   [name, [[k, v] for k, v in items]], mode)
        self._vectors_key = ("milvus-vectors", self._cache_key)  # its keys' rows in the memory cache
        self._tables: dict[str, EngineTable] = {}
        self._tables_lock = threading.Lock()

    # ------------------------------------------------------------ identity
    @property
    def n(self) -> int:
        return len(self.gallery)

    @property
    def dim(self) -> int:
        return self.gallery.dim

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def cache_key(self) -> str:
        return self._cache_key

    def digest(self, name: str, params: dict | None = None, inputs: tuple[str, ...] = ()) -> str:
        return key_hash(self._cache_key, name, params or {}, list(inputs))

    # ------------------------------------------------------------ state
    def artefact(self, name: str, params: dict | None, build: Callable[[], Any], *, inputs: tuple[str, ...] = (),
                 disk: bool = True, max_bytes: int | None = None, reserve: int = 0) -> Any:
        # the process's memory cache only: what grows with N is an EngineTable's
        return CACHE.get_or_build(("milvus-space", self.digest(name, params, inputs)), build, max_bytes=max_bytes,
                                  reserve=reserve)

    def artefact_in_blocks(self, name: str, params: dict | None, columns: dict[str, tuple[int, str]],
                           fill: Callable[[int, int], dict[str, np.ndarray]], *, inputs: tuple[str, ...] = (),
                           block: int = 2048, progress: bool = False, searched: str = "") -> dict[str, Any]:
        digest = self.digest(name, params, inputs)
        with self._tables_lock:  # one table per artefact, built or found once
            table = self._tables.get(digest)
            if table is None:
                what = {"knn": "neighbour lists", "dba": "augmented gallery",
                        "diffusion-offline": "decoupled diffusion rows"}.get(name, name)
                table = self._tables[digest] = EngineTable(self.gallery, name, digest, columns, what, searched)
        with table.lock:  # built (or found whole) once, whoever asks first
            if not table.whole:
                table.build(fill, progress)
        return {c: EngineColumn(table, c, w) for c, (w, _) in columns.items()}

    def held(self, name: str, params: dict | None = None) -> bool:
        return CACHE.peek(("milvus-space", self.digest(name, params))) is not None

    # ------------------------------------------------------------ vectors
    def prepare(self, queries: np.ndarray) -> np.ndarray:
        return self.gallery.prepare_queries(queries)

    def key(self, v: np.ndarray) -> np.ndarray:
        v = np.asarray(v, dtype=np.float32)
        if self._mode == "bilinear":
            return v
        norms = self.metric.norms(v)
        assert norms is not None
        # as the in-RAM cosine index: an item of zero M′-norm scores 0
        return (v * np.where(norms > 0, 1.0 / np.maximum(norms, 1e-30), 0.0)[:, None]).astype(np.float32)

    def normalise(self, v: np.ndarray) -> np.ndarray:
        if self._mode == "cosine":
            return self.key(v)
        v = np.asarray(v, dtype=np.float32)
        return l2_normalize(v) if self.gallery.normalize else v

    def transform(self, v: np.ndarray) -> np.ndarray:
        return self.metric.transform(np.ascontiguousarray(v, dtype=np.float32))

    def gallery_vectors(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows, dtype=np.int64)
        flat = rows.reshape(-1)
        uniq, back = np.unique(flat, return_inverse=True)
        # each row a copy, not a view that would keep the whole fetched block alive
        values = CACHE.rows_through(self._vectors_key, uniq,
                                    lambda m: [row.copy() for row in self.key(self.gallery.fetch_rows(m))])
        out = np.stack(values) if values else np.zeros((0, self.dim), dtype=np.float32)
        return out[back.reshape(-1)].reshape(*rows.shape, self.dim)

    # ------------------------------------------------------------ search and scores
    def search(self, v: np.ndarray, k: int, exclude: np.ndarray | None = None) -> Hits:
        """The collection's own search under M′, a block of queries at a time, each query's
        excluded row left out.  Where Milvus's scores are exact (bilinear on FLAT, HNSW, IVF_FLAT)
        they are its answer (`MilvusGallery.search_metric`, with each hit's metadata); otherwise
        (cosine mode, quantised indexes) Milvus proposes the candidate rows and they are scored
        here from their vectors, fetched by row once for all the queries that meet them (the memory
        cache keeps them): a list longer than ITEMS_UP_TO comes without metadata (`hits` fetches it)."""
        v = np.ascontiguousarray(v, dtype=np.float32)
        k = max(1, min(int(k), self.n))
        ex = as_rows(exclude, len(v), self.n)
        kk = min(k + int((ex >= 0).any()), self.n)
        if self.gallery.scores_exact(self.metric.mode):
            return self._search_scored(v, k, kk, ex)
        pool = min(self.gallery.max_topk, self.metric.candidate_count(kk, self.n, self.gallery.rerank_factor))
        width = self.gallery.search_width(pool)
        rows = np.full((len(v), k), -1, dtype=np.int64)
        scores = np.full((len(v), k), -np.inf, dtype=np.float32)
        step = max(1, SEARCH_CELLS // pool)  # the pool's vectors are gathered to score them
        for a in range(0, len(v), step):
            q = v[a: a + step]
            cand = np.full((len(q), pool), -1, dtype=np.int64)
            res = self.gallery.search_ip(self.transform(q), pool, ["row"], None, width)
            cand[:] = res.padded(res.fields["row"], pool, -1)
            s = self.score(q, cand)  # exact, −inf where none
            s[cand == ex[a: a + step, None]] = -np.inf
            order = np.argsort(-s, axis=1, kind="stable")[:, :k]  # equal scores: Milvus's order
            r, sc = np.take_along_axis(cand, order, 1), np.take_along_axis(s, order, 1)
            rows[a: a + step, : r.shape[1]] = np.where(np.isfinite(sc), r, -1)
            scores[a: a + step, : r.shape[1]] = sc
        return self.hits(rows, scores) if k <= ITEMS_UP_TO else Hits(rows, scores)

    def item_neighbours(self, rows: np.ndarray, L: int) -> tuple[np.ndarray, np.ndarray]:
        """Each item's top L through the collection's own search, as wide as the offline list pass
        searches (`LIST_WIDTH` × L: HNSW's ef), its rows alone coming back: no metadata, which the
        lists never read.  Where Milvus's scores are not exact (cosine, quantised indexes) the
        candidates are re-scored, through `search`."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        L = max(1, min(int(L), self.n))
        V = self.gallery_vectors(rows)
        if not self.gallery.scores_exact(self._mode):
            h = self.search(V, L)
            return h.rows.astype(np.int32), h.scores.astype(np.float32)
        got, scores = self.gallery.top_rows(self.transform(V), L, self.gallery.search_width(LIST_WIDTH * L),
                                            cells=SEARCH_CELLS)
        return got.astype(np.int32), scores

    def _search_scored(self, v: np.ndarray, k: int, kk: int, ex: np.ndarray) -> Hits:
        """`search` where Milvus's scores are exact: its hits, with their metadata."""
        asked = self.metric.candidate_count(kk, self.n, self.gallery.rerank_factor)
        step = max(1, SEARCH_CELLS // max(1, asked))
        rows = np.full((len(v), k), -1, dtype=np.int64)
        scores = np.full((len(v), k), -np.inf, dtype=np.float32)
        at = np.full((len(v), k), -1, dtype=np.int64)
        items: list = []  # each block's hits' metadata, as the collection returned it
        for a in range(0, len(v), step):
            h = self.gallery.search_metric(v[a: a + step], self.metric, kk, what="queries")
            drop = (h.rows == ex[a: a + step, None]) | (h.rows < 0)
            order = np.argsort(drop, axis=1, kind="stable")[:, :k]  # kept entries first, in their order
            r = np.take_along_axis(np.where(drop, -1, h.rows), order, 1)
            rows[a: a + step, : r.shape[1]] = r
            scores[a: a + step, : r.shape[1]] = np.take_along_axis(np.where(drop, -np.inf, h.scores), order, 1)
            h_at = h.at if h.at is not None else np.where(h.rows >= 0, h.rows, -1)
            offset = sum(len(i) for i in items)
            at[a: a + step, : r.shape[1]] = np.where(r >= 0, np.take_along_axis(h_at, order, 1) + offset, -1)
            items.append(h.items)
        return Hits(rows, scores, functools.reduce(Items.concat, items), at, self.gallery.class_names)

    def score(self, v: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        if rows is None:
            self._whole("every item's score")
        t = self.transform(v)
        rows = np.asarray(rows, dtype=np.int64)
        if rows.ndim == 1:
            return t @ self.gallery_vectors(rows).T
        keys = self.gallery_vectors(np.maximum(rows, 0))
        return np.where(rows >= 0, np.einsum("qd,qmd->qm", t, keys), -np.inf).astype(np.float32)

    def score_blocks(self, v: np.ndarray, width: int | None = None):
        self._whole("a pass over every item")

    def _whole(self, what: str):
        raise UserError(f"this re-ranker reads {what}; on a Milvus gallery the re-rankers that read by row run "
                        f"in the engine, the others on a copy of its vectors")

    def factor(self) -> np.ndarray | None:
        def build():  # metric.psd_factor, the one factor of M′ (None: indefinite)
            F = psd_factor(self._rm.M)
            return {"F": np.zeros((0, 0), np.float32) if F is None else F, "psd": np.array(F is not None)}
        got = self.artefact("factor", None, build)
        return got["F"] if bool(got["psd"]) else None

    def hits(self, rows: np.ndarray, scores: np.ndarray) -> Hits:
        """`Hits` with the metadata of the rows shown, fetched by row."""
        rows = np.asarray(rows, dtype=np.int64)
        valid = rows[rows >= 0]
        uniq, back = np.unique(valid, return_inverse=True)
        at = np.full(rows.shape, -1, dtype=np.int64)
        at[rows >= 0] = back.reshape(-1)
        items = self.gallery.fetch_items(uniq)
        return Hits(rows, np.asarray(scores, dtype=np.float32), items, at, self.gallery.class_names)
