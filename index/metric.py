"""Similarity under a metric matrix, and the matrix properties the paper's principles use.

Bilinear:  s(q, x) = φ(q)ᵀ M′ φ(x), for any symmetric M′ (PSD or indefinite).
  Exact with one inner-product index over φ(x): search it with the query M′φ(q).
Cosine:    s(q, x) / (‖φ(q)‖_M′ ‖φ(x)‖_M′), ‖v‖_M′ = sqrt(vᵀM′v); PSD M′ only.
  For M′ = M* = WᵀW this is the cosine of the embeddings Wφ.
"""
from __future__ import annotations

import numpy as np

from core.errors import UserError

PSD_TOL = 1e-8


def symmetrized(M: np.ndarray) -> np.ndarray:
    """(M + Mᵀ)/2 in float64, exactly symmetric (entry (i, j) is (a + b)/2, entry (j, i) is
    (b + a)/2: the same float).  M* = WᵀW is symmetric in exact arithmetic; this makes it so in
    floating point (a no-op where BLAS already gave an exactly symmetric product)."""
    M = np.asarray(M, dtype=np.float64)
    return (M + M.T) / 2


def check_symmetric(M: np.ndarray, d: int | None = None, what: str = "metric matrix") -> np.ndarray:
    M = np.asarray(M)
    if M.ndim != 2 or M.shape[0] != M.shape[1]:
        raise UserError(f"{what} must be square (d × d), got shape {M.shape}")
    if d is not None and M.shape[0] != d:
        raise UserError(f"{what} is {M.shape[0]} × {M.shape[1]}, but the index features have d = {d}")
    if not np.issubdtype(M.dtype, np.number):
        raise UserError(f"{what} must be numeric, got dtype {M.dtype}")
    M = M.astype(np.float64)
    if not np.isfinite(M).all():
        raise UserError(f"{what} has NaN or infinite entries")
    scale = max(1.0, float(np.abs(M).max()))
    if not np.allclose(M, M.T, atol=1e-6 * scale, rtol=0):
        raise UserError(f"{what} is not symmetric (max |M − Mᵀ| = {np.abs(M - M.T).max():.3g})")
    return symmetrized(M)


def matrix_report(M: np.ndarray, eigenvalues: np.ndarray | None = None) -> dict:
    """Trace, norms, the principle ratios, and positive semi-definiteness (`eigenvalues`:
    M's, where already computed)."""
    M = np.asarray(M, dtype=np.float64)
    tr = float(np.trace(M))
    fro = float(np.linalg.norm(M))
    off = M - np.diag(np.diag(M))
    ev = np.linalg.eigvalsh(M) if eigenvalues is None else np.asarray(eigenvalues, dtype=np.float64)
    lam_max = float(np.abs(ev).max()) if ev.size else 0.0
    return {
        "trace": tr,
        "frobenius": fro,
        "offdiag_frobenius": float(np.linalg.norm(off)),
        "trace_over_frobenius": tr / fro if fro else float("nan"),    # principle 1: smaller trace
        "frobenius_over_trace": fro / tr if tr else float("nan"),     # principle 2: smaller ‖M‖_F at fixed trace
        "min_eigenvalue": float(ev.min()) if ev.size else 0.0,
        "rank": int((ev > PSD_TOL * max(lam_max, 1e-300)).sum()),
        "psd": bool(ev.min() >= -PSD_TOL * max(lam_max, 1e-300)) if ev.size else True,
    }


