"""The metric spaces of each gallery, kept while the gallery lives: a search under a
configuration seen before finds its space, whose state (keys, artefacts) is in the layer's
one memory cache (memory.py) under the space's cache key."""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

from ..refinements import strategy_key
from .protocol import MetricSpace

SPACES_PER_GALLERY = 4  # space objects kept per gallery: each holds its M′'s query view, not its state
_spaces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def gallery_space(gallery, strategy: str, params: dict, mode: str) -> MetricSpace:
    """The `MetricSpace` of (gallery, strategy, params, mode), from `gallery.metric_space` the
    first time (a backend that cannot give one refuses there)."""
    key = (strategy_key(strategy, params), mode)
    with _lock:
        per = _spaces.setdefault(gallery, OrderedDict())
        space = per.get(key)
        if space is not None:
            per.move_to_end(key)
            return space
    space = gallery.metric_space(strategy, params, mode)  # outside the lock: may build M′'s cosine parts
    with _lock:
        per = _spaces.setdefault(gallery, OrderedDict())
        space = per.setdefault(key, space)
        while len(per) > SPACES_PER_GALLERY:
            per.popitem(last=False)
    return space
