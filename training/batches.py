"""Where a training step's inputs come from: a batch source.

A source knows its training labels, prepares the model for an epoch (which
parts train, which stay frozen), turns an epoch's index batches into
(inputs, labels, skipped images), `encode`s inputs into backbone outputs
inside the step (so gradients reach whatever part trains), and embeds a
split for evaluation.

  FrozenFeatures  the frozen backbone's features, cached on disk: a step is neck + loss only;
  PrefixTail      the frozen prefix's output maps, cached on disk (float16, memory-mapped):
                  a step runs the last N stages (the trained tail), the neck and the loss;
  ImageBatches    augmented images through the whole network (fine-tuning).

Every source is built from one `SourceConfig`.  Which stages train is decided in one place,
`set_trainable`: the frozen part is in eval mode (its BatchNorm statistics stay the
pretrained ones) and gets no gradient.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from model.features import backbone_features, cached_prefix, embed_subset

if TYPE_CHECKING:
    from data.config import DataConfig
    from data.splits import DatasetSplits
    from model.backbones.base import Backbone
    from model.preprocess import TransformSpec

log = logging.getLogger("training")


@dataclass(frozen=True, kw_only=True)
class SourceConfig:
    """What a batch source is built from; each source reads the values it needs."""
    backbone: Backbone
    splits: DatasetSplits
    spec: TransformSpec       # the evaluation transform (no augmentation)
    dcfg: DataConfig          # resolved: concrete image size and resize mode
    cache_dir: str            # cached backbone features and prefix maps
    progress: bool
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    n_train: int | None = None  # stages that train, counted from the end; None: all of them
    warmup_epochs: int = 0      # epochs before the trained stages start training
    bn_freeze: bool = False     # the trained stages' BatchNorm stays in eval mode too

    def train_stages(self) -> int:
        return len(self.backbone.stages()) if self.n_train is None else self.n_train


def set_trainable(backbone, n_train: int, trainable: bool = True, bn_freeze: bool = False) -> None:
    """The last `n_train` stages train (unless not `trainable`: a warm-up epoch); everything before
    them is frozen and in eval mode.  `bn_freeze` keeps the trained stages' BatchNorm in eval mode
    too (their affine weights still train), as in the Proxy-Anchor recipe."""
    stages = [m for _, m in backbone.stages()]
    train_part = stages[len(stages) - n_train:] if n_train and trainable else []
    backbone.eval()
    for p in backbone.parameters():
        p.requires_grad_(False)
    for m in train_part:
        m.train()
        for p in m.parameters():
            p.requires_grad_(True)
        if bn_freeze:
            for b in m.modules():
                if isinstance(b, torch.nn.modules.batchnorm._BatchNorm):
                    b.eval()


class FrozenFeatures:
    def __init__(self, cfg: SourceConfig):
        self.backbone, self.splits, self.spec, self.dcfg = cfg.backbone, cfg.splits, cfg.spec, cfg.dcfg
        self.cache_dir, self.progress = cfg.cache_dir, cfg.progress
        self.cache = {name: self._features(self.splits.get(name)) for name in ("train", "val")}
        self.labels = self.cache["train"][1]
        for p in self.backbone.parameters():
            p.requires_grad_(False)

    def _features(self, subset) -> tuple[torch.Tensor, np.ndarray]:
        f, y, _ = backbone_features(self.backbone, self.splits, subset, self.spec, self.dcfg, self.cache_dir,
                                    self.progress)
        return torch.from_numpy(f), y

    def start_epoch(self, epoch: int, model) -> None:
        model.train()
        set_trainable(self.backbone, 0)  # frozen: its BatchNorm statistics stay as they are

    def batches(self, index_batches):
        feats, labels = self.cache["train"]
        for b in index_batches:
            yield feats[torch.from_numpy(b)], labels[b], []

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def embed(self, model, subset) -> tuple[np.ndarray, np.ndarray]:
        f, y = self.cache[subset.name] if subset.name in self.cache else self._features(subset)
        return np.asarray(model.embed_of_backbone(f)), y


class PrefixTail:
    """Inputs are the frozen prefix's cached output maps; `encode` runs the trained tail."""

    def __init__(self, cfg: SourceConfig):
        self.backbone, self.splits, self.spec, self.dcfg = cfg.backbone, cfg.splits, cfg.spec, cfg.dcfg
        self.n_train = cfg.train_stages()
        self.n_prefix = len(self.backbone.stages()) - self.n_train
        self.cache_dir, self.progress, self.device = cfg.cache_dir, cfg.progress, cfg.device
        self.warmup_epochs, self.bn_freeze = cfg.warmup_epochs, cfg.bn_freeze
        self.cache = {name: self._maps(self.splits.get(name)) for name in ("train", "val")}
        self.labels = self.cache["train"].labels

    def _maps(self, subset):
        return cached_prefix(self.backbone, self.n_prefix, self.splits, subset, self.spec, self.dcfg,
                             self.cache_dir, self.progress, self.device)

    def start_epoch(self, epoch: int, model) -> None:
        model.train()
        set_trainable(self.backbone, self.n_train, epoch >= self.warmup_epochs, self.bn_freeze)

    def batches(self, index_batches):
        maps, labels = self.cache["train"].maps, self.cache["train"].labels
        for b in index_batches:  # fancy indexing copies only this batch's rows out of the memory map
            yield torch.from_numpy(np.asarray(maps[b], dtype=np.float32)), labels[b], []

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone.run_stages(x, self.n_prefix)

    @torch.inference_mode()
    def embed(self, model, subset) -> tuple[np.ndarray, np.ndarray]:
        model.eval()  # (the next epoch's start_epoch sets the training modes again)
        c = self.cache[subset.name] if subset.name in self.cache else self._maps(subset)
        bs, out = self.dcfg.eval_batch_size, []
        for i in range(0, len(c.labels), bs):
            x = torch.from_numpy(np.asarray(c.maps[i: i + bs], dtype=np.float32)).to(self.device)
            out.append(model.embed_features(model.head_trunk(self.encode(x))).float().cpu())
        e = torch.cat(out).numpy() if out else np.zeros((0, model.embed_dim), np.float32)
        return e, c.labels


class ImageBatches:
    def __init__(self, cfg: SourceConfig):
        self.backbone, self.splits, self.spec, self.dcfg = cfg.backbone, cfg.splits, cfg.spec, cfg.dcfg
        self.warmup_epochs, self.progress = cfg.warmup_epochs, cfg.progress
        self.n_train = cfg.train_stages()
        self.bn_freeze, self.device = cfg.bn_freeze, cfg.device
        self.labels = np.asarray(self.splits.train.labels)

    def start_epoch(self, epoch: int, model) -> None:
        model.train()
        set_trainable(self.backbone, self.n_train, epoch >= self.warmup_epochs, self.bn_freeze)

    def batches(self, index_batches):
        from torch.utils.data import DataLoader

        from data.loader import ImageDataset, collate_skip
        from model.preprocess import transform_for

        spec = transform_for(self.backbone, self.dcfg, augment=True)
        # worker seeds come from torch's own generator, seeded for the epoch by the trainer
        loader = DataLoader(ImageDataset(self.splits.train, spec.build()), batch_sampler=index_batches,
                            num_workers=self.dcfg.workers, collate_fn=collate_skip,
                            pin_memory=self.device.type == "cuda")
        for images, y, _, bad in loader:
            for _, msg in bad:
                log.warning("skipped: %s", msg)
            yield images, y.numpy(), bad

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def embed(self, model, subset) -> tuple[np.ndarray, np.ndarray]:
        e, y, _, _ = embed_subset(model, subset, self.spec, self.dcfg, f"embed {subset.name}", self.progress,
                                  device=self.device)
        return e, y
