"""Loss registry: a new loss is one module with `@LOSSES.register(...)` plus one import line.

A builder takes (number of train classes C, embedding size d, its params dataclass) and
returns a `MetricLoss`.  Its registration fills `LossSpec`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from core.registry import Registry, Spec

from .base import MetricLoss


@dataclass(frozen=True, kw_only=True)
class LossSpec(Spec):
    """A loss's registration.

    proxies: the loss learns class proxies (what the proxy regularizers act on); checked
        against `--regularizer` before a run starts.
    """
    proxies: bool = False


LOSSES = Registry("loss", "losses", spec=LossSpec)


def build_loss(name: str, num_classes: int, embed_dim: int, params=()) -> tuple[MetricLoss, dict]:
    """The loss module and its resolved parameters; `params`: `key=value` strings or a dict."""
    p = LOSSES.params(name, params)
    return LOSSES.build(name, num_classes, embed_dim, p), asdict(p)


def has_proxies(name: str) -> bool:
    return LOSSES.get(name).spec.proxies
