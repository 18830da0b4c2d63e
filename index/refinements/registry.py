"""Refinement registry: a strategy maps the trained M* (d × d) to M′.

A new strategy is one module with @register plus one import line.  Each has a
parameter dataclass; random strategies take a seed and are reproducible.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Callable

import numpy as np

from core.errors import UserError


@dataclass
class Strategy:
    name: str
    params: type
    fn: Callable[..., np.ndarray]
    doc: str


STRATEGIES: dict[str, Strategy] = {}


def register(name: str, params: type):
    def deco(fn):
        STRATEGIES[name] = Strategy(name, params, fn, (fn.__doc__ or "").strip().splitlines()[0])
        return fn
    return deco


def strategy_params(name: str, given: dict | None = None):
    """The strategy's parameter object from a dict, ignoring keys it does not take."""
    if name not in STRATEGIES:
        raise UserError(f"unknown strategy {name!r}; choose from {sorted(STRATEGIES)}")
    cls = STRATEGIES[name].params
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        if given and given.get(f.name) is not None:
            try:
                kw[f.name] = hints[f.name](given[f.name])
            except (TypeError, ValueError):
                raise UserError(f"strategy {name}: {f.name}={given[f.name]!r} is not a "
                                f"{hints[f.name].__name__}") from None
    p = cls(**kw)
    if hasattr(p, "validate"):
        p.validate()
    return p


def refine(name: str, M_star: np.ndarray, params=None) -> np.ndarray:
    """M′ = strategy(M*); `params` is a dict or the strategy's parameter object."""
    if params is None or isinstance(params, dict):
        params = strategy_params(name, params)
    M = STRATEGIES[name].fn(np.asarray(M_star, dtype=np.float64), params)
    return (M + M.T) / 2  # exactly symmetric


def strategy_key(name: str, params) -> tuple:
    """Hashable identity of (strategy, parameters), for caches."""
    if isinstance(params, dict):
        params = strategy_params(name, params)
    return (name, tuple(sorted(dataclasses.asdict(params).items())))
