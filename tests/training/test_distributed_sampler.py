"""The distributed m-per-class sampler: ranks take disjoint, class-balanced shares of one global
batch that equals the single-process batch, deterministically from (seed, epoch)."""
from collections import Counter

import numpy as np
import pytest

from core.errors import UserError
from training.distributed import DistributedMPerClassSampler

LABELS = np.repeat(np.arange(10), [5, 3, 4, 6, 2, 5, 5, 4, 3, 7])


def test_ranks_split_the_single_process_batch():
    one = list(DistributedMPerClassSampler(LABELS, m=2, batch_size=8, seed=3, steps=5))
    ranks = [list(DistributedMPerClassSampler(LABELS, m=2, batch_size=8, rank=r, world_size=2, seed=3, steps=5))
             for r in range(2)]
    for step, full in enumerate(one):
        a, b = ranks[0][step], ranks[1][step]
        assert a + b == full and len(a) == len(b) == 4
        assert not set(LABELS[a]) & set(LABELS[b])        # disjoint classes
        for part in (a, b):
            assert set(Counter(LABELS[part].tolist()).values()) == {2}  # m per class


def test_same_seed_and_epoch_same_batches_other_epoch_other_batches():
    s = DistributedMPerClassSampler(LABELS, m=2, batch_size=8, seed=1, steps=4)
    s.set_epoch(2)
    first = list(s)
    s.set_epoch(3)
    other = list(s)
    s.set_epoch(2)
    assert list(s) == first and other != first


def test_impossible_batches_are_refused():
    with pytest.raises(UserError, match="multiple of m × ranks"):
        DistributedMPerClassSampler(LABELS, m=4, batch_size=8, world_size=3)
    with pytest.raises(UserError, match="needs 12 classes; there are 10"):
        DistributedMPerClassSampler(LABELS, m=2, batch_size=24)
