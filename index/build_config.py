"""The typed settings of `python -m index build` (light: the CLI parses them before importing torch)."""
from __future__ import annotations

from dataclasses import dataclass

from core.flags import DEFAULTS, HELP
from core.params import param
from data import DataConfig


@dataclass
class BuildConfig(DataConfig):
    """`python -m index build` settings: the data fields plus where to read and write.
    `--config build.toml` reads them from a file; flags override it."""
    out: str | None = param(None, "index directory to write (atomically); required")
    checkpoint: str | None = param(None, "trained checkpoint whose backbone embeds the images; its data set, split "
                                         "and preprocessing are used unless the data flags say otherwise")
    split: str = param("test", "data-set split to index")
    shard: str | None = param(None, "i/N: embed only the i-th of N blocks of the split (ids stay global; join the "
                                    "shards with `index merge`); under torchrun every rank takes its own shard and "
                                    "rank 0 merges")
    image_folder: str | None = param(None, "index every image in this folder (sub-folders = classes) instead of a "
                                           "data set")
    features: str | None = param(None, "precomputed trunk features .npy (n × d)")
    labels: str | None = param(None, "labels .npy for --features")
    neck: str | None = param(None, "neck W .npy (k × d) for --features (none: identity)")
    normalize: bool = param(True, "L2-normalise φ(x)")
    factory: str | None = param(None, "FAISS factory string (none: Flat up to 1e5 items, else HNSW32)")
    # the shared flags: the same help and default as on every other command (core/flags.py)
    cache_dir: str = param(DEFAULTS["cache_dir"], HELP["cache_dir"])
    progress: bool = param(DEFAULTS["progress"], HELP["progress"])
    threads: int = param(DEFAULTS["threads"], HELP["threads"])
    device: str = param(DEFAULTS["device"], HELP["device"])
