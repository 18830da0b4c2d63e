"""Batched strategy sweeps: many M′ scored against one feature matrix, query = gallery.

Evaluating a strategy through the search path costs a full exact search
(N × N × d) per setting.  A sweep over one split can share most of it: the
score matrix S = Φ M′ Φᵀ is built from a few products computed once:
  identity        G = Φ Φᵀ                            (once)
  trained         T = E Eᵀ, E = Φ Wᵀ                  (once, rank k ≪ d)
  diagonal        T − (Φ_S D_S) Φ_Sᵀ                  (only the zeroed columns S)
  anything else   (Φ M′) Φᵀ
and cosine mode divides by the M′-norms, which are the diagonal of S.  Each
setting is then ranked with one top-k over rows (self excluded) and scored by
the same per-query metrics as the evaluator.  Rankings equal the search path's
up to floating-point ties (a test checks every strategy and mode).

Memory is O(N²): used up to `MAX_N` items; larger splits take the search path.
"""
from __future__ import annotations

import numpy as np
import torch

from evaluation.evaluator import DEFAULT_KS, per_query_metrics, relevant_counts

MAX_N = 12_000  # 3 N² float32 matrices (S, G, T) stay under ~1.8 GB


class GramSweep:
    """Scores settings on one split; `features` are the split's (normalised, as indexed) φ."""

    def __init__(self, features: np.ndarray, labels: np.ndarray, W: np.ndarray, ks=DEFAULT_KS,
                 chunk: int = 2048):
        self.phi = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32))
        self.W = torch.from_numpy(np.ascontiguousarray(W, dtype=np.float32))
        self.labels = np.asarray(labels, dtype=np.int64)
        self.ks = tuple(ks)
        self.chunk = chunk
        self.R = relevant_counts(self.labels, self.labels, same_set=True)
        self.valid = np.nonzero(self.R > 0)[0]
        self.k = int(max(self.R.max(initial=0), max(self.ks)))
        self._G = self._T = None

    @property
    def n(self) -> int:
        return len(self.labels)

    def gram(self) -> torch.Tensor:
        if self._G is None:
            self._G = self.phi @ self.phi.T
        return self._G

    def low_rank(self) -> torch.Tensor:
        if self._T is None:
            E = self.phi @ self.W.T
            self._T = E @ E.T
        return self._T

    def scores(self, M: np.ndarray, op_kind: str, diag_removed: np.ndarray | None = None) -> torch.Tensor:
        """S = Φ M′ Φᵀ (a fresh tensor the caller may modify)."""
        if op_kind == "identity":
            return self.gram().clone()
        if op_kind == "lowrank":
            return self.low_rank().clone()
        if op_kind == "lowrank-diag":
            nz = np.nonzero(diag_removed)[0]
            S = self.low_rank().clone()
            if len(nz):
                cols = self.phi[:, torch.from_numpy(nz)]
                S -= (cols * torch.from_numpy(diag_removed[nz].astype(np.float32))) @ cols.T
            return S
        return (self.phi @ torch.from_numpy(np.ascontiguousarray(M, dtype=np.float32))) @ self.phi.T

    def evaluate(self, S: torch.Tensor, mode: str) -> dict:
        """Metrics of the ranking by S (bilinear) or by S / (‖·‖_M′ ‖·‖_M′) (cosine); S is consumed."""
        if mode == "cosine":
            # the search path: index rows scaled by 1/‖x‖ (0 where ‖x‖ = 0), queries by 1/max(‖q‖, 1e-30)
            norms = torch.sqrt(torch.clamp(torch.diagonal(S).double(), min=0.0))
            inv_x = torch.where(norms > 0, 1.0 / torch.clamp(norms, min=1e-30), 0.0).float()
            inv_q = (1.0 / torch.clamp(norms, min=1e-30)).float()
            S.mul_(inv_x[None, :]).mul_(inv_q[:, None])
        S.fill_diagonal_(-float("inf"))  # leave the query out
        valid = torch.from_numpy(self.valid)
        sums = {f"recall@{K}": 0.0 for K in self.ks} | {"precision@1": 0.0, "r_precision": 0.0, "map@r": 0.0}
        k = min(self.k, self.n - 1)
        for s in range(0, len(valid), self.chunk):
            rows = valid[s: s + self.chunk]
            idx = torch.topk(S[rows], k, dim=1, sorted=True).indices.numpy()
            nbr = self.labels[idx]
            if k < self.k:  # fewer gallery items than needed: missing ranks count as misses
                nbr = np.concatenate([nbr, np.full((len(rows), self.k - k), np.iinfo(np.int64).min)], 1)
            r = rows.numpy()
            for key, v in per_query_metrics(nbr, self.labels[r], self.R[r], self.ks).items():
                sums[key] += float(v.sum())
        nq = len(self.valid)
        out = {key: (v / nq if nq else float("nan")) for key, v in sums.items()}
        return out | {"n_queries": int(nq), "n_skipped_queries": int(self.n - nq)}
