"""The process's one in-memory cache: every metric space's state (keys, neighbour lists,
offline artefacts, re-rankers' look-up tables), each strategy's M′, comparisons and what the app
draws, and the rows an engine's gallery is read by (its vectors and per-item artefacts, fetched
by row).  One lock, one byte budget (`--cache-memory`), least recently used entries evicted first,
and each entry built once however many threads ask for it at once.  Here, at the bottom of the
layers, so that every package can keep its values in it.  docs/reranking.md ("The metric-space
layer") describes the policy."""
from __future__ import annotations

import os
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from .errors import UserError
from .flags import CACHE_MEMORY_DEFAULT, CACHE_MEMORY_ENV, parse_size


def parse_bytes(text: str | int, what: str = "--cache-memory") -> int:
    """A byte count from `123`, `512M`, `4G` (core.flags.parse_size); bad input → UserError."""
    try:
        return parse_size(text, what)
    except ValueError as e:
        raise UserError(str(e)) from None


def nbytes(value: Any) -> int:
    """The memory an artefact holds: its arrays (in dicts, tuples, lists) and FAISS flat indexes;
    none for a memory-mapped file (its pages are the kernel's page cache, dropped under pressure)."""
    if isinstance(value, np.memmap):
        return 0
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, dict):
        return sum(nbytes(v) for v in value.values())
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    if hasattr(value, "ntotal") and hasattr(value, "d"):  # a FAISS index: its vectors (float32)
        return int(value.ntotal) * int(value.d) * 4
    return 0


# rows read by row (an engine's vectors, its per-item artefacts) take at most 1/ROW_SHARE of the budget
ROW_SHARE = 4
# what CPython holds around a kept row beyond its arrays' data (its key, the dict's slot, the tuple) and
# around each of its arrays (header, allocation): measured with tracemalloc on rows of 1 and 2 arrays
ROW_ENTRY, ARRAY_ENTRY = 160, 168


def row_bytes(value: Any) -> int:
    """The memory a kept row holds: its arrays' data and what the interpreter holds around them."""
    arrays = value if isinstance(value, tuple) else (value,)
    return ROW_ENTRY + sum(ARRAY_ENTRY + int(a.nbytes) for a in arrays)


_SHARED = (int, float, complex, str, bytes, bool, type(None))  # interned or immutable: held by anyone


def _parts_of(value: Any) -> list:
    """What a value is made of at its top level (a dict's values, a tuple's or a list's items,
    numbers and strings aside): a reader may keep one of them after letting the value itself go
    (`M, ops = cached` keeps M)."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    return [a for a in items if not isinstance(a, _SHARED)]


def _in_use(value: Any) -> bool:
    """Whether anything holds `value`, or one of its parts, beyond one holder of the value (an
    entry's tuple, the caller's local) and this call: CPython 3.11's reference counts, whose
    baselines here are 3 for the value (holder, this parameter, getrefcount's argument) and 4
    for each part (its container, the list, the loop's name, the argument)."""
    return sys.getrefcount(value) > 3 or any(sys.getrefcount(a) > 4 for a in _parts_of(value))


class _Build:
    """One build in flight: the threads that wait for it read its value when it is done."""
    __slots__ = ("done", "value", "failed")

    def __init__(self):
        self.done, self.value, self.failed = False, None, False


class MemoryCache:
    """Entries by key, least recently used first, their sizes summed against `budget` bytes.
    `get_or_build` builds a missing entry outside the lock while any other thread asking for
    the same key waits for that build: one build per key at a time.  A build that declares its
    size (`reserve=`) counts against the budget from its start, so that older entries make room
    before it runs rather than after.  An evicted value that a reader still holds (a request
    that is using it) stays counted until the last reader lets it go, and a thread asking for it
    meanwhile gets it back rather than a second copy; only a value the cache owns, one that its
    build made (not an array some other object holds too, such as a gallery's own), is followed
    so."""

    def __init__(self, budget: int):
        self.budget = int(budget)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._entries: OrderedDict[Hashable, tuple[Any, int, bool]] = OrderedDict()  # (value, size, owned)
        self._held: dict[Hashable, tuple[Any, int]] = {}  # evicted, still read: (value, size)
        self._held_bytes = 0
        self._building: dict[Hashable, _Build] = {}
        self._gone: deque = deque()  # owners whose entries go at the next call (`drop_owner`)
        self._rows: OrderedDict[tuple[Hashable, int], tuple[Any, int]] = OrderedDict()  # (space, row) → row
        self._row_bytes = 0
        self._reserved = 0  # the declared sizes of the builds running now

    @property
    def used(self) -> int:
        """The bytes counted against the budget: the entries, the rows, the declared sizes of
        the builds running now, and the evicted values a reader still holds."""
        with self._lock:
            dropped = self._forget_gone()
            total = self._total()
        del dropped  # outside the lock (see `_evict`)
        return total

    def _total(self) -> int:
        return sum(e[1] for e in self._entries.values()) + self._row_bytes + self._reserved + self._held_bytes

    @property
    def held_bytes(self) -> int:
        """The bytes of the evicted values that readers still hold (counted in `used`)."""
        with self._lock:
            dropped = self._forget_gone()
            held = self._held_bytes
        del dropped  # outside the lock (see `_evict`)
        return held

    @property
    def rows_used(self) -> int:
        with self._lock:
            return self._row_bytes

    # ------------------------------------------------------------ rows read by row
    def rows_get(self, space: Hashable, rows: np.ndarray) -> tuple[np.ndarray, list]:
        """The rows of `space` (an engine's gallery or artefact, named by what made it) held here:
        (found mask, the found ones' values in order); they become the most recently used."""
        found, values = np.zeros(len(rows), dtype=bool), []
        with self._lock:
            for i, r in enumerate(np.asarray(rows).tolist()):
                hit = self._rows.get((space, r))
                if hit is not None:
                    self._rows.move_to_end((space, r))
                    found[i] = True
                    values.append(hit[0])
        return found, values

    def rows_put(self, space: Hashable, rows: np.ndarray, values: list) -> None:
        """Keep these rows (each an array or a tuple of arrays, owned: not a view of a larger
        block), dropping the least recently used rows past the rows' share of the budget, and then
        entries past the budget."""
        with self._lock:
            cap = self.budget // ROW_SHARE
            for r, v in zip(np.asarray(rows).tolist(), values, strict=True):
                key = (space, r)
                size = row_bytes(v)
                if key in self._rows or size > cap:
                    continue
                self._rows[key] = (v, size)
                self._row_bytes += size
                while self._row_bytes > cap:
                    self._row_bytes -= self._rows.popitem(last=False)[1][1]
            dropped = self._forget_gone() + self._evict(keep=None)
        del dropped  # outside the lock (see `_evict`)

    def rows_through(self, space: Hashable, uniq: np.ndarray, fetch: Callable[[np.ndarray], list]) -> list:
        """The values of the distinct rows `uniq` of `space`, in their order: those held here, and
        the others from `fetch(missing rows)` (owned values, in that order), which are kept."""
        found, held = self.rows_get(space, uniq)
        values: list[Any] = [None] * len(uniq)
        for i, v in zip(np.flatnonzero(found), held, strict=True):
            values[i] = v
        missing = np.asarray(uniq)[~found]
        if len(missing):
            fetched = fetch(missing)
            self.rows_put(space, missing, fetched)
            for i, v in zip(np.flatnonzero(~found), fetched, strict=True):
                values[i] = v
        return values

    def peek(self, key: Hashable) -> Any:
        """The entry if held (it becomes the most recently used), else None; never builds."""
        with self._lock:
            dropped = self._forget_gone()
            hit = self._entries.get(key)
            if hit is None and key in self._held:
                hit, back = self._back(key)
                dropped += back
            if hit is not None:
                self._entries.move_to_end(key)
        del dropped  # outside the lock (see `_evict`)
        return None if hit is None else hit[0]

    def get_or_build(self, key: Hashable, build: Callable[[], Any], *, max_bytes: int | None = None,
                     reserve: int = 0) -> Any:
        """The entry under `key`, built by `build()` when absent; kept when its
        size is within `max_bytes` (default: the budget), evicting the least recently used.  A
        thread that finds the same key being built waits for that build and returns its value.
        `reserve`: the bytes the build will hold (its value's size, where known beforehand),
        counted against the budget while it runs (not when the value will be too large to keep)."""
        with self._lock:
            dropped = self._forget_gone()  # released as this frame ends, after the lock
            while True:
                hit = self._entries.get(key)
                if hit is None and key in self._held:
                    hit, back = self._back(key)
                    dropped += back
                if hit is not None:
                    self._entries.move_to_end(key)
                    return hit[0]
                running = self._building.get(key)
                if running is None:
                    break
                while not running.done:
                    self._changed.wait()
                if not running.failed:
                    return running.value
                # the build failed (its thread raised): build here
            mine = self._building[key] = _Build()
            reserve = max(0, int(reserve))
            if reserve > (self.budget if max_bytes is None else min(self.budget, max_bytes)):
                reserve = 0  # it will not be kept: emptying the cache for it would only cost rebuilds
            self._reserved += reserve
            dropped += self._forget_gone() + self._evict(keep=None)
        del dropped  # outside the lock (see `_evict`)
        value, size, built, owned = None, 0, False, False
        try:
            value = build()
            owned = not _in_use(value)  # made by its build: nothing else holds it or its arrays
            size = nbytes(value)
            built = True
        finally:  # built or not (an error, Ctrl-C): the reservation returned, the waiters woken
            with self._lock:
                self._reserved -= reserve
                mine.done, mine.failed, mine.value = True, not built, value
                del self._building[key]
                dropped = []
                if built:
                    dropped = [self._entries.pop(key, None), *self._forget_gone()]
                    if size <= (self.budget if max_bytes is None else min(self.budget, max_bytes)):
                        self._entries[key] = (value, size, owned)
                        dropped += self._evict(keep=key)
                self._changed.notify_all()
            del dropped  # here, outside the lock (see `_evict`)
        return value

    def _evict(self, keep: Hashable | None) -> list:
        """Drop least recently used entries until the rest fit; returns them, for the caller to
        release once it has left the lock: the last reference to a value may run a finalizer
        that calls this cache (a searcher's `drop_owner`), and the lock is not reentrant."""
        cap = self.budget // ROW_SHARE
        while self._row_bytes > cap:  # a lowered budget: the rows first keep to their share
            self._row_bytes -= self._rows.popitem(last=False)[1][1]
        total = self._total()
        dropped = []
        for k in list(self._entries):
            if total <= self.budget:
                break
            if k != keep:
                entry = self._entries.pop(k)
                total -= entry[1]
                # still read elsewhere (beyond `entry` and the call's argument): counted until let go
                if entry[2] and entry[1] and _in_use(entry[0]):
                    self._held[k] = (entry[0], entry[1])
                    self._held_bytes += entry[1]
                    total += entry[1]
                else:
                    dropped.append(entry)
        while total > self.budget and self._rows:  # an entry as large as the budget: the rows give way
            size = self._rows.popitem(last=False)[1][1]
            self._row_bytes -= size
            total -= size
        return dropped

    def set_budget(self, budget: int) -> None:
        with self._lock:
            self.budget = int(budget)
            dropped = self._forget_gone() + self._evict(keep=None)
        del dropped  # outside the lock (see `_evict`)

    def drop_owner(self, owner: Hashable) -> None:
        """Forget every entry whose key is a tuple starting with `owner` (a searcher gone), at the
        cache's next call: this runs from finalizers, which the garbage collector may start in any
        thread at any allocation, this cache's own code under its lock included, so it only notes
        the owner (a deque's append takes no lock)."""
        self._gone.append(owner)

    def _back(self, key: Hashable) -> tuple[tuple[Any, int, bool], list]:
        """Under the lock: an evicted value that a reader still holds made the most recent entry
        again, and the others evicted past the budget; returns (its entry, what was evicted)."""
        held = self._held.pop(key)
        self._held_bytes -= held[1]
        self._entries[key] = entry = (held[0], held[1], True)
        return entry, self._evict(keep=key)

    def _let_go(self) -> list:
        """Under the lock: forget the evicted values no reader holds any more; returns them, to
        be released outside the lock."""
        dropped = []
        for k, held in list(self._held.items()):
            if not _in_use(held[0]):
                dropped.append(self._held.pop(k))
                self._held_bytes -= held[1]
        return dropped

    def _forget_gone(self) -> list:
        """Under the lock: drop the entries of the owners `drop_owner` noted, and the evicted
        values no reader holds any more; returns them (to be released outside the lock)."""
        dropped = self._let_go()
        while self._gone:
            owner = self._gone.popleft()
            for k in [k for k in self._entries if isinstance(k, tuple) and k and k[0] is owner]:
                dropped.append(self._entries.pop(k))
            for k in [k for k in self._held if isinstance(k, tuple) and k and k[0] is owner]:
                dropped.append(self._held.pop(k))
                self._held_bytes -= dropped[-1][1]
        return dropped

    def clear(self) -> None:
        with self._lock:
            self._gone.clear()
            dropped, self._entries = self._entries, OrderedDict()
            held, self._held, self._held_bytes = self._held, {}, 0
            rows, self._rows, self._row_bytes = self._rows, OrderedDict(), 0
        del dropped, rows, held  # outside the lock (see `_evict`)


def _initial_budget() -> int:
    text = os.environ.get(CACHE_MEMORY_ENV, "").strip()
    try:
        return parse_bytes(text or CACHE_MEMORY_DEFAULT, CACHE_MEMORY_ENV)
    except UserError:  # a bad value there: the default (the flag, checked, overrides it)
        return parse_bytes(CACHE_MEMORY_DEFAULT)


CACHE = MemoryCache(_initial_budget())


def set_memory_budget(size: str | int | None) -> None:
    """Set the budget of every metric space's in-memory state: `--cache-memory`'s value, else
    $DML_CACHE_MEMORY, else 4G (a bad value of either refused, naming it)."""
    if size is None:
        text = os.environ.get(CACHE_MEMORY_ENV, "").strip()
        CACHE.set_budget(parse_bytes(text, CACHE_MEMORY_ENV) if text else parse_bytes(CACHE_MEMORY_DEFAULT))
    else:
        CACHE.set_budget(parse_bytes(size))


def memory_budget() -> int:
    return CACHE.budget


def check_fits(what: str, size: int, advice: str = "") -> None:
    """Refuse, in one line and before anything is built, an artefact of `size` bytes (`what` says
    what it holds) that the memory budget could not keep."""
    if size > CACHE.budget:
        raise UserError(f"{what} would take {size / 2**30:.2f} GiB, above the memory budget "
                        f"(--cache-memory {CACHE.budget / 2**30:.2f}G); raise --cache-memory"
                        + (f" or {advice}" if advice else ""))
