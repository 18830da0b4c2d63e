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
    except Exception as e:  # noqa: BLE001 - truncated or not .npy at all
        raise UserError(f"cannot read {what} file {p}: {e}") from None


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm, float32 (all-zero rows stay zero)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
