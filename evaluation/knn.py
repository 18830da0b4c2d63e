"""Exact k-NN with FAISS, in query chunks so memory stays bounded at SOP scale."""
from __future__ import annotations

from collections.abc import Iterator

import faiss
import numpy as np


def flat_index(gallery: np.ndarray, metric: str) -> faiss.Index:
    d = gallery.shape[1]
    index = faiss.IndexFlatIP(d) if metric == "ip" else faiss.IndexFlatL2(d)
    index.add(np.ascontiguousarray(gallery, dtype=np.float32))
    return index


def knn_chunks(query: np.ndarray, index, k: int | np.ndarray, *, self_ids: np.ndarray | None = None,
               chunk: int = 4096) -> Iterator[tuple[slice, np.ndarray, np.ndarray]]:
    """Yield (rows, scores, ids) per query chunk, best first.

    `index` is a FAISS index (or anything with .search and .ntotal).  With
    `self_ids`, query row i is gallery item self_ids[i], and that item is removed
    from its own neighbour list by id (not by position: duplicates can outrank it).
    `k` may be an array of per-query k; each chunk is searched with its maximum.
    """
    n = query.shape[0]
    ntotal = index.ntotal
    exclude_self = self_ids is not None
    kk = np.broadcast_to(np.asarray(k), (n,))
    for s in range(0, n, chunk):
        rows = slice(s, min(n, s + chunk))
        kc = int(kk[rows].max()) if n else 0
        kc = min(kc, ntotal - (1 if exclude_self else 0))
        ks = min(ntotal, kc + (1 if exclude_self else 0))
        q = np.ascontiguousarray(query[rows], dtype=np.float32)
        D, ids = index.search(q, ks)
        if self_ids is not None:
            own = np.asarray(self_ids[rows])[:, None]
            is_self = ids == own
            # drop the self column where present, else the last one
            drop = np.where(is_self.any(1), is_self.argmax(1), ks - 1)
            keep = np.ones_like(ids, dtype=bool)
            keep[np.arange(len(ids)), drop] = False
            ids = ids[keep].reshape(len(ids), ks - 1)
            D = D[keep].reshape(len(D), ks - 1)
        yield rows, D[:, :kc], ids[:, :kc]


def knn_search(query: np.ndarray, gallery: np.ndarray, k: int, metric: str = "ip",
               exclude_self: bool = False, chunk: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Whole result at once (for small inputs): (scores, ids), each n × k."""
    index = flat_index(gallery, metric)
    Ds, Is = [], []
    self_ids = np.arange(len(query)) if exclude_self else None
    for _, D, ids in knn_chunks(query, index, k, self_ids=self_ids, chunk=chunk):
        Ds.append(D)
        Is.append(ids)
    return np.concatenate(Ds), np.concatenate(Is)
