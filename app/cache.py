"""The app's one cache: what it draws or computes for display (thumbnails, heatmaps, 2-D maps,
sampled comparisons), least recently used first out, under one byte budget.

The metrics, their cosine parts and the re-rankers' spaces are the index's own caches
(index/backends, index/search_config.py); this holds only what the app itself makes.
"""
from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

from .limits import DEFAULT_CACHE_MB


def size_of(value: Any) -> int:
    """Bytes a cached value holds, roughly: arrays and images by their pixels, containers by
    their parts."""
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, Image.Image):
        return value.width * value.height * len(value.getbands())
    if isinstance(value, (tuple, list)):
        return sum(size_of(v) for v in value) + sys.getsizeof(value)
    if isinstance(value, dict):
        return sum(size_of(v) for v in value.values()) + sys.getsizeof(value)
    if hasattr(value, "__dict__"):
        return size_of(vars(value))
    return sys.getsizeof(value)


class AppCache:
    """Key → value, at most `budget` bytes (by `size_of`); a value larger than the budget is
    computed and returned but not kept.  Thread-safe; a value is computed outside the lock."""

    def __init__(self, budget: int = DEFAULT_CACHE_MB << 20):
        self.budget = int(budget)
        self._items: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key, make: Callable[[], Any]):
        with self._lock:
            hit = self._items.get(key)
            if hit is not None:
                self._items.move_to_end(key)
                return hit[0]
        value = make()
        self.put(key, value)
        return value

    def put(self, key, value) -> None:
        size = size_of(value)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if size > self.budget:
                return
            self._items[key] = (value, size)
            self._bytes += size
            while self._bytes > self.budget:
                _, (_, s) = self._items.popitem(last=False)
                self._bytes -= s

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)
