"""Data sets (kanji, CUB, Cars196, SOP, In-Shop, any ImageFolder), class-disjoint splits, loaders.

Imports only `core`.  A new data set: one module with `@DATASETS.register`, one import line here.
"""
from . import benchmarks, imagefolder, kanji  # noqa: F401  (registration)
from .config import DataConfig, load_data
from .registry import DATASETS
from .splits import DatasetSplits, Subset

__all__ = ["DATASETS", "DataConfig", "DatasetSplits", "Subset", "load_data"]
