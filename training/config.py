"""Typed configuration for data and evaluation (training adds its own in train_config.py)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DataConfig:
    dataset: str = field(default="kanji", metadata={"help": "kanji | cub | cars | sop | inshop | imagefolder"})
    data_root: str | None = field(default=None, metadata={"help": "data-set folder (kanji: render cache)"})
    num_classes: int = field(default=500, metadata={"help": "kanji: characters to render (0 = all ~3,300)"})
    image_size: int = field(default=0, metadata={"help": "input size; 0 = 64 for kanji, 224 otherwise"})
    data_seed: int = field(default=0, metadata={"help": "seed of the class split (and kanji class choice)"})
    val_fraction: float = field(default=0.2, metadata={"help": "fraction of train classes held out for validation"})
    kanji_fonts: tuple[str, ...] = field(default=(), metadata={"help": "kanji: font ids to use (default all 23)"})
    workers: int = field(default=1, metadata={"help": "image-loading worker processes"})
    eval_batch_size: int = field(default=128, metadata={"help": "batch size for embedding images"})

    def resolved_image_size(self) -> int:
        return self.image_size or (64 if self.dataset == "kanji" else 224)


def load_data(cfg: DataConfig, progress: bool = True):
    from .data import load_dataset

    kw = dict(val_fraction=cfg.val_fraction, seed=cfg.data_seed)
    if cfg.dataset == "kanji":
        kw |= dict(num_classes=cfg.num_classes, image_size=cfg.resolved_image_size(), progress=progress,
                   fonts=tuple(cfg.kanji_fonts))
    return load_dataset(cfg.dataset, cfg.data_root, **kw)
