"""The typed settings of `python -m index build` (light: the CLI parses them before importing torch)."""
from __future__ import annotations

from dataclasses import dataclass, field

from core.flags import DEFAULTS, HELP
from data import DataConfig


@dataclass
class BuildConfig(DataConfig):
    """`python -m index build` settings: the data fields plus where to read and write.
    `--config build.toml` reads them from a file; flags override it."""
    out: str | None = field(default=None, metadata={"help": "index directory to write (atomically); required"})
    checkpoint: str | None = field(default=None, metadata={
        "help": "trained checkpoint whose backbone embeds the images; its data set, split and "
                "preprocessing are used unless the data flags say otherwise"})
    split: str = field(default="test", metadata={"help": "data-set split to index"})
    shard: str | None = field(default=None, metadata={
        "help": "i/N: embed only the i-th of N blocks of the split (ids stay global; join the shards with "
                "`index merge`); under torchrun every rank takes its own shard and rank 0 merges"})
    image_folder: str | None = field(default=None, metadata={
        "help": "index every image in this folder (sub-folders = classes) instead of a data set"})
    features: str | None = field(default=None, metadata={"help": "precomputed trunk features .npy (n × d)"})
    labels: str | None = field(default=None, metadata={"help": "labels .npy for --features"})
    neck: str | None = field(default=None, metadata={"help": "neck W .npy (k × d) for --features (none: identity)"})
    normalize: bool = field(default=True, metadata={"help": "L2-normalise φ(x)"})
    factory: str | None = field(default=None, metadata={
        "help": "FAISS factory string (none: Flat up to 1e5 items, else HNSW32)"})
    # the shared flags: the same help and default as on every other command (core/flags.py)
    cache_dir: str = field(default=DEFAULTS["cache_dir"], metadata={"help": HELP["cache_dir"]})
    progress: bool = field(default=DEFAULTS["progress"], metadata={"help": HELP["progress"]})
    threads: int = field(default=DEFAULTS["threads"], metadata={"help": HELP["threads"]})
    device: str = field(default=DEFAULTS["device"], metadata={"help": HELP["device"]})
