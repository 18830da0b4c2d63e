"""Applying M′ to query vectors cheaply, exactly.

The query transform q ↦ M′q is the only per-query cost that exact search
under M′ adds to a plain inner-product search.  Many refinements have
structure that makes it much cheaper than a dense d × d product; a strategy
declares its kind in its registry entry (`operator=`):
  identity          q                        (M′ = I)
  lowrank           Wᵀ(Wq)                   (M′ = M*, rank k ≪ d)
  lowrank-diag      Wᵀ(Wq) − D q             (D = the zeroed diagonal entries of M*)
  spectral          c q + U(Λ(Uᵀq))          (M′ = cI + UΛUᵀ, rank(U) ≪ d: spectral powers,
                                              shrinkage, PSD readings of the restraints; found
                                              from M′'s eigendecomposition, else dense)
  dense             M′q                      (anything else)
The structured forms are exact (float32 round-off aside).  The batched sweep
(index/analysis/sweep.py) uses the same structure for Φ M′ Φᵀ.
"""
from __future__ import annotations

import numpy as np

# eigenvalues within this (relative to the largest |λ|) of the shared value c count as c
SPECTRAL_TOL = 1e-9


def identity_plus_low_rank(lam: np.ndarray, U: np.ndarray, tol: float = SPECTRAL_TOL):
    """(c, Λ_r − c, U_r) with M′ = cI + U_r(Λ_r − c)U_rᵀ, c the most common eigenvalue
    (the median: it holds more than half of them when the rest is low rank), or None when
    the low-rank part would hold half of the spectrum or more."""
    d = len(lam)
    c = float(np.median(lam))
    scale = max(float(np.abs(lam).max()), 1e-300)
    if abs(c) <= tol * scale:
        c = 0.0  # round-off of a zero eigenvalue: no identity part (which would cost Φ Φᵀ in a sweep)
    rest = np.abs(lam - c) > tol * scale
    if 2 * int(rest.sum()) >= d:
        return None
    return c, lam[rest] - c, U[:, rest]


class MetricOperator:
    def __init__(self, M: np.ndarray, W: np.ndarray | None = None, diag_removed: np.ndarray | None = None,
                 kind: str = "dense", spectral: tuple | None = None, eigenvalues: np.ndarray | None = None):
        self.kind = kind
        # float32 M′ only where it is applied densely (structured kinds never read it)
        self.M32: np.ndarray | None = np.ascontiguousarray(M, dtype=np.float32) if kind == "dense" else None
        self.W32: np.ndarray | None = None if W is None else np.ascontiguousarray(W, dtype=np.float32)
        self.WT32: np.ndarray | None = None if W is None else np.ascontiguousarray(W.T, dtype=np.float32)
        self.diag_removed: np.ndarray | None = None if diag_removed is None else diag_removed.astype(np.float32)
        # spectral: (c, λ_r − c, U_r) in float32; eigenvalues (float64) spare matrix_report an eigvalsh
        self.spectral: tuple[float, np.ndarray, np.ndarray] | None = None if spectral is None else (
            float(spectral[0]), spectral[1].astype(np.float32), np.ascontiguousarray(spectral[2], dtype=np.float32))
        self.eigenvalues = eigenvalues

    @classmethod
    def build(cls, kind: str, M: np.ndarray, W: np.ndarray, M_star: np.ndarray) -> MetricOperator:
        """The cheapest exact operator for M′ of the strategy's declared `kind` (its registry
        entry's `operator`); the low-rank forms only where they are cheaper than dense."""
        d = M.shape[0]
        if kind == "identity":
            return cls(M, kind="identity", eigenvalues=np.ones(d))
        k = W.shape[0]
        lowrank_cheaper = 2 * k < d
        if kind == "lowrank" and lowrank_cheaper:
            # M* = WᵀW: its eigenvalues are W's squared singular values, and d − k zeros
            sv = np.linalg.svd(np.asarray(W, dtype=np.float64), compute_uv=False)
            return cls(M, W=W, kind="lowrank", eigenvalues=np.sort(np.concatenate([sv ** 2, np.zeros(d - len(sv))])))
        if kind == "lowrank-diag" and lowrank_cheaper:
            diff = M - M_star  # one d × d temporary: is M′ − M* diagonal?
            np.fill_diagonal(diff, 0.0)
            if not diff.any():
                return cls(M, W=W, diag_removed=np.diag(M_star) - np.diag(M), kind="lowrank-diag")
        if kind == "spectral":
            lam, U = np.linalg.eigh(np.asarray(M, dtype=np.float64))
            parts = identity_plus_low_rank(lam, U)
            if parts is not None:
                return cls(M, kind="spectral", spectral=parts, eigenvalues=lam)
            return cls(M, kind="dense", eigenvalues=lam)
        return cls(M, kind="dense")

    def arrays(self) -> list[np.ndarray]:
        """The arrays this operator holds: what it weighs in the memory cache's budget."""
        parts = [self.M32, self.W32, self.WT32, self.diag_removed, self.eigenvalues,
                 *(() if self.spectral is None else self.spectral[1:])]
        return [a for a in parts if isinstance(a, np.ndarray)]

    def apply(self, Q: np.ndarray) -> np.ndarray:
        """Rows of Q (n × d) ↦ rows of Q M′ (= (M′q)ᵀ since M′ is symmetric), float32."""
        Q = np.ascontiguousarray(Q, dtype=np.float32)
        if self.kind == "identity":
            return Q
        if self.kind == "lowrank":
            assert self.WT32 is not None and self.W32 is not None  # `build` gives W with this kind
            return (Q @ self.WT32) @ self.W32
        if self.kind == "lowrank-diag":
            assert self.WT32 is not None and self.W32 is not None and self.diag_removed is not None  # as `build` gives
            return (Q @ self.WT32) @ self.W32 - Q * self.diag_removed
        if self.kind == "spectral":
            assert self.spectral is not None  # `build` gives the parts with this kind
            c, lam, U = self.spectral
            out = ((Q @ U) * lam) @ U.T
            return out + c * Q if c else out
        assert self.M32 is not None  # kept for the dense kind (the only other)
        return Q @ self.M32

    def m_norms(self, X: np.ndarray, chunk: int = 8192) -> np.ndarray:
        return apply_norms(self.apply, X, chunk)


def apply_norms(apply, X: np.ndarray, chunk: int = 8192) -> np.ndarray:
    """‖x‖_M′ = sqrt(xᵀM′x) per row (PSD M′) through an operator's `apply` (rows x ↦ x M′): for
    the low-rank and spectral forms this costs N·d·k instead of N·d²."""
    out = np.empty(len(X), dtype=np.float64)
    for s in range(0, len(X), chunk):
        x = np.asarray(X[s: s + chunk], dtype=np.float32)
        out[s: s + len(x)] = np.einsum("ij,ij->i", apply(x).astype(np.float64), x.astype(np.float64))
    return np.sqrt(np.maximum(out, 0.0))
