"""Metric-loss registry.  Adding a loss: one module with @LOSSES.register, one import line here."""
from . import binomial, pml_losses  # noqa: F401  (registration)
from .base import MetricLoss
from .registry import LOSSES, build_loss, has_proxies

__all__ = ["LOSSES", "MetricLoss", "build_loss", "has_proxies"]
