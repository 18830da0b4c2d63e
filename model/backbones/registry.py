"""Backbone registry: a new backbone is one file with @register plus one import line."""
from __future__ import annotations

from typing import Callable

from core.errors import UserError

from .base import Backbone

BACKBONES: dict[str, Callable[..., Backbone]] = {}


def register(name: str):
    def deco(fn):
        BACKBONES[name] = fn
        return fn

    return deco


def build_backbone(name: str, weights: str | None = None) -> Backbone:
    """`weights`: None (the backbone's default), "imagenet", "none", or a file path."""
    if name not in BACKBONES:
        raise UserError(f"unknown backbone {name!r}; choose from {sorted(BACKBONES)}")
    return BACKBONES[name](weights=weights)
