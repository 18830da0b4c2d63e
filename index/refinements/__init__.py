"""Posterior refinement of the metric matrix.  Adding one: a module with @register, one import line."""
from .registry import STRATEGIES, refine, register, strategy_key, strategy_params

from . import beyond, paper  # noqa: E402,F401  (registration)

__all__ = ["STRATEGIES", "refine", "register", "strategy_key", "strategy_params"]
