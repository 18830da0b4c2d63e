"""Posterior refinement of the metric matrix.  Adding one: a module with `@REFINEMENTS.register`,
one import line below."""
from .registry import (GRIDS, MODES, REFINEMENTS, coarse, SharedParam, file_params, grid, operator_kind, ranks_like_trained, refine,
                       seeded, shared_params, strategy_key, strategy_label, strategy_params, sweep, sweepable)

from . import paper, psd, shrinkage_spectral  # noqa: E402,F401  (registration)

__all__ = ["GRIDS", "MODES", "REFINEMENTS", "coarse", "SharedParam", "file_params", "grid", "operator_kind", "ranks_like_trained", "refine",
           "seeded", "shared_params", "strategy_key", "strategy_label", "strategy_params", "sweep", "sweepable"]
