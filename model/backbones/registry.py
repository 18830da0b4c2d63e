"""Backbone registry: a new backbone is one file with `@BACKBONES.register` plus one import line.

A builder takes `weights` (None = the backbone's default, "imagenet", "none" or a
file path) and returns a `Backbone`, which declares its feature size and its
input normalisation (the preprocessing that travels with it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from core.errors import UserError
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
    if weights == "hub" and not BACKBONES.get(name).family:
        raise UserError(f"--weights hub reads timm's weights for timm:NAME backbones; {name} takes imagenet, none "
                        "or a file path")
    return BACKBONES.build(name, weights=weights)


def input_size(name: str) -> int:
    """The input size the backbone `name` was trained at (0: none); a timm model's from its pretrained
    configuration, read without building it."""
    e = BACKBONES.get(name)
    if not e.family:
        return e.spec.input_size
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(name.partition(":")[2].strip())
    return int(cfg.input_size[-1]) if cfg is not None and cfg.input_size else 0


def sized_for(dcfg, backbone: str):
    """`dcfg` with `--image-size 0` on a photo data set (one that neither renders its images, as kanji
    does at its own size, nor sizes them from the files, as ImageFolder does) set to the backbone's
    own input size: efficientnet_lite1 at 240 px, lite2 at 260, a timm model at its configuration's."""
    import dataclasses

    spec = dcfg.dataset_spec()
    if dcfg.image_size or spec.renders or spec.size_from_images:
        return dcfg
    size = input_size(backbone)
    return dataclasses.replace(dcfg, image_size=size) if size else dcfg


def stage_count(name: str) -> int:
    """How many stages the backbone `name` has; 0 where only the built model knows (a family)."""
    e = BACKBONES.get(name)
    return 0 if e.family else len(e.spec.stages)
