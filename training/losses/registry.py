"""Loss registry: a new loss is one module with @register plus one import line."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

from core.errors import UserError

from .base import MetricLoss, parse_params


@dataclass
class LossEntry:
    name: str
    params: type
    build: Callable[..., MetricLoss]
    uses_proxies: bool


LOSSES: dict[str, LossEntry] = {}


def register(name: str, params: type, uses_proxies: bool = False):
    def deco(fn):
        LOSSES[name] = LossEntry(name, params, fn, uses_proxies)
        return fn
    return deco


def build_loss(name: str, num_classes: int, embed_dim: int, param_items=()) -> tuple[MetricLoss, dict]:
    if name not in LOSSES:
        raise UserError(f"unknown loss {name!r}; choose from {sorted(LOSSES)}")
    e = LOSSES[name]
    p = parse_params(e.params, param_items, name)
    return e.build(num_classes, embed_dim, p), asdict(p)
