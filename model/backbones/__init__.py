"""Backbone registry.  Adding a backbone: one module with @BACKBONES.register, one import line here."""
from .base import Backbone
from .registry import BACKBONES, build_backbone

from . import efficientnet_lite0, small_cnn, torchvision_nets  # noqa: E402,F401  (registration)

__all__ = ["Backbone", "BACKBONES", "build_backbone"]
