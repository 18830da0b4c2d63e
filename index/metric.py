"""Similarity under a metric matrix, the matrix properties the paper's principles use, and
what every search backend shares of it: the modes, the cosine fallback, `QueryMetric`.

Bilinear:  s(q, x) = φ(q)ᵀ M′ φ(x), for any symmetric M′ (PSD or indefinite).
  Exact with one inner-product index over φ(x): search it with the query M′φ(q).
Cosine:    s(q, x) / (‖φ(q)‖_M′ ‖φ(x)‖_M′), ‖v‖_M′ = sqrt(vᵀM′v); PSD M′ only.
  For M′ = M* = WᵀW this is the cosine of the embeddings Wφ.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from core.errors import UserError

from .operator import MetricOperator, apply_norms

PSD_TOL = 1e-8
MODES = ("bilinear", "cosine")
COSINE_FALLBACK = "cosine is undefined for this indefinite M′: showing bilinear"


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


# psd_factor's tolerances, relative to the largest |eigenvalue|: an eigenvalue below −INDEFINITE_TOL
# is a real negative direction (round-off of a PSD M′ stays far above it); one at or below
# NULL_TOL is the null space, which adds nothing to any inner product
INDEFINITE_TOL, NULL_TOL = 1e-6, 1e-9


def psd_factor(M: np.ndarray) -> np.ndarray | None:
    """F (d × r, float32) with M = F Fᵀ, r the number of eigenvalues above NULL_TOL (the null
    space dropped), so φ(q)ᵀMφ(x) = (Fᵀφ(q))·(Fᵀφ(x)) and ‖x‖_M = ‖Fᵀx‖; None where M is
    indefinite (an eigenvalue below −INDEFINITE_TOL).  Every factor of M′ in the product
    (on-disk cosine lists, re-rankers' approximate neighbour lists) is this one."""
    w, V = np.linalg.eigh(symmetrized(M))
    scale = max(float(np.abs(w).max(initial=0.0)), 1e-300)
    if w.min(initial=0.0) < -INDEFINITE_TOL * scale:
        return None
    keep = w > NULL_TOL * scale
    return np.ascontiguousarray(V[:, keep] * np.sqrt(w[keep]), dtype=np.float32)


def resolve_mode(mode: str, is_psd: Callable[[], bool]) -> tuple[str, str]:
    """(mode actually used, note): cosine is undefined for an indefinite M′, which is then
    ranked bilinearly, and said so.  Every backend resolves through this, so the CLI, the API
    and the app fall back alike.  `is_psd` is called only when it matters (cosine)."""
    if mode == "cosine" and not is_psd():
        return "bilinear", COSINE_FALLBACK
    return mode, ""


@dataclass(eq=False)
class QueryMetric:
    """M′ prepared for querying: q ↦ M′q (cosine: divided by ‖q‖_M′) and candidates' ‖x‖_M′.
    The backends that re-rank candidates read from disk or a database (on-disk IVF, Milvus)
    search with it; a strategy's is made from its cached M′ (gallery.strategy_metric)."""
    M: np.ndarray                              # d × d, symmetric, float64
    mode: str
    apply: Callable[[np.ndarray], np.ndarray]  # rows Q ↦ rows of Q M′, float32

    @classmethod
    def build(cls, M: np.ndarray, mode: str = "bilinear", d: int | None = None,
              apply: Callable[[np.ndarray], np.ndarray] | None = None) -> QueryMetric:
        """`apply` may be a structured MetricOperator's (cheaper for low-rank M′); dense otherwise."""
        if mode not in MODES:
            raise UserError(f"mode must be one of {MODES}, got {mode!r}")
        M = check_symmetric(M, d, "M′")
        return cls.of(M, mode, apply or MetricOperator(M).apply, lambda: matrix_report(M))

    @classmethod
    def of(cls, M: np.ndarray, mode: str, apply: Callable[[np.ndarray], np.ndarray],
           report: Callable[[], dict]) -> QueryMetric:
        """An exactly symmetric M′ (a strategy's, from `refine`) with its operator's `apply`;
        `report()` gives its `matrix_report`, read only in cosine mode, which needs a PSD M′."""
        if mode not in MODES:
            raise UserError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "cosine":
            rep = report()
            if not rep["psd"]:
                raise UserError(f"cosine mode needs a positive semi-definite M′; this one is indefinite "
                                f"(min eigenvalue {rep['min_eigenvalue']:.3g}). Use mode bilinear.")
        return cls(M, mode, apply)

    def transform(self, Q: np.ndarray) -> np.ndarray:
        qt = self.apply(Q)
        if self.mode == "bilinear":
            return qt
        qn = np.sqrt(np.maximum(np.einsum("ij,ij->i", qt.astype(np.float64), Q.astype(np.float64)), 0))
        return (qt / np.maximum(qn, 1e-30)[:, None]).astype(np.float32)

    def norms(self, X: np.ndarray) -> np.ndarray | None:
        """‖x‖_M′ of the given rows (cosine), None in bilinear mode."""
        return apply_norms(self.apply, X) if self.mode == "cosine" else None

    def candidate_count(self, k: int, n_items: int, rerank_factor: int) -> int:
        # cosine candidates come from the raw inner product, blind to 1/‖x‖_M′: fetch more
        factor = rerank_factor * (4 if self.mode == "cosine" else 1)
        return min(n_items, max(k * factor, 64))
