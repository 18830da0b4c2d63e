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


@pytest.mark.parametrize("batches,half", [("full", 16), ("split", 8)])
def test_distributed_pairs_split_the_one_process_pair(batches, half):
    """CGML's pair: X′ and X″ each --batch-size ("full", the paper's) or half of it ("split")."""
    one = list(DistributedMPerClassSampler(LABELS, 2, 16, seed=3, steps=3, paired=batches))
    ranks = [list(DistributedMPerClassSampler(LABELS, 2, 16, rank=r, world_size=2, seed=3, steps=3,
                                              paired=batches)) for r in range(2)]
    for step, full in enumerate(one):
        assert len(full) == 2 * half
        a, b = ranks[0][step], ranks[1][step]
        # the ranks' X′ shares in rank order are the global X′, and likewise X″
        assert a[: half // 2] + b[: half // 2] == full[:half] and a[half // 2:] + b[half // 2:] == full[half:]
        assert list(LABELS[full[:half]]) == list(LABELS[full[half:]])
