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
RESIZE_MODES = ("crop", "resize", "pad")
# the training augmentation's random resized crop: area fraction and aspect-ratio ranges (both the
# per-image transform below and the batched one of model/augment.py draw from these)
CROP_SCALE = (0.6, 1.0)
CROP_RATIO_RANGE = (0.8, 1.25)


class PadToSquare(torch.nn.Module):
    """Pad a uint8 image tensor (C × H × W) to a square by repeating its border pixels:
    full-bleed icons and glyphs keep every pixel and get no black bars."""

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        h, w = img.shape[-2:]
        if h == w:
            return img
        d = abs(h - w)
        pad = (0, 0, d // 2, d - d // 2) if w > h else (d // 2, d - d // 2, 0, 0)
        return torch.nn.functional.pad(img[None].float(), pad, mode="replicate")[0].to(img.dtype)


@dataclass(frozen=True)
class TransformSpec:
    image_size: int
    resize: int                     # crop: shorter side before the centre crop; resize/pad: = image_size
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    augment: bool = False           # random resized crop (training only)
    resize_mode: str = ""           # crop | resize | pad ("" = implied by resize: the format before pad)
    flip: bool = False              # with augment: random horizontal flip (photos; never glyphs)
    interpolation: str = "bilinear"  # of every resize: the backbone's (timm's pretrained configuration)

    @property
    def mode(self) -> str:
        return self.resize_mode or ("resize" if self.resize == self.image_size else "crop")

    def describe(self) -> dict:
        d = asdict(self)
        # crop and resize are implied by `resize`, as in specs (and feature-cache keys) made before
        # pad existed; only pad is spelled out, so existing caches and index manifests stay valid
        if self.mode != "pad":
            d.pop("resize_mode")
        if not self.flip:  # evaluation transforms never flip: keys made before the field stay valid
            d.pop("flip")
        if self.interpolation == "bilinear":  # likewise: spelled out only where it is another
            d.pop("interpolation")
        return d

    @classmethod
    def from_dict(cls, d: dict) -> TransformSpec:
        return cls(int(d["image_size"]), int(d["resize"]), tuple(d["mean"]), tuple(d["std"]),
                   bool(d.get("augment", False)), str(d.get("resize_mode", "")), bool(d.get("flip", False)),
                   str(d.get("interpolation", "bilinear")))

    def geometry(self) -> list:
        """The transforms that decide which pixels reach the input (on uint8 images)."""
        s = self.image_size
        ip = T.InterpolationMode(self.interpolation)
        if self.augment:
            geo = [T.RandomResizedCrop(s, scale=CROP_SCALE, ratio=CROP_RATIO_RANGE, interpolation=ip, antialias=True)]
            if self.flip:
                geo.append(T.RandomHorizontalFlip())
        elif self.mode == "pad":
            geo = [PadToSquare(), T.Resize((s, s), interpolation=ip, antialias=True)]
        elif self.mode == "resize":
            geo = [T.Resize((s, s), interpolation=ip, antialias=True)]
        else:
            geo = [T.Resize(self.resize, interpolation=ip, antialias=True), T.CenterCrop(s)]
        return geo

    def build(self):
        return T.Compose([T.ToImage(), *self.geometry(), T.ToDtype(torch.float32, scale=True),
                          T.Normalize(list(self.mean), list(self.std))])

    def build_pixels(self):
        """`build()` up to its uint8 pixels (C × H × W), before scaling and normalisation:
        what a decoded-image cache stores; `normalize` finishes them exactly as `build()` does."""
        return T.Compose([T.ToImage(), *self.geometry()])

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 pixels (… × C × H × W, any batch shape) → the float input `build()` gives."""
        from torchvision.transforms.v2 import functional as F

        return F.normalize(F.to_dtype(pixels, torch.float32, scale=True), list(self.mean), list(self.std))


def transform_for(backbone, dcfg, augment: bool = False) -> TransformSpec:
    """The evaluation transform of `backbone` for the data configuration `dcfg`: its image size and
    resize mode (crop: resize to 256/224 of the size, then centre crop, as for photos; resize: plain
    resize, for square centred glyphs; pad: pad to a square with the border, then resize).
    `augment`: the training transform, the field's usual one for the data set: random resized crop,
    plus a horizontal flip unless the data set says its images are not mirror-symmetric (glyphs).
    The backbone sets the normalisation, the interpolation and, in crop mode, the crop's share
    (`crop_pct`: 224/256 unless its pretrained configuration says another)."""
    from data.registry import DATASETS

    size = dcfg.resolved_image_size()
    mode = dcfg.resolved_resize_mode()
    crop_pct = float(getattr(backbone, "crop_pct", 1 / CROP_RATIO))
    ratio = CROP_RATIO if abs(crop_pct - 1 / CROP_RATIO) < 1e-9 else 1 / crop_pct
    resize = int(round(size * ratio)) if mode == "crop" else size
    flip = augment and DATASETS.get(dcfg.dataset).spec.flip
    pad = "pad" if mode == "pad" else ""
    return TransformSpec(size, resize, tuple(backbone.mean), tuple(backbone.std), augment, pad, bool(flip),
                         str(getattr(backbone, "interpolation", "bilinear")))
