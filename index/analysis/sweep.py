"""Batched strategy sweeps: many M′ scored against one feature matrix, query = gallery.

S = Φ M′ Φᵀ is built from products shared across settings, by the structure each strategy's
operator declares (index/operator.py): ΦΦᵀ and the low-rank EEᵀ once, diagonal restraint as
a rank-|S| correction nested in r, spectral as cI + a rank-k part, dense (ΦM′)Φᵀ otherwise;
upper blocks only (S is symmetric), ranked by one top-k over row chunks, self excluded.
Rankings equal the search path's up to floating-point ties (tested).  Memory is O(N²): up to
`MAX_N` items, larger splits take the search path (docs/refinement.md, "Speed of the strategy evaluation").
"""
from __future__ import annotations

import numpy as np
import torch

from evaluation.evaluator import DEFAULT_KS, per_query_metrics, relevant_counts

MAX_N = 12_000  # S, G, T and the nested diagonal's previous S: 4 N² float32 matrices, ~2.3 GB


def symmetric_product(A: np.ndarray, B: np.ndarray, blocks: int = 10, out: np.ndarray | None = None) -> np.ndarray:
    """A Bᵀ for a product known to be symmetric (N × N): the blocks on and above the diagonal
    are multiplied, those below are their transposes (about 0.55× the work of A @ B.T).
    `out`: an N × N float32 buffer to write into."""
    n = len(A)
    S = np.empty((n, n), dtype=np.float32) if out is None else out
    edges = [round(i * n / blocks) for i in range(blocks + 1)]
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        if a == b:
            continue
        blk = A[a:b] @ B[a:].T
        S[a:b, a:] = blk
        S[b:, a:b] = blk[:, b - a:].T
    return S


class GramSweep:
    """Scores settings on one split; `features` are the split's (normalised, as indexed) φ."""

    def __init__(self, features: np.ndarray, labels: np.ndarray, W: np.ndarray, ks=DEFAULT_KS,
                 chunk: int = 2048):
        self.phi = np.ascontiguousarray(features, dtype=np.float32)
        self.W = np.ascontiguousarray(W, dtype=np.float32)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.ks = tuple(ks)
        self.chunk = chunk
        self.R = relevant_counts(self.labels, self.labels, same_set=True)
        self.valid = np.nonzero(self.R > 0)[0]
        self.k = int(max(self.R.max(initial=0), max(self.ks)))
        self._G: np.ndarray | None = None
        self._T: np.ndarray | None = None
        # reused N × N buffers (fresh ones cost page faults each setting): the last dense or
        # spectral S, and the last diagonal restraint's S with its zeroed entries
        self._work: np.ndarray | None = None
        self._work_diag: np.ndarray | None = None
        self._nested: np.ndarray | None = None
        self._rows: torch.Tensor | None = None  # one chunk of ranked rows

    @property
    def n(self) -> int:
        return len(self.labels)

    def gram(self) -> np.ndarray:
        if self._G is None:
            self._G = self.new_gram()
        return self._G

    def low_rank(self) -> np.ndarray:
        if self._T is None:
            self._T = self.new_low_rank()
        return self._T

    def new_gram(self) -> np.ndarray:
        """ΦΦᵀ (N × N float32), computed anew."""
        return symmetric_product(self.phi, self.phi)

    def new_low_rank(self) -> np.ndarray:
        """EEᵀ with E = ΦWᵀ (N × N float32), computed anew."""
        E = self.phi @ self.W.T
        return symmetric_product(E, E)

    def _buffer(self, name: str) -> np.ndarray:
        if getattr(self, name) is None:
            setattr(self, name, np.empty((self.n, self.n), dtype=np.float32))
        return getattr(self, name)

    def scores(self, M: np.ndarray, op) -> torch.Tensor:
        """S = Φ M′ Φᵀ for M′ with its MetricOperator `op`.  Read-only, and valid until the next
        call: it may be a cached matrix or a reused buffer."""
        if op.kind == "identity":
            S = self.gram()
        elif op.kind == "lowrank":
            S = self.low_rank()
        elif op.kind == "lowrank-diag":
            S = self._diagonal(op.diag_removed)
        elif op.kind == "spectral":
            c, lam, U = op.spectral
            P = self.phi @ U
            S = symmetric_product(P * lam, P, out=self._buffer("_work"))
            if c:  # S += c G in place (no N² temporary)
                torch.from_numpy(S).add_(torch.from_numpy(self.gram()), alpha=float(c))
        else:
            S = symmetric_product(self.phi @ np.ascontiguousarray(M, dtype=np.float32), self.phi,
                                  out=self._buffer("_work"))
        return torch.from_numpy(S)

    def _diagonal(self, removed: np.ndarray) -> np.ndarray:
        """T − Φ_S D_S Φ_Sᵀ; the previous setting's S, updated in place, when its zeroed entries
        are a subset of these (one seed's draws at a growing r)."""
        removed = np.asarray(removed, dtype=np.float32)
        S, done = None, np.zeros_like(removed)
        if self._nested is not None:
            prev = self._nested
            was = prev != 0
            if np.array_equal(removed[was], prev[was]):
                S, done = self._work_diag, prev
        if S is None:
            S = self._buffer("_work_diag")
            np.copyto(S, self.low_rank())
        new = np.nonzero((removed != 0) & (done == 0))[0]
        if len(new):
            cols = np.ascontiguousarray(self.phi[:, new])
            S -= symmetric_product(cols * removed[new], cols, out=self._buffer("_work"))
        self._nested = removed
        return S

    def ranked(self, S: torch.Tensor, mode: str, k: int):
        """(rows, their top-k columns) per chunk of the queries that have a relevant item,
        ranked by S (bilinear) or S / (‖·‖_M′ ‖·‖_M′) (cosine), the query itself left out."""
        inv_x = inv_q = None
        if mode == "cosine":
            # the search path: index rows scaled by 1/‖x‖ (0 where ‖x‖ = 0), queries by 1/max(‖q‖, 1e-30)
            norms = torch.sqrt(torch.clamp(torch.diagonal(S).double(), min=0.0))
            inv_x = torch.where(norms > 0, 1.0 / torch.clamp(norms, min=1e-30), 0.0).float()
            inv_q = (1.0 / torch.clamp(norms, min=1e-30)).float()
        for s in range(0, len(self.valid), self.chunk):
            rows = self.valid[s: s + self.chunk]
            r = torch.from_numpy(rows)
            if self._rows is None or self._rows.shape[0] < len(rows):
                self._rows = torch.empty((len(rows), self.n), dtype=S.dtype)
            block = self._rows[: len(rows)]  # a copy of the rows: S stays as it is
            if rows[-1] - rows[0] == len(rows) - 1:  # contiguous rows (the usual case)
                block.copy_(S[int(rows[0]): int(rows[-1]) + 1])
            else:
                torch.index_select(S, 0, r, out=block)
            if inv_x is not None and inv_q is not None:  # set together (cosine)
                block.mul_(inv_x[None, :]).mul_(inv_q[r][:, None])
            block[torch.arange(len(rows)), r] = -float("inf")  # leave the query out
            yield rows, torch.topk(block, k, dim=1, sorted=True).indices.numpy()

    def evaluate(self, S: torch.Tensor, mode: str) -> dict:
        """Metrics of the ranking by S under `mode` (S is not modified)."""
        sums = {f"recall@{K}": 0.0 for K in self.ks} | {"precision@1": 0.0, "r_precision": 0.0, "map@r": 0.0}
        k = min(self.k, self.n - 1)
        for rows, idx in self.ranked(S, mode, k):
            nbr = self.labels[idx]
            if k < self.k:  # fewer gallery items than needed: missing ranks count as misses
                nbr = np.concatenate([nbr, np.full((len(rows), self.k - k), np.iinfo(np.int64).min)], 1)
            for key, v in per_query_metrics(nbr, self.labels[rows], self.R[rows], self.ks).items():
                sums[key] += float(v.sum())
        nq = len(self.valid)
        out = {key: (v / nq if nq else float("nan")) for key, v in sums.items()}
        return out | {"n_queries": int(nq), "n_skipped_queries": int(self.n - nq)}
