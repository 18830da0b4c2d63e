"""The regularizer registry and building a run's regularizers from its config."""
from __future__ import annotations

from dataclasses import dataclass

from core.errors import UserError
from core.params import parse_items
from core.registry import Registry, Spec

from .base import Regularizer


@dataclass(frozen=True, kw_only=True)
class RegularizerSpec(Spec):
    """A regularizer's registration.

    weight: its default weight (`--reg-weight` overrides it).
    """
    weight: float


REGULARIZERS = Registry("regularizer", spec=RegularizerSpec)


def regularizer_params(names, items) -> list:
    """Each named regularizer's typed params from `name.key=value` items; an item naming a
    regularizer that is not in `names`, or an unknown key, is refused."""
    names = list(names)
    for item in items:
        owner = item.split("=", 1)[0].split(".", 1)[0]
        if owner not in names:
            raise UserError(f"--reg-param {item!r} names a regularizer that is not in --regularizer")
    return [REGULARIZERS.params(n, parse_items(items, f"regularizer {n!r}", prefix=n)) for n in names]


def build_regularizers(cfg, loss_module, trunk_dim: int) -> list[Regularizer]:
    """The configured regularizers (the config is validated already: names, weights, params)."""
    params = regularizer_params(cfg.regularizer, cfg.reg_param)
    regs = []
    for i, (name, p) in enumerate(zip(cfg.regularizer, params, strict=True)):
        entry = REGULARIZERS.get(name)
        weight = cfg.reg_weight[i] if cfg.reg_weight else entry.spec.weight
        regs.append(entry.builder(weight, p, loss_module, cfg.embed_dim, trunk_dim))
    return regs
