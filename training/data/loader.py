"""Image datasets and loaders.  A corrupt file is skipped and reported, never fatal
and never silent: the collate function drops it and the caller logs the count."""
from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2 as T

from core.errors import CorruptImageError
from core.images import load_rgb

from .splits import Subset

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransformSpec:
    """Everything that decides the pixels a backbone sees; part of every cache key."""
    image_size: int
    resize: int                     # shorter side before the centre crop (= image_size: plain resize)
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    augment: bool = False           # random resized crop (training only)

    def describe(self) -> dict:
        return asdict(self)

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


def transform_for(backbone, image_size: int, dataset: str, augment: bool = False) -> TransformSpec:
    # Rendered glyphs are already square and centred: resize only.  Photos: the
    # usual resize to 256/224 of the crop, then centre crop.
    resize = image_size if dataset == "kanji" else int(round(image_size * 256 / 224))
    return TransformSpec(image_size, resize, tuple(backbone.mean), tuple(backbone.std), augment)


class ImageDataset(Dataset):
    def __init__(self, subset: Subset, transform):
        self.subset = subset
        self.transform = transform

    def __len__(self) -> int:
        return len(self.subset)

    def __getitem__(self, i: int):
        try:
            img = load_rgb(self.subset.abspath(i))
        except CorruptImageError as e:
            return None, self.subset.labels[i], i, str(e)
        return self.transform(img), self.subset.labels[i], i, None


def collate_skip(batch):
    ok = [b for b in batch if b[0] is not None]
    bad = [(b[2], b[3]) for b in batch if b[0] is None]
    if not ok:
        return None, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), bad
    return (torch.stack([b[0] for b in ok]), torch.tensor([b[1] for b in ok]),
            torch.tensor([b[2] for b in ok]), bad)


def make_loader(subset: Subset, transform, batch_size: int = 64, workers: int = 1,
                shuffle: bool = False, sampler=None, generator=None) -> DataLoader:
    return DataLoader(ImageDataset(subset, transform), batch_size=batch_size,
                      shuffle=shuffle if sampler is None else False, sampler=sampler,
                      num_workers=workers, collate_fn=collate_skip, generator=generator,
                      persistent_workers=False)


class SkipLog:
    """Counts skipped images and logs each one once."""

    def __init__(self):
        self.skipped: list[tuple[int, str]] = []

    def add(self, bad) -> None:
        for idx, msg in bad:
            log.warning("skipped: %s", msg)
            self.skipped.append((int(idx), msg))

    def __len__(self) -> int:
        return len(self.skipped)
