"""Class-disjoint splits, as the deep-metric-learning protocol requires.

Train, validation (carved from the train classes, for model selection) and
test classes never share a class.  In-Shop's test part is a query/gallery pair.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import UserError


@dataclass
class Subset:
    name: str
    root: Path
    paths: list[str]          # relative to root
    labels: list[int]         # class ids (shared numbering across subsets of one data set)

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def classes(self) -> list[int]:
        return sorted(set(self.labels))

    def abspath(self, i: int) -> Path:
        return self.root / self.paths[i]


@dataclass
class DatasetSplits:
    name: str
    root: Path
    train: Subset
    val: Subset
    test: Subset | None = None                 # query = gallery protocol
    query: Subset | None = None                # separate query/gallery protocol (In-Shop)
    gallery: Subset | None = None
    class_names: dict[int, str] = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    def subsets(self) -> dict[str, Subset]:
        out = {"train": self.train, "val": self.val}
        for k in ("test", "query", "gallery"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out

    def get(self, name: str) -> Subset:
        subs = self.subsets()
        if name not in subs:
            raise UserError(f"data set {self.name!r} has no split {name!r}; it has {sorted(subs)}")
        return subs[name]

    def eval_pair(self, split: str) -> tuple[Subset, Subset | None]:
        """(query, gallery) for evaluating `split`; gallery None means query = gallery."""
        if split == "test" and self.test is None and self.query is not None:
            return self.query, self.gallery
        return self.get(split), None

    def split_summary(self) -> dict:
        return {k: {"classes": len(s.classes), "images": len(s)} for k, s in self.subsets().items()}


def carve_validation(classes: list[int], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministically split train classes into (train, val)."""
    if not 0.0 <= val_fraction < 1.0:
        raise UserError(f"val_fraction must be in [0, 1), got {val_fraction}")
    cl = sorted(classes)
    rng = random.Random(seed)
    rng.shuffle(cl)
    n_val = int(round(len(cl) * val_fraction))
    if val_fraction > 0 and len(cl) >= 4:
        n_val = max(n_val, 2)
    return sorted(cl[n_val:]), sorted(cl[:n_val])


def subset_of(name: str, root: Path, paths: list[str], labels: list[int], classes) -> Subset:
    keep = set(classes)
    idx = [i for i, y in enumerate(labels) if y in keep]
    return Subset(name, root, [paths[i] for i in idx], [labels[i] for i in idx])


def make_splits(name: str, root: Path, paths: list[str], labels: list[int], train_classes,
                test_classes, val_fraction: float, seed: int, class_names=None, info=None) -> DatasetSplits:
    tr, va = carve_validation(list(train_classes), val_fraction, seed)
    return DatasetSplits(
        name=name, root=root,
        train=subset_of("train", root, paths, labels, tr),
        val=subset_of("val", root, paths, labels, va),
        test=subset_of("test", root, paths, labels, test_classes),
        class_names=class_names or {}, info=info or {},
    )
