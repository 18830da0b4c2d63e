"""Data-parallel training pieces that pytorch-metric-learning does not have.

`DistributedMPerClassSampler`: PML's MPerClassSampler has no distributed form (its issues #546
and #336 ask for one).  Each step draws one *global* class-balanced batch, B/m classes × m
images, from a generator seeded by (seed, epoch): every rank draws the same global batch and
keeps its own disjoint block of classes, so the ranks together see exactly the batch one
process would, and a resumed epoch redraws the same batches.
"""
from __future__ import annotations

import numpy as np

from core.errors import UserError


class DistributedMPerClassSampler:
    """Yields this rank's index lists, one per step; `set_epoch` before each epoch."""

    def __init__(self, labels, m: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, steps: int | None = None):
        labels = np.asarray(labels)
        if batch_size % (m * world_size):
            raise UserError(f"batch size {batch_size} must be a multiple of m × ranks = {m} × {world_size}")
        self.classes, inverse = np.unique(labels, return_inverse=True)
        self.members = [np.nonzero(inverse == c)[0] for c in range(len(self.classes))]
        self.per_batch = batch_size // m  # classes in one global batch
        if self.per_batch > len(self.classes):
            raise UserError(f"a batch of {batch_size} with m = {m} needs {self.per_batch} classes; "
                            f"there are {len(self.classes)}")
        self.m, self.rank, self.world, self.seed = m, rank, world_size, seed
        self.steps = steps or max(1, len(labels) // batch_size)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps

    def global_batches(self):
        """The global batches of this epoch (the same on every rank): arrays of B/m × m indices."""
        rng = np.random.default_rng([self.seed, self.epoch])
        for _ in range(self.steps):
            chosen = rng.choice(len(self.classes), size=self.per_batch, replace=False)
            yield np.stack([rng.choice(self.members[c], size=self.m, replace=len(self.members[c]) < self.m)
                            for c in chosen])

    def __iter__(self):
        share = self.per_batch // self.world
        for batch in self.global_batches():
            yield batch[self.rank * share: (self.rank + 1) * share].reshape(-1).tolist()
