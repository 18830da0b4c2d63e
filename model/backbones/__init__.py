"""Backbone registry.  Adding a backbone: one module with @BACKBONES.register, one import line here."""
from . import efficientnet_lite0, small_cnn, timm_nets, torchvision_nets  # noqa: F401  (registration)
from .base import Backbone
from .registry import BACKBONES, build_backbone

__all__ = ["Backbone", "BACKBONES", "build_backbone"]
