"""Regularizer registry.  A new regularizer: one module with `@REGULARIZERS.register(...)` over
its class (`weight=`: its default weight; see `RegularizerSpec`), plus one import line here."""
from __future__ import annotations

from . import cgml, determinant, nir, skewed_mean  # noqa: F401  (registration)
from .base import BatchContext, Regularizer
from .registry import REGULARIZERS, build_regularizers, regularizer_params

__all__ = ["REGULARIZERS", "BatchContext", "Regularizer", "build_regularizers", "regularizer_params"]
