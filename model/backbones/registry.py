"""Backbone registry: a new backbone is one file with `@BACKBONES.register` plus one import line.

A builder takes `weights` (None = the backbone's default, "imagenet", "none" or a
file path) and returns a `Backbone`, which declares its feature size and its
input normalisation (the preprocessing that travels with it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from core.registry import Registry, Spec

from .base import Backbone


@dataclass(frozen=True, kw_only=True)
class BackboneSpec(Spec):
    """A backbone's registration.

    stages: the names of the stages its `stages_fn` lists, in order: what `--train-blocks`
        counts from the end; `--help`, validation and `list` show them.
    default_weights: the weights when `--weights` is not given.
    """
    stages: tuple[str, ...]
    default_weights: Literal["imagenet", "none"] = "imagenet"

    def check(self, entry) -> None:
        super().check(entry)
        if not self.stages:
            raise ValueError(f"{entry.what}: stages must name at least one stage")

    def listing_lines(self) -> list[str]:
        return [f"stages: {', '.join(self.stages)}"]


BACKBONES = Registry("backbone", spec=BackboneSpec)


def build_backbone(name: str, weights: str | None = None) -> Backbone:
    """`weights`: None (the backbone's default), "imagenet", "none", or a file path."""
    return BACKBONES.build(name, weights=weights)
