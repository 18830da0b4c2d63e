"""The typed settings of `python -m index build` (light: the CLI parses them before importing torch)."""
from __future__ import annotations

from dataclasses import dataclass, field

from data import DataConfig


@dataclass
class BuildConfig(DataConfig):
    """`python -m index build` settings: the data fields plus where to read and write.
    `--config build.toml` reads them from a file; flags override it."""
    out: str | None = field(default=None, metadata={"help": "index directory to write (atomically); required"})
    checkpoint: str | None = field(default=None, metadata={
        "help": "trained checkpoint whose backbone embeds the images"})
    split: str = field(default="test", metadata={"help": "data-set split to index"})
    image_folder: str | None = field(default=None, metadata={
        "help": "index every image in this folder (sub-folders = classes) instead of a data set"})
    features: str | None = field(default=None, metadata={"help": "precomputed trunk features .npy (n × d)"})
    labels: str | None = field(default=None, metadata={"help": "labels .npy for --features"})
    neck: str | None = field(default=None, metadata={"help": "neck W .npy (k × d) for --features (none: identity)"})
    normalize: bool = field(default=True, metadata={"help": "L2-normalise φ(x)"})
    factory: str | None = field(default=None, metadata={
        "help": "FAISS factory string (none: Flat up to 1e5 items, else HNSW32)"})
    cache_dir: str = field(default="cache/features", metadata={"help": "trunk-feature cache ('' = off)"})
    progress: bool = field(default=True, metadata={"help": "show progress bars"})
