"""Rows read from a memory-mapped features array without keeping them in the process's RSS:
a full-gallery pass reads the map block by block, and each block's pages, once copied, are
unmapped from the process (MADV_DONTNEED; they stay in the kernel's page cache and a later read
maps them again).  Only read-only file maps are released: an array in RAM is merely copied."""
from __future__ import annotations

import mmap

import numpy as np

SCAN_CELLS = 1 << 22  # float32 cells in one block of a pass over the whole gallery (16 MB): keys or scores


def _file_map(a) -> mmap.mmap | None:
    """The mmap object a read-only `a` is a view of (np.memmap or np.frombuffer over one), else None
    (also for a row source that is no array, such as the app's rows read from Milvus)."""
    if not isinstance(a, np.ndarray) or a.flags.writeable or not hasattr(mmap, "MADV_DONTNEED"):
        return None  # writable: possibly anonymous memory, whose pages MADV_DONTNEED would zero
    base: object = a
    while base is not None:
        if isinstance(base, mmap.mmap):
            return base
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return None


def read_rows(features: np.ndarray, start: int, stop: int) -> np.ndarray:
    """features[start:stop] as a new float32 array; where `features` is a read-only file map,
    the pages the rows span leave the process's RSS once copied."""
    block = features[start:stop]
    out = np.array(block, dtype=np.float32, order="C")
    mm = _file_map(features)
    if mm is not None and block.size:
        origin = np.frombuffer(mm, dtype=np.uint8).ctypes.data  # the map's first byte
        first = block.ctypes.data - origin
        lo = first - first % mmap.PAGESIZE
        mm.madvise(mmap.MADV_DONTNEED, lo, first + block.nbytes - lo)
    return out
