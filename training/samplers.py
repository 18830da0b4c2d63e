"""Batch samplers beyond pytorch-metric-learning's MPerClassSampler.

`paired_class_batches`: CGML's two class-aligned batches per step.  Each
step picks C classes; X′ and X″ each take n instances of every one of them,
in the same class order, drawn independently (with replacement only when a
class has fewer than n instances).  A step's indices are X′ followed by X″.
"""
from __future__ import annotations

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
