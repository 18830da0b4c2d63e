"""Embedding-space diagnostics (paper 001 and Roth et al. 2020), on L2-normalised embeddings.

  uniformity          log E exp(−2‖x − y‖²) over random pairs (lower = more uniform)
  spectral_decay      ρ = KL(U ‖ s), s the singular-value spectrum normalised to sum 1,
                      U uniform over the d dimensions (lower = flatter spectrum)
  intra_inter_ratio   mean intra-class distance / mean inter-class distance
                      (intra: pairs of one class; inter: pairs of class centres)
  cluster_size_variability  std / mean over classes of the mean distance to the class centre
"""
from __future__ import annotations

import numpy as np

from core.arrays import l2_normalize


def embedding_diagnostics(x: np.ndarray, labels: np.ndarray, n_pairs: int = 200_000, seed: int = 0) -> dict:
    x = np.asarray(x, dtype=np.float64)
    x = l2_normalize(x)
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    n = len(x)
    i = rng.integers(0, n, n_pairs)
    j = rng.integers(0, n, n_pairs)
    keep = i != j
    d2 = ((x[i[keep]] - x[j[keep]]) ** 2).sum(1)
    uniformity = float(np.log(np.mean(np.exp(-2.0 * d2))))

    s = np.linalg.svd(x, compute_uv=False)
    s = s / s.sum()
    u = 1.0 / len(s)
    rho = float(np.sum(u * np.log(u / np.maximum(s, 1e-30))))

    classes = np.unique(labels)
    centres: list[np.ndarray] = []
    intra: list[float] = []
    spread_rows: list[float] = []
    for c in classes:
        xc = x[labels == c]
        mu = xc.mean(0)
        centres.append(mu)
        spread_rows.append(np.linalg.norm(xc - mu, axis=1).mean())
        if len(xc) > 1:
            D = np.sqrt(np.maximum(((xc[:, None, :] - xc[None, :, :]) ** 2).sum(-1), 0))
            intra.append(D[np.triu_indices(len(xc), 1)].mean())
    C = np.array(centres)
    Dc = np.sqrt(np.maximum(((C[:, None, :] - C[None, :, :]) ** 2).sum(-1), 0))
    inter = Dc[np.triu_indices(len(C), 1)].mean() if len(C) > 1 else float("nan")
    spread = np.array(spread_rows)
    return {
        "uniformity": uniformity,
        "spectral_decay": rho,
        "intra_class_distance": float(np.mean(intra)) if intra else float("nan"),
        "inter_class_distance": float(inter),
        "intra_inter_ratio": float(np.mean(intra) / inter) if intra and inter else float("nan"),
        "cluster_size_variability": float(spread.std() / spread.mean()) if spread.mean() > 0 else float("nan"),
    }
