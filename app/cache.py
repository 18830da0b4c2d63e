"""Where the app keeps what it draws or computes for display (thumbnails, heatmaps, 2-D maps,
sampled comparisons): the process's one memory cache, core.memory.CACHE, beside every
metric space's state and the whole-index comparisons.  One byte budget (`--cache-memory`), the
least recently used entries dropped first, and each entry built once however many requests ask
for it at the same time (the others wait for that build).

Keys are digests of what made a value (`keep`), never the objects themselves; pictures are kept
as their pixel arrays, which the cache's size function (`core.memory.nbytes`) measures.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image

from core.memory import CACHE
from index.space import key_hash

OWNER = "app"  # the first part of every key this module makes


def keep(kind: str, *parts, build: Callable[[], Any]) -> Any:
    """The value of `kind` made from `parts` (names, numbers, digests), built by `build()` once."""
    return CACHE.get_or_build((OWNER, kind, key_hash(kind, *parts)), build)


def held(kind: str, *parts) -> bool:
    """Whether that value is kept now (never builds it)."""
    return CACHE.peek((OWNER, kind, key_hash(kind, *parts))) is not None


def pixels(img: Image.Image) -> np.ndarray:
    """An image's pixels as a read-only array: shared by every request that reads the entry."""
    a = np.array(img)
    a.flags.writeable = False
    return a


def keep_image(kind: str, *parts, draw: Callable[[], Image.Image]) -> Image.Image:
    """`keep` for a picture: kept as its pixels, returned as a new image each time."""
    return Image.fromarray(keep(kind, *parts, build=lambda: pixels(draw())))
