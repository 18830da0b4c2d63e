"""Where a training step's inputs come from: a batch source.

A source knows its training labels, prepares the model for an epoch (which
parts train, which stay frozen), turns an epoch's index batches into
(inputs, labels, skipped images), `encode`s inputs into backbone outputs
inside the step (so gradients reach whatever part trains), and embeds a
split for evaluation.

  FrozenFeatures  the frozen backbone's features, cached on disk: a step is neck + loss only;
  ImageBatches    augmented images through the whole network (fine-tuning).

A cached-prefix source (model.features.cached_prefix: a frozen prefix's output maps
on disk) is a third: its inputs are the maps and `encode` runs the remaining stages.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from model.features import backbone_features, embed_subset

log = logging.getLogger("training")


class FrozenFeatures:
    def __init__(self, backbone, splits, spec, dcfg, cache_dir: str, progress: bool):
        self.backbone, self.splits, self.spec, self.dcfg = backbone, splits, spec, dcfg
        self.cache_dir, self.progress = cache_dir, progress
        self.cache = {name: self._features(splits.get(name)) for name in ("train", "val")}
        self.labels = self.cache["train"][1]
        for p in backbone.parameters():
            p.requires_grad_(False)

    def _features(self, subset) -> tuple[torch.Tensor, np.ndarray]:
        f, y, _ = backbone_features(self.backbone, self.splits, subset, self.spec, self.dcfg, self.cache_dir,
                                    self.progress)
        return torch.from_numpy(f), y

    def start_epoch(self, epoch: int, model) -> None:
        model.train()
        self.backbone.eval()  # frozen: its BatchNorm statistics stay as they are

    def batches(self, index_batches):
        feats, labels = self.cache["train"]
        for b in index_batches:
            yield feats[torch.from_numpy(b)], labels[b], []

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def embed(self, model, subset) -> tuple[np.ndarray, np.ndarray]:
        f, y = self.cache[subset.name] if subset.name in self.cache else self._features(subset)
        return np.asarray(model.embed_of_backbone(f)), y


class ImageBatches:
    def __init__(self, backbone, splits, spec, dcfg, warmup_epochs: int, progress: bool):
        self.backbone, self.splits, self.spec, self.dcfg = backbone, splits, spec, dcfg
        self.warmup_epochs, self.progress = warmup_epochs, progress
        self.labels = np.asarray(splits.train.labels)

    def start_epoch(self, epoch: int, model) -> None:
        frozen = epoch < self.warmup_epochs
        for p in self.backbone.parameters():
            p.requires_grad_(not frozen)
        model.train()
        if frozen:
            self.backbone.eval()

    def batches(self, index_batches):
        from torch.utils.data import DataLoader

        from data.loader import ImageDataset, collate_skip

        spec = dataclasses.replace(self.spec, augment=True)
        # worker seeds come from torch's own generator, seeded for the epoch by the trainer
        loader = DataLoader(ImageDataset(self.splits.train, spec.build()), batch_sampler=index_batches,
                            num_workers=self.dcfg.workers, collate_fn=collate_skip)
        for images, y, _, bad in loader:
            for _, msg in bad:
                log.warning("skipped: %s", msg)
            yield images, y.numpy(), bad

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def embed(self, model, subset) -> tuple[np.ndarray, np.ndarray]:
        e, y, _, _ = embed_subset(model, subset, self.spec, self.dcfg, f"embed {subset.name}", self.progress)
        return e, y
