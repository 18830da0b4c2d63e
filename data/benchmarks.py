"""Loaders for the field's benchmarks, from their official folder layouts.

Nothing is downloaded: each loader reads a root the user provides and, if a
file or folder of the official layout is missing, says which one.
Standard class splits: CUB 100/100, Cars196 98/98, SOP 11,318/11,316;
In-Shop uses its own train / query / gallery partition.  Validation classes
are carved from the train classes.
"""
from __future__ import annotations

from pathlib import Path

from core.errors import DatasetLayoutError

from .registry import DATASETS, require_root
from .splits import DatasetSplits, carve_validation, make_splits, subset_of


def _need(path: Path, what: str) -> Path:
    if not path.exists():
        raise DatasetLayoutError(f"{what}: expected {path} (is the data-set root right?)")
    return path


def _root(root) -> Path:
    root = Path(root)
    if not root.is_dir():
        raise DatasetLayoutError(f"data-set folder not found: {root}")
    return root


def _read_rows(path: Path, what: str, skip: int = 0) -> list[list[str]]:
    rows = []
    for n, line in enumerate(_need(path, what).read_text().splitlines()):
        if n < skip or not line.strip():
            continue
        rows.append(line.split())
    return rows


def load_cub(root, val_fraction: float = 0.2, seed: int = 0) -> DatasetSplits:
    """CUB-200-2011: root holds images.txt, image_class_labels.txt, classes.txt and images/."""
    root = _root(root)
    if not (root / "images.txt").exists() and (root / "CUB_200_2011").is_dir():
        root = root / "CUB_200_2011"
    images = dict(_read_rows(root / "images.txt", "CUB-200-2011 image list"))
    labels = {i: int(c) for i, c in _read_rows(root / "image_class_labels.txt", "CUB-200-2011 labels")}
    names = {int(r[0]): r[1] for r in _read_rows(root / "classes.txt", "CUB-200-2011 class names")}
    img_dir = _need(root / "images", "CUB-200-2011 image folder")
    ids = sorted(images, key=int)
    missing = [i for i in ids if i not in labels]
    if missing:
        raise DatasetLayoutError(f"image_class_labels.txt lacks image ids {missing[:5]}")
    paths = [images[i] for i in ids]
    ys = [labels[i] for i in ids]
    return make_splits("cub", img_dir, paths, ys, range(1, 101), range(101, 201),
                       val_fraction, seed, class_names=names)


def load_cars(root, val_fraction: float = 0.2, seed: int = 0) -> DatasetSplits:
    """Cars196: root holds cars_annos.mat (devkit) and car_ims/."""
    from scipy.io import loadmat  # MATLAB format, not pickle

    root = _root(root)
    mat = _need(root / "cars_annos.mat", "Cars196 annotation file")
    _need(root / "car_ims", "Cars196 image folder")
    try:
        m = loadmat(str(mat), squeeze_me=True)
    except Exception as e:
        raise DatasetLayoutError(f"cannot read {mat}: {e}") from None
    if "annotations" not in m:
        raise DatasetLayoutError(f"{mat} has no 'annotations' struct")
    ann = m["annotations"]
    paths = [str(a["relative_im_path"]) for a in ann]
    ys = [int(a["class"]) for a in ann]
    names = {}
    if "class_names" in m:
        names = {i + 1: str(n) for i, n in enumerate(list(m["class_names"]))}
    return make_splits("cars", root, paths, ys, range(1, 99), range(99, 197),
                       val_fraction, seed, class_names=names)


def load_sop(root, val_fraction: float = 0.2, seed: int = 0) -> DatasetSplits:
    """Stanford Online Products: root holds Ebay_train.txt, Ebay_test.txt and the category folders."""
    root = _root(root)
    if not (root / "Ebay_train.txt").exists() and (root / "Stanford_Online_Products").is_dir():
        root = root / "Stanford_Online_Products"
    tr = _read_rows(root / "Ebay_train.txt", "SOP train list", skip=1)
    te = _read_rows(root / "Ebay_test.txt", "SOP test list", skip=1)
    paths = [r[3] for r in tr] + [r[3] for r in te]
    ys = [int(r[1]) for r in tr] + [int(r[1]) for r in te]
    train_cl = sorted({int(r[1]) for r in tr})
    test_cl = sorted({int(r[1]) for r in te})
    return make_splits("sop", root, paths, ys, train_cl, test_cl, val_fraction, seed)


def load_inshop(root, val_fraction: float = 0.2, seed: int = 0) -> DatasetSplits:
    """In-Shop: root holds list_eval_partition.txt and img/ (train, query and gallery)."""
    root = _root(root)
    part = root / "list_eval_partition.txt"
    if not part.exists() and (root / "Eval" / "list_eval_partition.txt").exists():
        part = root / "Eval" / "list_eval_partition.txt"
    rows = _read_rows(part, "In-Shop partition file", skip=2)
    img_root = root
    if not (root / "img").is_dir() and (root / "Img" / "img").is_dir():
        img_root = root / "Img"
    _need(img_root / "img", "In-Shop image folder")
    items = sorted({r[1] for r in rows})
    item_id = {name: i for i, name in enumerate(items)}
    by_status: dict[str, tuple[list, list]] = {"train": ([], []), "query": ([], []), "gallery": ([], [])}
    for r in rows:
        if len(r) < 3 or r[2] not in by_status:
            raise DatasetLayoutError(f"{part}: unexpected row {' '.join(r)!r}")
        by_status[r[2]][0].append(r[0])
        by_status[r[2]][1].append(item_id[r[1]])
    tp, ty = by_status["train"]
    train_cl, val_cl = carve_validation(sorted(set(ty)), val_fraction, seed)
    from .splits import Subset

    return DatasetSplits(
        name="inshop", root=img_root,
        train=subset_of("train", img_root, tp, ty, train_cl),
        val=subset_of("val", img_root, tp, ty, val_cl),
        query=Subset("query", img_root, *by_status["query"]),
        gallery=Subset("gallery", img_root, *by_status["gallery"]),
        class_names={v: k for k, v in item_id.items()},
    )


# one registration per benchmark: each loader reads its official layout under --data-root
for _name, _doc, _load in (
        ("cub", "CUB-200-2011 (root holds images/, images.txt, image_class_labels.txt); 100/100 classes", load_cub),
        ("cars", "Cars196 (root holds cars_annos.mat and car_ims/); 98/98 classes", load_cars),
        ("sop", "Stanford Online Products (Ebay_train.txt, Ebay_test.txt); 11,318/11,316 classes", load_sop),
        ("inshop", "In-Shop Clothes (list_eval_partition.txt, img/); query/gallery test split", load_inshop)):
    DATASETS.register(_name, doc=_doc)(
        lambda cfg, progress=True, _load=_load: _load(require_root(cfg), cfg.val_fraction, cfg.data_seed))
