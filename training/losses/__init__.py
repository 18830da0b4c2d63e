"""Metric-loss registry.  Adding a loss: one module with @LOSSES.register, one import line here."""
from .base import MetricLoss
from .registry import LOSSES, build_loss, has_proxies

from . import binomial, pml_losses  # noqa: E402,F401  (registration)

__all__ = ["LOSSES", "MetricLoss", "build_loss", "has_proxies"]
