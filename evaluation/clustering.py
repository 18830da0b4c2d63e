"""k-means (FAISS, k = number of classes) scored by NMI and pairwise F1."""
from __future__ import annotations

import faiss
import numpy as np


def kmeans_labels(x: np.ndarray, k: int, niter: int = 20, seed: int = 1234) -> np.ndarray:
    """Same setting as pytorch-metric-learning's FaissKMeans (20 iterations)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if k >= len(x):
        return np.arange(len(x))
    km = faiss.Kmeans(x.shape[1], k, niter=niter, seed=seed, verbose=False)
    km.cp.min_points_per_centroid = 1  # many classes with few images each (SOP): no warning spam
    km.train(x)
    _, assign = km.index.search(x, 1)
    return assign[:, 0]


def pairwise_f1(labels: np.ndarray, clusters: np.ndarray) -> float:
    """F-measure over same-cluster/same-class pairs (Song et al. 2016), as in the CGML paper."""
    from sklearn.metrics.cluster import pair_confusion_matrix  # here: scikit-learn takes seconds to import

    (tn, fp), (fn, tp) = pair_confusion_matrix(labels, clusters)
    if tp == 0:
        return 0.0
    precision = tp / (tp + fp)
    recall = tp / (tp + fn)
    return float(2 * precision * recall / (precision + recall))


def clustering_scores(x: np.ndarray, labels: np.ndarray, seed: int = 1234) -> dict:
    from sklearn.metrics import normalized_mutual_info_score

    k = len(np.unique(labels))
    clusters = kmeans_labels(x, k, seed=seed)
    return {
        "nmi": float(normalized_mutual_info_score(labels, clusters)),
        "f1": pairwise_f1(labels, clusters),
    }
