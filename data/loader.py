"""Image datasets and loaders.  A corrupt file is skipped and reported, never fatal
and never silent: the collate function drops it and the caller logs the count."""
from __future__ import annotations

import logging

import torch
from torch.utils.data import DataLoader, Dataset

from core.errors import CorruptImageError
from core.images import load_rgb

from .splits import Subset

log = logging.getLogger(__name__)


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
                shuffle: bool = False, sampler=None, generator=None, pin_memory: bool = False) -> DataLoader:
    return DataLoader(ImageDataset(subset, transform), batch_size=batch_size,
                      shuffle=shuffle if sampler is None else False, sampler=sampler,
                      num_workers=workers, collate_fn=collate_skip, generator=generator,
                      persistent_workers=False, pin_memory=pin_memory)
