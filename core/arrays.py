"""Reading user arrays without ever unpickling them."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import UserError


def load_npy(path, what: str, mmap: bool = False) -> np.ndarray:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{what} file not found: {p}")
    try:
        return np.load(p, allow_pickle=False, mmap_mode="r" if mmap else None)
    except ValueError as e:
        raise UserError(f"{what} file {p} is not a plain .npy array ({e})") from None
    except Exception as e:
        raise UserError(f"cannot read {what} file {p}: {e}") from None


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm, float32 (all-zero rows stay zero)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


# ---------------------------------------------------------------- validation of user arrays
# Every array a user hands us is checked here, with a message naming it (`what`, e.g.
# "features file F.npy") and the problem: dtype, shape, finiteness, range.
_F32_MAX = float(np.finfo(np.float32).max)


def check_numeric(a, what: str) -> np.ndarray:
    """Refuse strings, objects and booleans: only integer and float arrays are data."""
    a = np.asarray(a)
    if not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)):
        raise UserError(f"{what} must hold numbers, got dtype {a.dtype}")
    return a


def check_finite(a, what: str, chunk: int = 65536) -> None:
    """Refuse NaN and ±inf in a 1-D or 2-D array (read in row chunks: `a` may be a large memory map)."""
    for s in range(0, len(a), chunk):
        part = np.asarray(a[s: s + chunk])
        ok = np.isfinite(part).reshape(len(part), -1).all(axis=1)
        if not ok.all():
            raise UserError(f"{what} contains NaN or infinite values (first at row {s + int(np.argmin(ok))})")


def check_matrix(a, what: str, *, cols: int | None = None, allow_1d: bool = False,
                 min_rows: int = 1) -> np.ndarray:
    """A numeric n × d matrix (a 1-D vector is one row if `allow_1d`) whose values are finite
    in float32, with at least `min_rows` rows and `cols` columns; returned as float32."""
    a = check_numeric(a, what)
    if a.ndim == 1 and allow_1d:
        a = a[None, :]
    if a.ndim != 2:
        want = "1-D (d) or 2-D (n × d)" if allow_1d else "2-D (n × d)"
        raise UserError(f"{what} must be {want}, got shape {a.shape}")
    if len(a) < min_rows:
        raise UserError(f"{what} has {len(a)} rows; at least {min_rows} needed")
    if cols is not None and a.shape[1] != cols:
        raise UserError(f"{what} has {a.shape[1]} columns; {cols} expected")
    check_finite(a, what)
    with np.errstate(over="ignore"):
        out = np.ascontiguousarray(a, dtype=np.float32)
    if not np.isfinite(out).all():
        raise UserError(f"{what} has values beyond the float32 range (|x| > {_F32_MAX:.3g})")
    return out


def check_labels(a, what: str, n: int | None = None) -> np.ndarray:
    """Integer class labels, 1-D, `n` of them; float labels are accepted only when integral."""
    a = check_numeric(a, what)
    if a.ndim != 1:
        raise UserError(f"{what} must be 1-D (one label per row), got shape {a.shape}")
    if n is not None and len(a) != n:
        raise UserError(f"{what} has {len(a)} labels for {n} rows")
    if np.issubdtype(a.dtype, np.floating):
        check_finite(a, what)
        frac = a != np.round(a)
        if frac.any():
            raise UserError(f"{what} must be integer class labels; entry {int(np.argmax(frac))} "
                            f"is {float(a[np.argmax(frac)])!r}")
        if len(a) and np.abs(a).max() >= 2 ** 63:
            raise UserError(f"{what} has labels beyond the int64 range")
    return a.astype(np.int64)


def check_rankable(x: np.ndarray, what: str) -> None:
    """Refuse float32 rows that cannot be ranked by: all zeros (no direction: every score would
    be equal) or so large that their norm overflows float32."""
    with np.errstate(over="ignore"):
        norms = np.linalg.norm(np.asarray(x, dtype=np.float32), axis=1)
    for bad, problem in ((norms == 0, "is all zeros: every item would score the same"),
                         (~np.isfinite(norms), "is too large: its norm overflows float32")):
        if bad.any():
            raise UserError(f"{what}: row {int(np.argmax(bad))} {problem}")
