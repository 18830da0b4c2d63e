"""The data-set registry: a new data set is one loader module with `@DATASETS.register`
plus one import line in `data/__init__.py`.

A builder takes the typed `DataConfig` and returns class-disjoint `DatasetSplits`.
An entry's meta may set `image_size` and `resize_mode` (the preprocessing its
images want by default; see `data.config.DataConfig`).
"""
from __future__ import annotations

from pathlib import Path

from core.errors import UserError
from core.registry import Registry

DATASETS = Registry("data set")


def require_root(cfg) -> Path:
    if not cfg.data_root:
        raise UserError(f"data set {cfg.dataset!r} needs --data-root pointing at its folder")
    return Path(cfg.data_root)
