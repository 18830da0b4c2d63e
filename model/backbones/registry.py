"""Backbone registry: a new backbone is one file with `@BACKBONES.register` plus one import line.

A builder takes `weights` (None = the backbone's default, "imagenet", "none" or a
file path) and returns a `Backbone`, which declares its feature size and its
input normalisation (the preprocessing that travels with it).
"""
from __future__ import annotations

from core.registry import Registry

from .base import Backbone

BACKBONES = Registry("backbone")


def build_backbone(name: str, weights: str | None = None) -> Backbone:
    """`weights`: None (the backbone's default), "imagenet", "none", or a file path."""
    return BACKBONES.build(name, weights=weights)
