"""The typed data configuration: which data set, where, at what size, split how.

It is recorded in every checkpoint, so downstream commands can rebuild exactly
the data a model was trained on.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from core.errors import UserError
from core.params import check_fields, param

from .registry import DATASETS, DEFAULT_IMAGE_SIZE, DatasetSpec, ResizeMode


@dataclass
class DataConfig:
    dataset: str = param("kanji", "data set")
    data_root: str | None = param(None, "data-set folder (kanji: render cache, default cache/kanji)")
    num_classes: int = param(500, "kanji: characters to render (0 = all ~3,300)", bounds="[0, inf)")
    image_size: int = param(0, "input size in pixels; 0 = the data set's default (kanji 64, others 224)")
    resize_mode: Literal["auto", "crop", "resize", "pad"] = param(
        "auto", "how images reach the square input: crop (resize to 256/224 of the size, centre crop: photos), resize "
        "(squash: square glyphs), pad (pad to square with the border, then resize: full-bleed icons); auto = the "
        "data set's own (kanji resize, others crop)")
    data_seed: int = param(0, "seed of the class split (and kanji class choice)", bounds="[0, inf)")
    val_fraction: float = param(0.2, "fraction of train classes held out for validation", bounds="[0, 1)")
    kanji_fonts: tuple[str, ...] = param((), "kanji: font ids to use (default all 23)")
    workers: str = param("auto", "image-loading worker processes: a number (0: load in the main process) or auto: "
                         "the cores this process may use, less one for itself")
    eval_batch_size: int = param(128, "batch size for embedding images", bounds="[1, inf)")

    def validate(self) -> None:
        """Refuse an impossible setting before anything is read or written."""
        DATASETS.get(self.dataset)
        check_fields(self, "", name=lambda n: "--" + n.replace("_", "-"))  # every field's bounds (subclasses' too)
        if not (self.image_size == 0 or 16 <= self.image_size <= 2048):
            raise UserError(f"--image-size must be 0 (the data set's default) or 16 … 2048, got {self.image_size}")
        if worker_count(self.workers) is None:
            raise UserError(f"--workers must be ≥ 0 or auto, got {self.workers}")

    def dataset_spec(self):
        """The data set's registered `DatasetSpec` (the defaults for a name not registered)."""
        return DATASETS.get(self.dataset).spec if self.dataset in DATASETS else DatasetSpec()

    def resolved_image_size(self) -> int:
        return self.image_size or self.dataset_spec().image_size

    def resolved_resize_mode(self) -> ResizeMode:
        if self.resize_mode != "auto":
            return self.resize_mode
        return self.dataset_spec().resize_mode

    @classmethod
    def from_dict(cls, d: dict) -> DataConfig:
        """The data fields of any recorded config (a checkpoint's, an index manifest's)."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if "kanji_fonts" in kw:
            kw["kanji_fonts"] = tuple(kw["kanji_fonts"])
        return cls(**kw)

    def data_fields(self) -> dict:
        names = {f.name for f in dataclasses.fields(DataConfig)}
        return {k: v for k, v in dataclasses.asdict(self).items() if k in names}


def worker_count(workers) -> int | None:
    """`--workers` as a process count (None: not a valid value).  auto: the cores this process may
    use, less the one it runs on; under torchrun, its share of them (the node's ranks split the
    cores, LOCAL_WORLD_SIZE)."""
    if str(workers).strip().lower() == "auto":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
        return max(0, cores // ranks - 1)
    try:
        n = int(workers)
    except (TypeError, ValueError):
        return None
    return n if n >= 0 else None


def largest_image_side(splits, limit: int) -> int | None:
    """The largest side over every image of the data set, or None as soon as one reaches `limit`.
    Reads image headers only (PIL opens lazily)."""
    from PIL import Image

    largest = 0
    for sub in splits.subsets().values():
        for i in range(len(sub)):
            try:
                with Image.open(sub.abspath(i)) as im:
                    largest = max(largest, *im.size)
            except OSError:
                continue  # unreadable: the loader skips and reports it
            if largest >= limit:
                return None
    return largest or None


def resolve(cfg: DataConfig, splits) -> DataConfig:
    """A copy with a concrete image size and resize mode, as recorded in checkpoints.
    With image_size 0, a data set whose registry entry sets `size_from_images` (ImageFolder)
    takes the largest image side when every image is smaller than the default: small icons
    are not blown up to 224 px."""
    import logging

    size, how = cfg.image_size, "given"
    if not size:
        size, how = cfg.resolved_image_size(), "the data set's default"
        if cfg.dataset_spec().size_from_images:
            side = largest_image_side(splits, size)
            if side:
                size, how = side, f"every image is at most {side} px (default {DEFAULT_IMAGE_SIZE})"
    # an absolute root, so that commands run from another folder find the data the model saw
    root = str(Path(cfg.data_root).resolve()) if cfg.data_root else None
    out = dataclasses.replace(cfg, image_size=size, resize_mode=cfg.resolved_resize_mode(), data_root=root)
    logging.getLogger("data").info("image size %d px (%s), resize mode %s", size, how, out.resize_mode)
    return out


# settings that change which images a model sees, or how: a command-line value that differs from
# the recorded one changes the result, and is said so; the others (workers, batch size) do not
RESULT_FIELDS = ("dataset", "image_size", "resize_mode", "num_classes", "data_seed", "val_fraction",
                 "kanji_fonts")
UNSET = {"image_size": 0, "resize_mode": "auto"}   # values that mean "the default", i.e. not given
# how this machine loads images, not what the model saw: never taken from a recorded configuration
RUNTIME_FIELDS = ("workers", "eval_batch_size")


def with_overrides(recorded: DataConfig, given: dict | DataConfig | None, source: str) -> DataConfig:
    """The recorded data configuration (a checkpoint's, an index's) with the settings the user gave
    (None = not given) laid over it.  A given value that changes the result prints one warning line;
    a recorded data root that is no longer there is refused with the flag that overrides it."""
    if isinstance(given, DataConfig):
        given = given.data_fields()
    given = {k: v for k, v in (given or {}).items()
             if v is not None and UNSET.get(k, object()) != v and hasattr(recorded, k)}
    for k in RESULT_FIELDS:
        if k in given and given[k] != getattr(recorded, k) and (k != "kanji_fonts" or given[k]):
            flag = "--" + k.replace("_", "-")
            print(f"warning: {flag} {given[k]} differs from {source}'s {getattr(recorded, k)}: "
                  "the model sees other images than it was trained on; results will differ", file=sys.stderr)
    here = {f.name: f.default for f in dataclasses.fields(DataConfig) if f.name in RUNTIME_FIELDS}
    cfg = dataclasses.replace(recorded, **(here | given))
    if ("data_root" not in given and cfg.data_root and not Path(cfg.data_root).exists()
            and not cfg.dataset_spec().renders):
        raise UserError(f"{source} records the data root {cfg.data_root}, which is not there: "
                        "pass --data-root with where the data set is now")
    return cfg


def load_data(cfg: DataConfig, progress: bool = True):
    cfg.validate()
    return DATASETS.build(cfg.dataset, cfg, progress)
