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
    input_size: the input size it was trained at (0: none, or per member of a family).
    """
    stages: tuple[str, ...]
    default_weights: Literal["imagenet", "hub", "none"] = "imagenet"
    input_size: int = 0

    def check(self, entry) -> None:
        super().check(entry)
        if not self.stages:
            raise ValueError(f"{entry.what}: stages must name at least one stage")

    def listing_lines(self) -> list[str]:
        size = [f"input size: {self.input_size} px"] if self.input_size else []
        sep = " | " if any("," in s for s in self.stages) else ", "  # a family lists its kinds' stages
        return [f"stages: {sep.join(self.stages)}", *size, f"default weights: {self.default_weights}"]


BACKBONES = Registry("backbone", spec=BackboneSpec)


def build_backbone(name: str, weights: str | None = None) -> Backbone:
    """`weights`: None (the backbone's default), "imagenet", "hub" (timm: the local Hugging Face
    cache), "none", or a file path."""
    return BACKBONES.build(name, weights=weights)


def stage_count(name: str) -> int:
    """How many stages the backbone `name` has; 0 where only the built model knows (a family)."""
    e = BACKBONES.get(name)
    return 0 if e.family else len(e.spec.stages)
