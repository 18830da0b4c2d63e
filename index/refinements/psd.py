"""PSD readings of the restraints' M′ (beyond the paper): its absolute value, or its
negative eigenvalues clipped to 0.

The paper takes every refined M′ to be positive semi-definite (§2.2, §3), but zeroing
entries of M* = WᵀW (§4.2) makes M′ indefinite in general (diagonal restraint always, once a
zeroed entry's row has a non-zero off-diagonal entry: a PSD matrix with a zero diagonal entry
has a zero row there), and the paper does not say how such an M′ is scored; the raw
restraints (`diagonal`, `random`, the paper's) rank it bilinearly.  With
the restrained M′ = V diag(μ) Vᵀ:
  abs   |M′| = V diag(|μ|) Vᵀ          (the positive part of M′'s polar decomposition)
  clip  V diag(max(μ, 0)) Vᵀ          (the PSD matrix nearest to M′ in Frobenius norm)
Both are PSD, so they also have a cosine.  The draws (r, seed) are the raw restraint's: at
equal parameters the reading starts from exactly the raw strategy's M′.
"""
from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from core.params import param

from ..metric import symmetrized
from .paper import R_GRID, RestraintParams, diagonal, random_restraint
from .registry import REFINEMENTS

Reading = Literal["abs", "clip"]
READINGS: tuple[str, ...] = typing.get_args(Reading)


@dataclass
class ReadingParams(RestraintParams):
    psd: Reading = param("abs", "PSD reading of the restrained M′ = VΛVᵀ: abs = V|Λ|Vᵀ, clip = V·max(Λ, 0)·Vᵀ")


def psd_reading(M: np.ndarray, how: str) -> np.ndarray:
    """V f(μ) Vᵀ for the symmetric M = V diag(μ) Vᵀ, f = |·| (abs) or max(·, 0) (clip);
    exactly symmetric (the product is not, in floating point)."""
    mu, V = np.linalg.eigh(M)
    lam = np.abs(mu) if how == "abs" else np.maximum(mu, 0.0)
    return symmetrized((V * lam) @ V.T)


# operator: clip of a diagonal restraint keeps at most rank(M*) eigenvalues, abs at most
# rank(M*) + the zeroed entries: "spectral" finds such a low-rank form, else applies M′ densely.
# trained_at r = 0: M′ = M* is PSD, so either reading returns it (round-off aside).
_META: dict[str, Any] = dict(operator="spectral", grid={"r": R_GRID, "psd": READINGS}, trained_at={"r": 0.0},
                             exact_symmetry=True)


@REFINEMENTS.register("diagonal-psd", ReadingParams, **_META)
def diagonal_psd(M: np.ndarray, p: ReadingParams) -> np.ndarray:
    """Diagonal restraint's M′ read as PSD (beyond the paper): |M′| (abs) or its negative eigenvalues set to 0
    (clip)."""
    return psd_reading(diagonal(M, p), p.psd)


@REFINEMENTS.register("random-psd", ReadingParams, **_META)
def random_psd(M: np.ndarray, p: ReadingParams) -> np.ndarray:
    """Random restraint's M′ read as PSD (beyond the paper): |M′| (abs) or its negative eigenvalues set to 0 (clip)."""
    return psd_reading(random_restraint(M, p), p.psd)
