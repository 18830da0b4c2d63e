"""The batch draw (training/samplers.py): its m-per-class batches are pytorch-metric-learning's
MPerClassSampler's, index for index, with the generator passed in instead of PML's global; every
rank draws the same global batches and keeps a disjoint block of classes, and the ranks' shares in
rank order are the one-process batches; impossible splits are refused."""
from collections import Counter

import numpy as np
import pytest
from tiny_kanji import tiny

from core.errors import UserError
from training.samplers import epoch_batches, epoch_rng, m_per_class_batches

UNEVEN = np.repeat(np.arange(10), [5, 3, 4, 6, 2, 5, 5, 4, 3, 7])
# labels out of order, and a class of one image
SHUFFLED = np.random.RandomState(3).permutation(np.repeat([7, 2, 9, 4, 0, 5], [1, 8, 3, 2, 6, 4]))


def pml_batches(monkeypatch, labels, m, batch_size, steps, seed):
    """PML's own sampler, drawing from RandomState(seed) set as its module-level generator."""
    from pytorch_metric_learning.samplers import MPerClassSampler
    from pytorch_metric_learning.utils import common_functions as c_f

    bs = min(batch_size, m * len(np.unique(labels)))
    bs -= bs % m
    monkeypatch.setattr(c_f, "NUMPY_RANDOM", np.random.RandomState(seed))
    idx = list(MPerClassSampler(labels, m, batch_size=bs, length_before_new_iter=steps * bs))
    return [idx[i: i + bs] for i in range(0, len(idx), bs)]


@pytest.mark.parametrize("labels,m,batch_size", [
    (UNEVEN, 2, 8),     # uneven class sizes
    (UNEVEN, 4, 12),    # classes smaller than m: drawn with replacement
    (UNEVEN, 3, 60),    # a batch larger than m × classes: clamped to every class
    (SHUFFLED, 4, 8),   # labels out of order, one class of a single image
    (SHUFFLED, 1, 5),
])
def test_m_per_class_draw_is_pml_sampler(monkeypatch, labels, m, batch_size):
    for seed, steps in ((0, 1), (11, 7)):
        ours = m_per_class_batches(labels, m, batch_size, steps, np.random.RandomState(seed))
        theirs = pml_batches(monkeypatch, labels, m, batch_size, steps, seed)
        assert [b.tolist() for b in ours] == theirs and len(ours) == steps


def test_same_seed_and_epoch_same_batches_other_epoch_other_batches():
    def draw(epoch):
        return [b.tolist() for b in epoch_batches(UNEVEN, 8, 2, None, epoch_rng(1, epoch))]
    assert draw(2) == draw(2) and draw(3) != draw(2)


@pytest.mark.parametrize("paired,m,batch_size", [(None, 2, 8), (None, 2, 40), ("full", 2, 8), ("split", 2, 16)])
@pytest.mark.parametrize("world", [1, 2])
def test_ranks_split_the_one_process_batches(paired, m, batch_size, world):
    one = epoch_batches(UNEVEN, batch_size, m, paired, epoch_rng(5, 3))
    shares = [epoch_batches(UNEVEN, batch_size, m, paired, epoch_rng(5, 3), r, world) for r in range(world)]
    assert all(len(s) == len(one) == -(-len(UNEVEN) // batch_size) for s in shares)
    for k, full in enumerate(one):
        parts = [s[k] for s in shares]
        assert len({len(p) for p in parts}) == 1
        if paired:  # each rank's [X′_r, X″_r]; the X′_r in rank order are X′, the X″_r are X″
            h = len(parts[0]) // 2
            assert np.concatenate([p[:h] for p in parts] + [p[h:] for p in parts]).tolist() == full.tolist()
            for p in parts:
                assert UNEVEN[p[:h]].tolist() == UNEVEN[p[h:]].tolist()
        else:
            assert np.concatenate(parts).tolist() == full.tolist()
        seen = [set(UNEVEN[p].tolist()) for p in parts]
        assert sum(map(len, seen)) == len(set().union(*seen))  # disjoint classes
        for p in parts:  # m of each class (twice, in a pair)
            assert set(Counter(UNEVEN[p].tolist()).values()) == {m * (2 if paired else 1)}


def test_impossible_splits_are_refused():
    with pytest.raises(UserError, match=r"multiple of m_per_class × ranks = 4 × 3"):
        epoch_batches(UNEVEN, 8, 4, None, epoch_rng(0, 0), 0, 3)
    with pytest.raises(UserError, match="a batch of 5 classes does not split over 2 ranks"):
        epoch_batches(UNEVEN, 20, 2, "split", epoch_rng(0, 0), 0, 2)
    with pytest.raises(UserError, match="a batch of 10 classes does not split over 4 ranks"):
        epoch_batches(UNEVEN, 48, 3, None, epoch_rng(0, 0), 0, 4)  # clamped to the 10 classes there are


def test_a_one_rank_process_group_trains_on_the_one_process_batches(tmp_path, kanji_root, monkeypatch):
    """The trainer in a 1-rank gloo group (its DDP path: what torchrun starts, with one rank) draws the
    batches a plain process draws, epoch for epoch, and ends at the same metrics."""
    import dataclasses

    import torch

    import training.trainer as T
    from training.distributed import leave

    drawn: list[list] = []
    draw = T.epoch_batches

    def spy(*args, **kw):
        batches = draw(*args, **kw)
        drawn[-1].append([b.tolist() for b in batches])
        return batches

    monkeypatch.setattr(T, "epoch_batches", spy)
    cfg = tiny(tmp_path, kanji_root, epochs=2, device="cpu")
    drawn.append([])
    plain = T.train(cfg)
    drawn.append([])
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    run = T.Run(dataclasses.replace(cfg, out=str(tmp_path / "grouped")))
    try:
        grouped = run.fit()
        assert run.dist is not None and run.dist.world == 1 and run.step.ddp is not None
    finally:
        leave(run.step)
    assert len(drawn[0]) == 2 and drawn[0] == drawn[1]
    assert grouped["val"] == plain["val"] and grouped["test"] == plain["test"]
