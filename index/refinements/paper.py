"""The paper's refinements (004): trained, identity, diagonal and random restraint, custom.

Restraints follow §4.2: set a randomly chosen non-zero diagonal entry (or a
random symmetric off-diagonal pair) to zero, repeatedly, until
tr(M′) ≤ (1 − r)·tr(M*)   (diagonal)   or
‖M′_off‖_F ≤ (1 − r)·‖M*_off‖_F   (random; the diagonal is untouched).
Drawing entries one at a time without replacement is the same as walking a
random permutation, so we permute once and cut at the first prefix that meets
the rule: O(d²) instead of a loop of d² draws.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.arrays import check_matrix, load_npy
from core.errors import UserError
from core.memory import CACHE
from core.params import param
from core.registry import NoParams

from ..metric import check_symmetric
from .registry import REFINEMENTS

R_GRID = tuple(round(0.1 * i, 1) for i in range(11))


@REFINEMENTS.register("trained", operator="lowrank", trained_at={}, exact_symmetry=True)
def trained(M: np.ndarray, p: NoParams) -> np.ndarray:
    """The trained metric M* = WᵀW."""
    return M.copy()


@REFINEMENTS.register("identity", operator="identity", exact_symmetry=True)
def identity(M: np.ndarray, p: NoParams) -> np.ndarray:
    """The identity on the trunk features, regardless of M*."""
    return np.eye(M.shape[0])


@dataclass
class RestraintParams:
    r: float = param(0.5, "restraint degree", bounds="[0, 1]", step=0.05)
    seed: int = param(0, "seed of the random draws", bounds="[0, inf)")  # numpy's generators take no negatives


def _cut(amounts: np.ndarray, total: float, target: float, in_place: bool = False) -> int:
    """Smallest number of leading entries to remove so that total − removed ≤ target
    (`in_place`: the running sums overwrite `amounts`, sparing a copy of it)."""
    tol = 1e-12 * max(abs(total), 1.0)
    if total <= target + tol:
        return 0
    monotone = len(amounts) and amounts.min() >= 0
    removed = np.cumsum(amounts, out=amounts if in_place else None)
    if monotone:
        # total − removed only falls: bisect for the first hit instead of testing every prefix
        lo, hi = 0, len(removed)         # no hit before lo; the first hit, if any, is before hi
        while lo < hi:
            mid = (lo + hi) // 2
            if total - removed[mid] <= target + tol:
                hi = mid
            else:
                lo = mid + 1
        return lo + 1 if lo < len(removed) else len(amounts)
    hit = np.nonzero(total - removed <= target + tol)[0]
    return int(hit[0]) + 1 if hit.size else len(amounts)


@REFINEMENTS.register("diagonal", RestraintParams, operator="lowrank-diag", grid={"r": R_GRID},
                      modes=("bilinear",), trained_at={"r": 0.0}, exact_symmetry=True)
def diagonal(M: np.ndarray, p: RestraintParams) -> np.ndarray:
    """Diagonal restraint: zero random diagonal entries until tr(M′) ≤ (1 − r)·tr(M*)."""
    out = M.copy()
    diag = np.diag(M)
    nz = np.nonzero(diag != 0)[0]
    order = np.random.default_rng(p.seed).permutation(nz)
    if p.r >= 1.0:
        n = len(order)  # r = 1: the whole diagonal
    else:
        total = float(diag.sum())
        n = _cut(diag[order], total, (1.0 - p.r) * total, in_place=True)
    idx = order[:n]
    out[idx, idx] = 0.0
    return out


@REFINEMENTS.register("random", RestraintParams, grid={"r": R_GRID}, modes=("bilinear",), trained_at={"r": 0.0},
                      exact_symmetry=True)
def random_restraint(M: np.ndarray, p: RestraintParams) -> np.ndarray:
    """Random restraint: zero random symmetric off-diagonal pairs until ‖M′_off‖_F ≤ (1 − r)·‖M*_off‖_F."""
    upper, lower = _pair_indices(M.shape[0])
    vals = np.take(M, upper)             # the upper triangle, row by row (as np.triu_indices)
    order = np.flatnonzero(vals)
    np.random.default_rng(p.seed).shuffle(order)  # in place: the same draws as .permutation(), no copy
    sq = vals[order]
    np.square(sq, out=sq)
    sq *= 2.0                            # each pair holds two entries
    total = float(sq.sum())              # ‖M*_off‖_F²
    if p.r >= 1.0:
        n = len(order)
    else:
        n = _cut(sq, total, (1.0 - p.r) ** 2 * total, in_place=True)
    vals[order[:n]] = 0.0                # the drawn pairs, zeroed among the d(d − 1)/2 pairs, not in the d² matrix
    out = M.copy()
    flat = out.reshape(-1)               # a view: write each pair to both its entries, in row order
    flat[upper] = vals
    flat[lower] = vals
    return out


def _pair_indices(d: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat positions of the off-diagonal pairs (i < j): (i·d + j, j·d + i), in np.triu_indices'
    order, read-only.  Built once per d in the process's memory cache: the app draws a new random
    restraint per seed, and these are d² / 2 each."""
    def build():
        iu, ju = np.triu_indices(d, k=1)
        upper, lower = iu * d + ju, ju * d + iu
        upper.flags.writeable = lower.flags.writeable = False
        return upper, lower
    return CACHE.get_or_build(("pair-indices", int(d)), build)


@dataclass
class CustomParams:
    path: str = param("", "a symmetric d × d .npy matrix file", flag="metric-matrix", file=(".npy",),
                      label=lambda v: f"file={Path(v).name}")

    def validate(self):
        if not self.path:
            raise UserError("strategy custom needs a matrix file (--metric-matrix M.npy)")


@REFINEMENTS.register("custom", CustomParams, exact_symmetry=True)  # check_symmetric averages it
def custom(M: np.ndarray, p: CustomParams) -> np.ndarray:
    """A user-supplied symmetric d × d matrix (.npy, never unpickled)."""
    what = f"custom matrix {p.path}"
    user = load_npy(p.path, "metric matrix")
    check_matrix(user, what)  # numeric, finite, and within float32, the precision searches run in
    return check_symmetric(user, d=M.shape[0], what=what)
