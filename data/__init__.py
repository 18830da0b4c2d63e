"""Data sets (kanji, CUB, Cars196, SOP, In-Shop, any ImageFolder), class-disjoint splits, loaders.

Imports only `core`.  A new data set: one module with `@DATASETS.register`, one import line here.
"""
from .config import DataConfig, load_data
from .registry import DATASETS
from .splits import DatasetSplits, Subset

from . import benchmarks, imagefolder, kanji  # noqa: E402,F401  (registration)

__all__ = ["DATASETS", "DataConfig", "DatasetSplits", "Subset", "load_data"]
