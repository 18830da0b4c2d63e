"""Image datasets and loaders.  A corrupt file is skipped and reported, never fatal
and never silent: the collate function drops it and the caller logs the count."""
from __future__ import annotations

import logging

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from core.errors import CorruptImageError, UserError
from core.images import load_rgb

from .config import worker_count
from .splits import Subset

log = logging.getLogger(__name__)


class ImageDataset(Dataset):
    """Item i: (transform(image i), label, i, None), or (None, label, i, message) for an unreadable
    image.  Item (i, seed): the transform's random draws come from torch's generator seeded with
    `seed` for this item alone, so an augmented image depends on its seed only, not on which worker
    process draws it or what that process drew before."""

    def __init__(self, subset: Subset, transform):
        self.subset = subset
        self.transform = transform

    def __len__(self) -> int:
        return len(self.subset)

    def __getitem__(self, item):
        i, seed = item if isinstance(item, tuple) else (item, None)
        try:
            img = load_rgb(self.subset.abspath(i))
        except CorruptImageError as e:
            return None, self.subset.labels[i], i, str(e)
        if seed is None:
            return self.transform(img), self.subset.labels[i], i, None
        state = torch.get_rng_state()  # (fork_rng and manual_seed would cost 100 times as much per image)
        try:
            torch.default_generator.manual_seed(seed)
            return self.transform(img), self.subset.labels[i], i, None
        finally:
            torch.set_rng_state(state)


def collate_skip(batch):
    """(images, labels, indices, [(index, message) of unreadable images]); images None when none
    was readable.  An item's image may be a tuple of tensors (each is stacked)."""
    ok = [b for b in batch if b[0] is not None]
    bad = [(b[2], b[3]) for b in batch if b[0] is None]
    if not ok:
        return None, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), bad
    return (default_collate([b[0] for b in ok]), torch.tensor([b[1] for b in ok]),
            torch.tensor([b[2] for b in ok]), bad)


def make_loader(subset: Subset, transform, batch_size: int = 64, workers: int | str = 1,
                shuffle: bool = False, sampler=None, generator=None, pin_memory: bool = False,
                batch_sampler=None, persistent: bool = False) -> DataLoader:
    """A loader over `subset`'s images; `workers` is a count or "auto" (see data.config.worker_count).
    `persistent`: its worker processes live as long as the loader (for a loader iterated once per
    epoch), instead of being started for every pass."""
    n = worker_count(workers)
    if n is None:
        raise UserError(f"--workers must be ≥ 0 or auto, got {workers}")
    kw = dict(batch_size=batch_size, shuffle=shuffle if sampler is None else False, sampler=sampler)
    if batch_sampler is not None:
        kw = dict(batch_sampler=batch_sampler)
    return DataLoader(ImageDataset(subset, transform), num_workers=n, collate_fn=collate_skip, generator=generator,
                      persistent_workers=persistent and n > 0, pin_memory=pin_memory,
                      prefetch_factor=4 if n > 0 else None, **kw)
