"""Loss registry: a new loss is one module with `@LOSSES.register(...)` plus one import line.

A builder takes (number of train classes C, embedding size d, its params dataclass) and
returns a `MetricLoss`.  Meta `proxies=True` marks a loss with learned class proxies (what
the proxy regularizers act on); it is checked against `--regularizer` before a run starts.
"""
from __future__ import annotations

from dataclasses import asdict

from core.registry import Registry

from .base import MetricLoss

LOSSES = Registry("loss", "losses")


def build_loss(name: str, num_classes: int, embed_dim: int, params=()) -> tuple[MetricLoss, dict]:
    """The loss module and its resolved parameters; `params`: `key=value` strings or a dict."""
    p = LOSSES.params(name, params)
    return LOSSES.build(name, num_classes, embed_dim, p), asdict(p)


def has_proxies(name: str) -> bool:
    return bool(LOSSES.get(name).meta.get("proxies"))
