"""Applying M′ to query vectors cheaply, exactly.

The query transform q ↦ M′q is the only per-query cost that exact search
under M′ adds to a plain inner-product search.  Many refinements have
structure that makes it much cheaper than a dense d × d product; a strategy
declares its kind in its registry entry (`operator=`):
  identity          q                        (M′ = I)
  lowrank           Wᵀ(Wq)                   (M′ = M*, rank k ≪ d)
  lowrank-diag      Wᵀ(Wq) − D q             (D = the zeroed diagonal entries of M*)
  dense             M′q                      (anything else)
The structured forms are exact (float32 round-off aside).
"""
from __future__ import annotations

import numpy as np


class MetricOperator:
    def __init__(self, M: np.ndarray, W: np.ndarray | None = None, diag_removed: np.ndarray | None = None,
                 kind: str = "dense"):
        self.kind = kind
        self.M32 = np.ascontiguousarray(M, dtype=np.float32)
        self.W32 = None if W is None else np.ascontiguousarray(W, dtype=np.float32)
        self.WT32 = None if W is None else np.ascontiguousarray(W.T, dtype=np.float32)
        self.diag_removed = None if diag_removed is None else diag_removed.astype(np.float32)

    @classmethod
    def build(cls, kind: str, M: np.ndarray, W: np.ndarray, M_star: np.ndarray) -> "MetricOperator":
        """The cheapest exact operator for M′ of the strategy's declared `kind` (its registry
        entry's `operator`); the low-rank forms only where they are cheaper than dense."""
        d = M.shape[0]
        if kind == "identity":
            return cls(M, kind="identity")
        k = W.shape[0]
        lowrank_cheaper = 2 * k < d
        if kind == "lowrank" and lowrank_cheaper:
            return cls(M, W=W, kind="lowrank")
        if kind == "lowrank-diag" and lowrank_cheaper:
            off_equal = np.array_equal(M - np.diag(np.diag(M)), M_star - np.diag(np.diag(M_star)))
            if off_equal:
                return cls(M, W=W, diag_removed=np.diag(M_star) - np.diag(M), kind="lowrank-diag")
        return cls(M, kind="dense")

    def apply(self, Q: np.ndarray) -> np.ndarray:
        """Rows of Q (n × d) ↦ rows of Q M′ (= (M′q)ᵀ since M′ is symmetric), float32."""
        Q = np.ascontiguousarray(Q, dtype=np.float32)
        if self.kind == "identity":
            return Q
        if self.kind == "lowrank":
            return (Q @ self.WT32) @ self.W32
        if self.kind == "lowrank-diag":
            return (Q @ self.WT32) @ self.W32 - Q * self.diag_removed
        return Q @ self.M32
