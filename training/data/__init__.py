"""Data-set registry.  A new data set: one loader module, one line in DATASETS."""
from __future__ import annotations

from core.errors import UserError

from .benchmarks import load_cars, load_cub, load_inshop, load_sop
from .imagefolder import load_image_folder
from .kanji import KanjiConfig, load_kanji
from .splits import DatasetSplits, Subset


def _kanji(root=None, *, val_fraction=0.2, seed=0, num_classes=500, image_size=64, progress=True, fonts=()):
    cfg = KanjiConfig(root=root or KanjiConfig.root, num_classes=num_classes,
                      image_size=image_size, seed=seed, val_fraction=val_fraction, fonts=tuple(fonts))
    return load_kanji(cfg, progress=progress)


def _rooted(fn):
    def load(root=None, *, val_fraction=0.2, seed=0, **_):
        if root is None:
            raise UserError("this data set needs --data-root pointing at its folder")
        return fn(root, val_fraction=val_fraction, seed=seed)
    return load


DATASETS = {
    "kanji": _kanji,
    "cub": _rooted(load_cub),
    "cars": _rooted(load_cars),
    "sop": _rooted(load_sop),
    "inshop": _rooted(load_inshop),
    "imagefolder": _rooted(load_image_folder),
}


def load_dataset(name: str, root=None, **kw) -> DatasetSplits:
    if name not in DATASETS:
        raise UserError(f"unknown data set {name!r}; choose from {sorted(DATASETS)}")
    return DATASETS[name](root, **kw)


__all__ = ["DATASETS", "DatasetSplits", "KanjiConfig", "Subset", "load_dataset"]
