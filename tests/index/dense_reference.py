"""Dense reference computations the index tests check the structured ones against."""
import numpy as np


def m_norms(X: np.ndarray, M: np.ndarray) -> np.ndarray:
    """‖x‖_M = sqrt(xᵀ M x) per row, in float64 with the full matrix."""
    X = np.asarray(X, dtype=np.float64)
    return np.sqrt(np.maximum(np.einsum("ij,ij->i", X @ np.asarray(M, dtype=np.float64), X), 0.0))
