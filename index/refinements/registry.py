"""Refinement strategies on the one Registry: a strategy maps the trained M* (d × d) to M′.

A new strategy is one module with `@REFINEMENTS.register(...)` plus one import line in
`index/refinements/__init__.py`.  Its entry is the only place the strategy is written
down; the CLI flags, the app's controls, the search operator, the evaluation sweep and
every label come from it:

- params: a dataclass whose fields are declared with `core.params.param`: help (always);
  `bounds` (validation, and the app's slider or number box); `step` (the slider's); `flag` (the
  CLI flag, when it is not the field name); `file` (the suffixes of a file the user supplies,
  e.g. (".npy",): an upload in the app); `label` (value ↦ text in labels).
  A `seed` field makes the strategy random: it is reproducible and swept over seeds.
- the registration's keywords: the fields of `StrategySpec` (operator, grid, modes,
  trained_at, exact_symmetry).
A strategy with a file parameter is never swept: there is no file to sweep it with.
"""
from __future__ import annotations

import dataclasses
import itertools
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from core.registry import Registry, Spec

from ..metric import MODES, symmetrized

Operator = Literal["identity", "lowrank", "lowrank-diag", "spectral", "dense"]


@dataclass(frozen=True, kw_only=True)
class StrategySpec(Spec):
    """A refinement strategy's registration.

    operator: how M′q is applied cheaply (index/operator.py): "identity" (M′ = I), "lowrank"
        (M′ = M* = WᵀW), "lowrank-diag" (M* with diagonal entries zeroed), "spectral" (M′ = cI +
        a low-rank part, found from its eigendecomposition), "dense".
    grid: {param: values} that `python -m index evaluate` sweeps (every combination); empty:
        the strategy is swept once at its defaults.
    modes: the modes swept.
    trained_at: {param: value} at which M′ ranks exactly like M* (a positive multiple of it;
        `{}`: always).  Such rows are not refinements.  None: at no parameters.
    exact_symmetry: the builder maps an exactly symmetric M* to an exactly symmetric M′ (it
        treats entry (i, j) as it treats (j, i)): `refine` then gives it an exactly symmetric M*
        and does not average M′ with M′ᵀ, a d × d pass per new M′.
    """
    operator: Operator = "dense"
    grid: Mapping[str, tuple] = field(default_factory=dict)
    modes: tuple[str, ...] = MODES
    trained_at: Mapping[str, Any] | None = None
    exact_symmetry: bool = False

    def check(self, entry) -> None:
        super().check(entry)
        names = {f.name for f in dataclasses.fields(entry.params)}
        for what, keys in (("grid", self.grid), ("trained_at", self.trained_at or {})):
            unknown = sorted(set(keys) - names)
            if unknown:
                raise ValueError(f"{entry.what}: {what} names {unknown}, which are not its parameters "
                                 f"{sorted(names)}")
        if not self.modes or not set(self.modes) <= set(MODES):
            raise ValueError(f"{entry.what}: modes must be some of {list(MODES)}, got {self.modes!r}")


REFINEMENTS = Registry("refinement strategy", "refinement strategies", spec=StrategySpec)


def strategy_params(name: str, given: dict | None = None):
    """The strategy's typed parameter object from a dict, ignoring keys it does not take
    (callers pass every strategy's values at once: the CLI flags, the app's controls)."""
    return REFINEMENTS.params(name, given or {}, ignore_unknown=True)


def refine(name: str, M_star: np.ndarray, params=None, *, symmetric: bool = False) -> np.ndarray:
    """M′ = strategy(M*), exactly symmetric; `params` is a dict or the strategy's parameter
    object.  `symmetric=True`: the caller vouches that M_star equals its transpose exactly
    (`symmetrized`), which spares strategies with `exact_symmetry` a d × d pass."""
    if params is None or isinstance(params, dict):
        params = strategy_params(name, params)
    entry = REFINEMENTS.get(name)
    M_star = np.asarray(M_star, dtype=np.float64)
    if entry.spec.exact_symmetry:
        return entry.builder(M_star if symmetric else symmetrized(M_star), params)
    return symmetrized(entry.builder(M_star, params))


def strategy_key(name: str, params) -> tuple:
    """Hashable identity of (strategy, parameters), for caches."""
    if isinstance(params, dict):
        params = strategy_params(name, params)
    return (name, tuple(sorted(dataclasses.asdict(params).items())))


def strategy_label(name: str, params=None) -> str:
    """The one label of (strategy, parameters): `name` or `name(k=v, …)` over the parameters
    the strategy takes, in field order.  A dict may give some of them (None and '' are left out)."""
    given = (dataclasses.asdict(params) if dataclasses.is_dataclass(params) and not isinstance(params, type)
             else dict(params or {}))
    parts = []
    for f in dataclasses.fields(REFINEMENTS.get(name).params):
        v = given.get(f.name)
        if v is None or (isinstance(v, str) and not v):
            continue
        parts.append(f.metadata["label"](v) if "label" in f.metadata else f"{f.name}={v}")
    return f"{name}({', '.join(parts)})" if parts else name


def operator_kind(name: str) -> str:
    return REFINEMENTS.get(name).spec.operator


def file_params(name: str) -> list[str]:
    """The strategy's parameters that name a file the user supplies."""
    return [f.name for f in dataclasses.fields(REFINEMENTS.get(name).params) if f.metadata.get("file")]


def sweepable(name: str) -> bool:
    return not file_params(name)


def grid(name: str) -> dict:
    """{param: values} the evaluation sweeps ({}: the defaults once)."""
    return dict(REFINEMENTS.get(name).spec.grid)


GRIDS = ("coarse", "full")  # `index evaluate --grid`


def coarse(values: tuple) -> tuple:
    """Every other grid value, both ends kept: the sweep's shape at about half the cost."""
    return tuple(dict.fromkeys(values[::2] + values[-1:]))


def seeded(name: str) -> bool:
    """Random strategies take a seed; the evaluation averages them over seeds."""
    return "seed" in {f.name for f in dataclasses.fields(REFINEMENTS.get(name).params)}


def sweep(name: str, seeds: int) -> list[tuple[dict, str]]:
    """(params, mode) of every setting the evaluation sweeps for the strategy: each grid
    combination, then each seed (random strategies), then each mode."""
    g = grid(name)
    modes = REFINEMENTS.get(name).spec.modes
    out = []
    for values in itertools.product(*g.values()):
        for seed in (range(seeds) if seeded(name) else [None]):
            p = dict(zip(g, values, strict=True)) | ({} if seed is None else {"seed": seed})
            out += [(p, mode) for mode in modes]
    return out


def ranks_like_trained(name: str, params: dict) -> bool:
    """Whether M′ at these parameters ranks exactly like M* (then it is not a refinement)."""
    at = REFINEMENTS.get(name).spec.trained_at
    return at is not None and all(params.get(k) == v for k, v in at.items())


@dataclass(frozen=True)
class SharedParam:
    """One parameter name across the strategies that take it (`r`: diagonal and random)."""
    name: str
    type: type
    metadata: typing.Mapping
    defaults: dict  # strategy name → its default

    @property
    def flag(self) -> str:
        return "--" + self.metadata.get("flag", self.name.replace("_", "-"))

    @property
    def default(self):
        """The default of the first strategy that takes it (the app's control starts there)."""
        return next(iter(self.defaults.values()))

    def describe(self) -> str:
        """'help (diagonal, random; default: 0.5)' for --help and the app's labels."""
        vals = set(map(repr, self.defaults.values()))
        if len(vals) == 1:
            d = _shown(self.default)
        else:
            d = ", ".join(f"{s} {_shown(v)}" for s, v in self.defaults.items())
        return f"{self.metadata.get('help', '')} ({', '.join(self.defaults)}; default: {d})"


def _shown(v) -> str:
    return "none" if v in ("", None) else str(v)


def shared_params() -> list[SharedParam]:
    """The union of every strategy's parameters, by name, in registry order."""
    out: dict[str, SharedParam] = {}
    for e in REFINEMENTS.entries():
        hints = typing.get_type_hints(e.params)
        for f in dataclasses.fields(e.params):
            if f.name not in out:
                out[f.name] = SharedParam(f.name, hints[f.name], f.metadata, {})
            out[f.name].defaults[e.name] = e.param_defaults()[f.name]
    return list(out.values())
