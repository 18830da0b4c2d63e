"""Batch samplers, each drawing from the generator it is given.

`m_per_class_batches`: pytorch-metric-learning's MPerClassSampler.
`paired_class_batches`: CGML's two class-aligned batches per step.  Each
step picks C classes; X′ and X″ each take n instances of every one of them,
in the same class order, drawn independently (with replacement only when a
class has fewer than n instances).  A step's indices are X′ followed by X″.
How large each of X′ and X″ is (`pair_classes`): "full" (the paper's), a whole
--batch-size batch each; "split", half of --batch-size each.
"""
from __future__ import annotations

import math

import numpy as np


def paired_class_batches(labels: np.ndarray, n_classes: int, n_per_class: int, steps: int,
                         rng: np.random.Generator) -> list[np.ndarray]:
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


def m_per_class_batches(labels: np.ndarray, m: int, batch_size: int, steps: int,
                        rng: np.random.RandomState) -> list[np.ndarray]:
    """`steps` batches of m images per class (pytorch-metric-learning's MPerClassSampler), drawn
    from `rng`.  PML draws from its module-level `NUMPY_RANDOM`; it gets `rng` for this call only."""
    from pytorch_metric_learning.samplers import MPerClassSampler
    from pytorch_metric_learning.utils import common_functions as c_f

    n_classes = len(np.unique(labels))
    bs = min(batch_size, m * n_classes)
    bs -= bs % m
    sampler = MPerClassSampler(labels, m, batch_size=bs, length_before_new_iter=steps * bs)
    saved, c_f.NUMPY_RANDOM = c_f.NUMPY_RANDOM, rng
    try:
        idx = np.fromiter(iter(sampler), dtype=np.int64)
    finally:
        c_f.NUMPY_RANDOM = saved
    return [idx[i: i + bs] for i in range(0, len(idx), bs)]


def pair_classes(batch_size: int, m: int, paired: bool | str) -> int:
    """Classes in each of X′ and X″ for a paired batch: batch_size/m when "full" (or True: the
    paper's two full minibatches), batch_size/(2m) when "split"; at least 2."""
    if paired not in (True, "full", "split"):
        raise ValueError(f"paired batches are 'full' or 'split', not {paired!r}")
    return max(2, batch_size // (2 * m if paired == "split" else m))


def epoch_batches(labels: np.ndarray, batch_size: int, m: int, paired: bool | str | None,
                  rng: np.random.RandomState) -> list[np.ndarray]:
    """One epoch's index batches (⌈n / batch_size⌉ steps): m-per-class, or CGML's two
    class-aligned batches per step (X′ then X″) when `paired` ("full": each of --batch-size,
    "split": each of half; True is "full")."""
    steps = max(1, math.ceil(len(labels) / batch_size))
    if paired:
        return paired_class_batches(labels, pair_classes(batch_size, m, paired), m, steps,
                                    np.random.default_rng(rng.randint(2**31)))
    return m_per_class_batches(labels, m, batch_size, steps, rng)
