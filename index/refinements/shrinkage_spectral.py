"""Refinements beyond the paper: shrinkage towards the identity (`shrink`), and spectral powers (`spectral`)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from core.errors import UserError
from core.memory import CACHE
from core.params import param

from .registry import REFINEMENTS


@dataclass
class ShrinkParams:
    alpha: float = param(0.5, "shrink weight α towards the identity", bounds="[0, 1]", step=0.05)


@REFINEMENTS.register(
    "shrink",
    ShrinkParams,
    operator="spectral",
    grid={"alpha": (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)},
    trained_at={"alpha": 0.0},
    exact_symmetry=True,
)
def shrink(M: np.ndarray, p: ShrinkParams) -> np.ndarray:
    """Shrinkage: M′ = (1 − α)·M*/tr(M*) + α·I/d (both terms have unit trace)."""
    d = M.shape[0]
    tr = float(np.trace(M))
    if tr <= 0:
        raise UserError("shrink needs tr(M*) > 0")
    return (1.0 - p.alpha) * M / tr + p.alpha * np.eye(d) / d


def _eigh(M: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """M*'s eigendecomposition, computed once per M* (keyed by a digest of its values) in the
    process's memory cache however many threads ask: a sweep over p decomposes M* once."""
    digest = hashlib.blake2b(np.ascontiguousarray(M).tobytes(), digest_size=16).hexdigest()
    return CACHE.get_or_build(("eigh", M.shape, str(M.dtype), digest), lambda: np.linalg.eigh(M))


@dataclass
class SpectralParams:
    p: float = param(0.5, "spectral power p", bounds="[0, 4]", step=0.05)


@REFINEMENTS.register(
    "spectral", SpectralParams, operator="spectral", grid={"p": (0.0, 0.25, 0.5, 0.75, 1.0, 1.5)}, trained_at={"p": 1.0}
)
def spectral(M: np.ndarray, p: SpectralParams) -> np.ndarray:
    """Spectral power: M* = UΛUᵀ → UΛᵖUᵀ; p = 1 is M*, p = 0 the projector onto its range."""
    lam, U = _eigh(M)
    lam = np.clip(lam, 0.0, None)  # M* = WᵀW is PSD; clip round-off negatives
    keep = lam > 1e-10 * max(float(lam.max()), 1e-300)
    powered = np.where(keep, np.power(np.where(keep, lam, 1.0), p.p), 0.0)
    return (U * powered) @ U.T
