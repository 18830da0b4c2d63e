"""The data-set registry: a new data set is one loader module with `@DATASETS.register`
plus one import line in `data/__init__.py`.

A builder takes the typed `DataConfig` and returns class-disjoint `DatasetSplits`.
Its registration fills `DatasetSpec`: the preprocessing its images want by default
(see `data.config.DataConfig`) and how its images may be augmented.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from core.errors import UserError
from core.registry import Registry, Spec

DEFAULT_IMAGE_SIZE = 224        # photos, unless the data set's registry entry says otherwise
ResizeMode = Literal["crop", "resize", "pad"]
DEFAULT_RESIZE_MODE: ResizeMode = "crop"    # resize the shorter side to size·256/224, then centre-crop


@dataclass(frozen=True, kw_only=True)
class DatasetSpec(Spec):
    """A data set's registration.

    image_size: the input size in pixels when `--image-size` is 0.
    resize_mode: how its images reach the square input with `--resize-mode auto`.
    size_from_images: with `--image-size` 0, take the largest image side when every image is
        smaller than `image_size` (small icons are not blown up).
    renders: the loader makes its images itself: a recorded data root that is gone is no error.
    flip: horizontal flips in augmentation (False: its images are not mirror-symmetric).
    """
    image_size: int = DEFAULT_IMAGE_SIZE
    resize_mode: ResizeMode = DEFAULT_RESIZE_MODE
    size_from_images: bool = False
    renders: bool = False
    flip: bool = True

    def check(self, entry) -> None:
        super().check(entry)
        if not 16 <= self.image_size <= 2048:  # what --image-size accepts
            raise ValueError(f"{entry.what}: image_size must be 16 … 2048, got {self.image_size}")


DATASETS = Registry("data set", spec=DatasetSpec)


def require_root(cfg) -> Path:
    if not cfg.data_root:
        raise UserError(f"data set {cfg.dataset!r} needs --data-root pointing at its folder")
    return Path(cfg.data_root)
