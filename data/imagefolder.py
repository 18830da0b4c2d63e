"""Generic ImageFolder (one sub-folder per class) with a class-disjoint split."""
from __future__ import annotations

import random
from pathlib import Path

from core.errors import DatasetLayoutError

from .registry import DATASETS, require_root
from .splits import DatasetSplits, make_splits

IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}


def scan_image_folder(root) -> tuple[Path, list[str], list[int], dict[int, str]]:
    root = Path(root)
    if not root.is_dir():
        raise DatasetLayoutError(f"image folder not found: {root}")
    classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DatasetLayoutError(f"{root} has no class sub-folders (expected root/<class>/<image>)")
    paths, labels = [], []
    for ci, c in enumerate(classes):
        for p in sorted((root / c).rglob("*")):
            if p.is_file() and p.suffix.lower() in IMAGE_EXTS:
                paths.append(str(p.relative_to(root)))
                labels.append(ci)
    if not paths:
        raise DatasetLayoutError(f"{root} has class folders but no images ({sorted(IMAGE_EXTS)})")
    return root, paths, labels, dict(enumerate(classes))


def load_image_folder(root, val_fraction: float = 0.2, seed: int = 0,
                      test_fraction: float = 0.5) -> DatasetSplits:
    root, paths, labels, names = scan_image_folder(root)
    cl = sorted(names)
    if len(cl) < 3:
        raise DatasetLayoutError(f"{root} needs at least 3 classes for a class-disjoint split")
    order = cl[:]
    random.Random(seed + 1).shuffle(order)
    n_test = max(1, int(round(len(cl) * test_fraction)))
    return make_splits("imagefolder", root, paths, labels, sorted(order[n_test:]),
                       sorted(order[:n_test]), val_fraction, seed, class_names=names)


@DATASETS.register("imagefolder", doc="any folder of class sub-folders (root/<class>/<image>); half the classes test",
                   size_from_images=True)
def _image_folder(cfg, progress: bool = True) -> DatasetSplits:
    return load_image_folder(require_root(cfg), cfg.val_fraction, cfg.data_seed)
