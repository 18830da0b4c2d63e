"""Preprocessing travels with the backbone and the data, as timm's pretrained_cfg does.

A `TransformSpec` is everything that decides the pixels a backbone sees: it is
part of every feature-cache key, stored in every index manifest, and rebuilt
from there to embed queries exactly as the gallery was embedded.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torchvision.transforms import v2 as T

CROP_RATIO = 256 / 224  # the usual resize-then-centre-crop of ImageNet evaluation


@dataclass(frozen=True)
class TransformSpec:
    image_size: int
    resize: int                     # shorter side before the centre crop (= image_size: plain resize)
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    augment: bool = False           # random resized crop (training only)

    def describe(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TransformSpec":
        return cls(int(d["image_size"]), int(d["resize"]), tuple(d["mean"]), tuple(d["std"]),
                   bool(d.get("augment", False)))

    def build(self):
        s = self.image_size
        if self.augment:
            geo = [T.RandomResizedCrop(s, scale=(0.6, 1.0), ratio=(0.8, 1.25), antialias=True)]
        elif self.resize == s:
            geo = [T.Resize((s, s), antialias=True)]
        else:
            geo = [T.Resize(self.resize, antialias=True), T.CenterCrop(s)]
        return T.Compose([T.ToImage(), *geo, T.ToDtype(torch.float32, scale=True),
                          T.Normalize(list(self.mean), list(self.std))])


def transform_for(backbone, dcfg, augment: bool = False) -> TransformSpec:
    """The evaluation transform of `backbone` for the data configuration `dcfg`: its size, and its
    data set's resize mode (rendered glyphs are square and centred: plain resize; photos:
    resize to 256/224 of the crop, then centre crop)."""
    size = dcfg.resolved_image_size()
    resize = size if dcfg.resize_mode() == "resize" else int(round(size * CROP_RATIO))
    return TransformSpec(size, resize, tuple(backbone.mean), tuple(backbone.std), augment)
