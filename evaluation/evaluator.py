"""Retrieval and clustering metrics.

Definitions (per query q with label y, R = number of *other* gallery items
labelled y, neighbours ranked best first):
  Recall@K       1 if any of the top K is relevant (the DML "recall", = hit rate)
  Precision@1    1 if the top neighbour is relevant
  R-Precision    (#relevant in top R) / R
  MAP@R          (1/R) Σ_{i≤R} P(i)·rel(i),  P(i) = precision of the top i
A query with R = 0 has nothing to retrieve: it is left out of these and counted
as `n_skipped_queries`.  Clustering: k-means on the gallery embeddings with
k = number of classes, scored by NMI and pairwise F1.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from core.arrays import l2_normalize
from core.errors import UserError

from .clustering import clustering_scores
from .knn import flat_index, knn_chunks

DEFAULT_KS = (1, 2, 4, 8)


def relevant_counts(query_labels: np.ndarray, gallery_labels: np.ndarray, same_set: bool) -> np.ndarray:
    uniq, counts = np.unique(gallery_labels, return_counts=True)
    pos = np.searchsorted(uniq, query_labels)
    pos = np.clip(pos, 0, len(uniq) - 1)
    found = uniq[pos] == query_labels
    R = np.where(found, counts[pos], 0)
    return R - (1 if same_set else 0)


def per_query_metrics(nbr_labels: np.ndarray, query_labels: np.ndarray, R: np.ndarray,
                      ks=DEFAULT_KS) -> dict[str, np.ndarray]:
    """Per-query metrics from the ranked neighbour labels (n × k, k ≥ max(R), max(ks))."""
    n, k = nbr_labels.shape
    rel = nbr_labels == query_labels[:, None]
    out = {}
    for K in ks:
        out[f"recall@{K}"] = rel[:, :K].any(1).astype(np.float64)
    out["precision@1"] = rel[:, 0].astype(np.float64) if k else np.zeros(n)
    within_r = np.arange(k)[None, :] < R[:, None]
    rel_r = rel & within_r
    Rf = np.maximum(R, 1).astype(np.float64)
    out["r_precision"] = rel_r.sum(1) / Rf
    prec_at_i = np.cumsum(rel_r, axis=1) / np.arange(1, k + 1)[None, :]
    out["map@r"] = (prec_at_i * rel_r).sum(1) / Rf
    return out


def evaluate_ranking(index, query: np.ndarray, query_labels: np.ndarray, gallery_labels: np.ndarray,
                     *, same_set: bool, ks=DEFAULT_KS, chunk: int = 4096,
                     return_per_query: bool = False) -> dict:
    """k-NN metrics for queries against any FAISS-like index over the gallery.

    With `same_set`, query row i is gallery item i (leave-one-out).
    """
    query_labels = np.asarray(query_labels)
    gallery_labels = np.asarray(gallery_labels)
    R = relevant_counts(query_labels, gallery_labels, same_set)
    valid = np.nonzero(R > 0)[0]
    k_needed = np.maximum(R[valid], max(ks))
    sums = {f"recall@{K}": 0.0 for K in ks} | {"precision@1": 0.0, "r_precision": 0.0, "map@r": 0.0}
    per_query = {key: np.full(len(query_labels), np.nan) for key in sums} if return_per_query else None
    if len(valid):
        # sort valid queries by k so chunks search with similar k (bounded memory)
        order = valid[np.argsort(k_needed, kind="stable")]
        korder = np.maximum(R[order], max(ks))
        self_ids = order if same_set else None
        for rows, _, ids in knn_chunks(query[order], index, korder, self_ids=self_ids, chunk=chunk):
            qi = order[rows]
            nbr = gallery_labels[ids]
            if nbr.shape[1] < int(korder[rows].max()):  # gallery smaller than k: pad as misses
                pad = np.full((len(qi), int(korder[rows].max()) - nbr.shape[1]), np.iinfo(np.int64).min)
                nbr = np.concatenate([nbr.astype(np.int64), pad], axis=1)
            m = per_query_metrics(nbr, query_labels[qi], R[qi], ks)
            for key, v in m.items():
                sums[key] += float(v.sum())
                if per_query is not None:
                    per_query[key][qi] = v
    nq = len(valid)
    out: dict[str, Any] = {key: (v / nq if nq else float("nan")) for key, v in sums.items()}
    out["n_queries"] = int(nq)
    out["n_skipped_queries"] = int(len(query_labels) - nq)
    if per_query is not None:
        out["per_query"] = per_query
    return out


def class_labels(labels, what: str = "labels") -> np.ndarray:
    """Labels as int64; refuses strings, non-integral floats, non-finite values and other shapes."""
    a = np.asarray(labels)
    if a.ndim != 1:
        raise UserError(f"{what} must be 1-D, got shape {a.shape}")
    if a.dtype.kind in "iub":
        return a.astype(np.int64)
    if a.dtype.kind != "f":
        raise UserError(f"{what} must be integer class ids, got dtype {a.dtype}")
    if not np.isfinite(a).all() or (a != np.round(a)).any():
        bad = a[~np.isfinite(a) | (a != np.round(a))][:3]
        raise UserError(f"{what} must be integer class ids; found {bad.tolist()}")
    return a.astype(np.int64)


def evaluate(query: np.ndarray, query_labels, gallery: np.ndarray | None = None, gallery_labels=None,
             *, ks=DEFAULT_KS, normalize: bool = True, metric: str | None = None,
             clustering: bool = True, chunk: int = 4096, seed: int = 1234) -> dict:
    """Evaluate embeddings.  `gallery=None`: query = gallery, leaving each query out.

    normalize=True compares by cosine (L2-normalise, inner product); otherwise
    `metric` is "l2" (default) or "ip" on the raw vectors.
    """
    query = np.ascontiguousarray(query, dtype=np.float32)
    query_labels = class_labels(query_labels, "query labels" if gallery is not None else "labels")
    same_set = gallery is None
    if len(query) == 0:
        raise UserError("no embeddings to evaluate (empty input)")
    if same_set:
        gallery, gallery_labels = query, query_labels
    else:
        gallery = np.ascontiguousarray(gallery, dtype=np.float32)
        gallery_labels = class_labels(gallery_labels, "gallery labels")
        if len(gallery) == 0:
            raise UserError("the gallery is empty")
        if gallery.shape[1] != query.shape[1]:
            raise UserError(f"query dimension {query.shape[1]} differs from gallery dimension {gallery.shape[1]}")
    if len(query) != len(query_labels) or len(gallery) != len(gallery_labels):
        raise UserError(f"embeddings and labels differ in length ({len(query)} vs {len(query_labels)})")
    if not np.isfinite(query).all() or not np.isfinite(gallery).all():
        raise UserError("embeddings contain NaN or inf")
    if normalize:
        query = l2_normalize(query)
        gallery = query if same_set else l2_normalize(gallery)
        metric = "ip"
    metric = metric or "l2"
    if metric not in ("ip", "l2"):
        raise ValueError(f"metric must be 'ip' or 'l2', got {metric!r}")
    index = flat_index(gallery, metric)
    out = evaluate_ranking(index, query, query_labels, gallery_labels, same_set=same_set,
                           ks=ks, chunk=chunk)
    if out["n_queries"] == 0:
        raise UserError(f"no query has a positive: none of the {len(query)} queries has another item of "
                        "its class in the gallery, so retrieval metrics are undefined")
    if clustering and len(np.unique(gallery_labels)) < 2:
        raise UserError("clustering scores need at least 2 classes; the gallery has 1 "
                        "(evaluate without clustering, or with more classes)")
    if clustering:
        out.update(clustering_scores(gallery, gallery_labels, seed=seed))
    return out
