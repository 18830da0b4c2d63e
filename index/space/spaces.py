"""The metric spaces of each gallery, kept while the gallery lives: a search under a
configuration seen before finds its space, whose state (keys, artefacts) is in the layer's
one memory cache (memory.py) under the space's cache key.

The spaces are held by the gallery itself (an attribute), not by a table of this module: a
space refers to its gallery, so a module-level table would keep every gallery alive; held
by the gallery, the two form a cycle that the garbage collector frees once the gallery's
owner drops it."""
from __future__ import annotations

import threading
from collections import OrderedDict

from ..refinements import strategy_key
from .protocol import MetricSpace

SPACES_PER_GALLERY = 4  # space objects kept per gallery: each holds its M′'s query view, not its state
ATTRIBUTE = "_metric_spaces"
_lock = threading.Lock()


def _spaces_of(gallery) -> OrderedDict:
    per = gallery.__dict__.get(ATTRIBUTE)
    if per is None:
        per = gallery.__dict__[ATTRIBUTE] = OrderedDict()
    return per


def gallery_space(gallery, strategy: str, params: dict, mode: str, by_row: bool = False) -> MetricSpace:
    """The `MetricSpace` of (gallery, strategy, params, mode), from `gallery.metric_space` the
    first time (a backend that cannot give one refuses there); `by_row`: the space read by row
    where the backend has one (`Gallery.metric_space`)."""
    key = (strategy_key(strategy, params), mode, by_row)
    with _lock:
        per = _spaces_of(gallery)
        space = per.get(key)
        if space is not None:
            per.move_to_end(key)
            return space
    space = gallery.metric_space(strategy, params, mode, by_row)  # outside the lock: may build M′'s cosine parts
    with _lock:
        per = _spaces_of(gallery)
        space = per.setdefault(key, space)
        per.move_to_end(key)
        while len(per) > SPACES_PER_GALLERY:
            per.popitem(last=False)
    return space
