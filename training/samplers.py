"""An epoch's index batches, one draw for one process and for every rank under torchrun.

`epoch_batches(labels, batch_size, m, paired, rng, rank, world)` draws the epoch's *global*
batches from `rng` (the same on every rank) and returns rank `rank`'s block of classes of each:
for world 1 that is the whole batch, and the ranks' shares in rank order are the one-process
batch.  A batch is m-per-class (`m_per_class_batches`: pytorch-metric-learning's
MPerClassSampler) or, for CGML, a class-aligned pair X′, X″ (`paired_class_batches`); a rank
keeps its block of classes in both halves.  Nothing here reads or sets global random state.
"""
from __future__ import annotations

import math

import numpy as np

from core.errors import UserError


def epoch_seed(seed: int, epoch: int) -> int:
    """The epoch's seed: the sampler's generator (`epoch_rng`) and torch's own generator start from it."""
    return (seed * 100_003 + epoch) % (2**31)


def epoch_rng(seed: int, epoch: int) -> np.random.RandomState:
    """The sampler's generator for (seed, epoch), the same on every rank."""
    return np.random.RandomState(epoch_seed(seed, epoch))


def epoch_steps(n: int, batch_size: int) -> int:
    """Steps in an epoch of n training images: ⌈n / batch_size⌉, at least 1."""
    return max(1, math.ceil(n / batch_size))


def m_per_class_batches(labels: np.ndarray, m: int, batch_size: int, steps: int,
                        rng: np.random.RandomState) -> list[np.ndarray]:
    """`steps` batches of m images for each of batch_size/m classes: pytorch-metric-learning 2.9.0's
    MPerClassSampler (samplers/m_per_class_sampler.py `__iter__`, with utils/common_functions.py
    `safe_random_choice`), its module-level NUMPY_RANDOM made the explicit `rng`: the same indices,
    call for call (tests/training/test_samplers.py).  Each step shuffles the class list in place
    (the shuffles compound) and takes m of each of its first classes, with replacement only for
    a class of fewer than m.  The batch is clamped to m × classes and rounded down to m's multiple."""
    members: dict = {}
    for i, label in enumerate(np.asarray(labels).tolist()):  # classes in order of first appearance, as PML
        members.setdefault(label, []).append(i)
    pools = {k: np.array(v, dtype=int) for k, v in members.items()}
    keys = list(pools)
    per_batch = min(batch_size, m * len(keys)) // m
    out = []
    for _ in range(steps):
        rng.shuffle(keys)
        out.append(np.concatenate([rng.choice(pools[k], size=m, replace=len(pools[k]) < m)
                                   for k in keys[:per_batch]]).astype(np.int64))
    return out


def paired_class_batches(labels: np.ndarray, n_classes: int, n_per_class: int, steps: int,
                         rng: np.random.Generator) -> list[np.ndarray]:
    """CGML's two class-aligned batches per step: C = min(n_classes, classes) classes; X′ and X″
    each n_per_class instances of every one of them, in the same class order, drawn independently
    (with replacement only for a class of fewer).  A step's indices are X′ followed by X″."""
    labels = np.asarray(labels)
    classes, inverse = np.unique(labels, return_inverse=True)
    members = [np.nonzero(inverse == c)[0] for c in range(len(classes))]
    C = min(n_classes, len(classes))
    out = []
    for _ in range(steps):
        chosen = rng.choice(len(classes), size=C, replace=False)
        halves = []
        for _half in range(2):
            idx = [rng.choice(members[c], size=n_per_class, replace=len(members[c]) < n_per_class)
                   for c in chosen]
            halves.append(np.concatenate(idx))
        out.append(np.concatenate(halves))
    return out


def pair_classes(batch_size: int, m: int, paired: bool | str) -> int:
    """Classes in each of X′ and X″ for a paired batch: batch_size/m when "full" (or True: the
    paper's two full minibatches), batch_size/(2m) when "split"; at least 2."""
    if paired not in (True, "full", "split"):
        raise ValueError(f"paired batches are 'full' or 'split', not {paired!r}")
    return max(2, batch_size // (2 * m if paired == "split" else m))


def batch_classes(n_classes: int, batch_size: int, m: int, paired: bool | str | None) -> int:
    """Classes in one global batch (for a pair: in each half), after clamping to the classes there are."""
    want = pair_classes(batch_size, m, paired) if paired else batch_size // m
    return min(want, n_classes)


def check_split(n_classes: int, batch_size: int, m: int, paired: bool | str | None, world: int) -> None:
    """UserError unless every global batch splits into `world` equal blocks of whole classes."""
    if world <= 1:
        return
    if batch_size % (m * world):
        raise UserError(f"batch size {batch_size} must be a multiple of m_per_class × ranks = {m} × {world}")
    c = batch_classes(n_classes, batch_size, m, paired)
    if c % world:
        raise UserError(f"a batch of {c} classes does not split over {world} ranks")


def epoch_batches(labels: np.ndarray, batch_size: int, m: int, paired: bool | str | None,
                  rng: np.random.RandomState, rank: int = 0, world: int = 1) -> list[np.ndarray]:
    """Rank `rank`'s share of each of one epoch's ⌈n / batch_size⌉ global batches (world 1: the
    batches themselves): m-per-class, or CGML's pair X′ then X″ when `paired` ("full": each of
    --batch-size, "split": each of half; True is "full").  A share is a contiguous block of the
    batch's classes (in both halves of a pair), so it is class-balanced (class-aligned)."""
    check_split(len(np.unique(np.asarray(labels))), batch_size, m, paired, world)
    steps = epoch_steps(len(labels), batch_size)
    if paired:
        full = paired_class_batches(labels, pair_classes(batch_size, m, paired), m, steps,
                                    np.random.default_rng(rng.randint(2**31)))
    else:
        full = m_per_class_batches(labels, m, batch_size, steps, rng)
    if world == 1:
        return full
    out = []
    for b in full:
        grid = b.reshape(2 if paired else 1, -1, m)  # (halves, classes, m)
        share = grid.shape[1] // world
        out.append(grid[:, rank * share:(rank + 1) * share].reshape(-1))
    return out
