"""Where a training step's inputs come from: a batch source (`BatchSource`, built from one
`SourceConfig`).  A source knows its training labels, prepares the model for an epoch (which
stages train: `set_trainable`, the frozen part in eval mode with its pretrained BatchNorm
statistics), turns an epoch's index batches into (inputs, labels, skipped images), `encode`s
inputs into backbone outputs inside the step, and embeds a split for evaluation.

  FrozenFeatures  the frozen backbone's features, cached on disk: a step is neck + loss only;
  PrefixTail      the frozen prefix's output maps, cached (float16, memory-mapped): a step runs
                  the trained tail (the last N stages), the neck and the loss;
  CachedImages    fine-tuning on images decoded once into a uint8 cache, augmented a batch at a
                  time on the training device;
  ImageBatches    fine-tuning on images decoded and augmented one by one in loader processes
                  (--image-cache off, or a data set too large for the cache).

`batches(index_batches, generator)` draws the augmentations from `generator` (seeded by the trainer
from (seed, epoch)): the same batches whatever the worker count, redrawn exactly on resume.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from core.errors import UserError
from model.features import backbone_features, cached_images, cached_prefix, embed_subset

if TYPE_CHECKING:
    from data.config import DataConfig
    from data.splits import DatasetSplits
    from model.backbones.base import Backbone
    from model.preprocess import TransformSpec

log = logging.getLogger("training")


class BatchSource(Protocol):
    """Where the trainer's steps and evaluations read their inputs (see the module docstring)."""

    labels: np.ndarray                     # the training split's labels, in subset order
    memory_format: torch.memory_format     # of the inputs `embed` gives the model (the trainer sets it)

    def start_epoch(self, epoch: int, model) -> None:
        """Set which parts of `model` train this epoch (and their BatchNorm modes)."""

    def batches(self, index_batches, generator: torch.Generator | None = None) -> Iterator[tuple]:
        """(inputs, labels, skipped images) for each index batch, augmented from `generator`."""
        ...

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Inputs → backbone outputs, inside the step (gradients reach what trains)."""
        ...

    def embed(self, model, subset) -> tuple[np.ndarray, np.ndarray]:
        """`subset`'s embeddings under `model` (eval mode) and their labels."""
        ...

    def close(self) -> None:
        """Release loader workers and helper threads."""


@dataclass(frozen=True, kw_only=True)
class SourceConfig:
    """What a batch source is built from; each source reads the values it needs."""
    backbone: Backbone
    splits: DatasetSplits
    transform: TransformSpec  # the evaluation transform (no augmentation)
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
        self.backbone, self.splits, self.transform, self.dcfg = cfg.backbone, cfg.splits, cfg.transform, cfg.dcfg
        self.cache_dir, self.progress = cfg.cache_dir, cfg.progress
        self.cache = {name: self._features(self.splits.get(name)) for name in ("train", "val")}
        self.labels = self.cache["train"][1]
        self.memory_format = torch.contiguous_format  # (features: no layout)
        for p in self.backbone.parameters():
            p.requires_grad_(False)

    def _features(self, subset) -> tuple[torch.Tensor, np.ndarray]:
        f, y, _ = backbone_features(self.backbone, self.splits, subset, self.transform, self.dcfg, self.cache_dir,
                                    self.progress)
        return torch.from_numpy(f), y

    def start_epoch(self, epoch: int, model) -> None:
        model.train()
        set_trainable(self.backbone, 0)  # frozen: its BatchNorm statistics stay as they are

    def batches(self, index_batches, generator: torch.Generator | None = None):
        feats, labels = self.cache["train"]
        for b in index_batches:
            yield feats[torch.from_numpy(b)], labels[b], []

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def close(self) -> None:
        """Nothing to release: the features are in memory."""

    def embed(self, model, subset) -> tuple[np.ndarray, np.ndarray]:
        f, y = self.cache[subset.name] if subset.name in self.cache else self._features(subset)
        return np.asarray(model.embed_of_backbone(f)), y


class PrefixTail:
    """Inputs are the frozen prefix's cached output maps; `encode` runs the trained tail."""

    def __init__(self, cfg: SourceConfig):
        self.backbone, self.splits, self.transform, self.dcfg = cfg.backbone, cfg.splits, cfg.transform, cfg.dcfg
        self.n_train = cfg.train_stages()
        n = len(self.backbone.stages())
        self.n_prefix = n - self.n_train
        if not 0 < self.n_train < n:  # (the configuration checks this where the stages are known without a build)
            raise UserError(f"--mode tail trains 1 … {n - 1} of {self.backbone.name}'s {n} stages, got --train-blocks "
                            f"{self.n_train}" + (" (all of them is --mode finetune)" if n > 1 else ""))
        self.cache_dir, self.progress, self.device = cfg.cache_dir, cfg.progress, cfg.device
        self.warmup_epochs, self.bn_freeze = cfg.warmup_epochs, cfg.bn_freeze
        self.memory_format = torch.contiguous_format  # of the maps `embed` gives the tail (the trainer's choice)
        self.cache = {name: self._maps(self.splits.get(name)) for name in ("train", "val")}
        self.labels = self.cache["train"].labels

    def _maps(self, subset):
        return cached_prefix(self.backbone, self.n_prefix, self.splits, subset, self.transform, self.dcfg,
                             self.cache_dir, self.progress, self.device)

    def start_epoch(self, epoch: int, model) -> None:
        model.train()
        set_trainable(self.backbone, self.n_train, epoch >= self.warmup_epochs, self.bn_freeze)

    def batches(self, index_batches, generator: torch.Generator | None = None):
        maps, labels = self.cache["train"].maps, self.cache["train"].labels
        for b in index_batches:  # fancy indexing copies only this batch's rows out of the memory map
            yield torch.from_numpy(np.asarray(maps[b], dtype=np.float32)), labels[b], []

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone.run_stages(x, self.n_prefix)

    def close(self) -> None:
        """Nothing to release: the maps are memory-mapped."""

    @torch.inference_mode()
    def embed(self, model, subset) -> tuple[np.ndarray, np.ndarray]:
        model.eval()  # (the next epoch's start_epoch sets the training modes again)
        c = self.cache[subset.name] if subset.name in self.cache else self._maps(subset)
        bs, out = self.dcfg.eval_batch_size, []
        for i in range(0, len(c.labels), bs):
            # a copy: float32 maps (timm trunks) would otherwise be a read-only view of the memory map
            x = torch.from_numpy(np.array(c.maps[i: i + bs], dtype=np.float32)).to(self.device)
            x = x.contiguous(memory_format=self.memory_format)
            out.append(model.embed_features(model.head_trunk(self.encode(x))).float().cpu())
        e = torch.cat(out).numpy() if out else np.zeros((0, model.embed_dim), np.float32)
        return e, c.labels


def draw_generator(generator: torch.Generator | None) -> torch.Generator:
    """The generator given, or one seeded from torch's own (a caller that seeded torch gets the same draws)."""
    if generator is not None:
        return generator
    return torch.Generator().manual_seed(int(torch.randint(2**62, (1,))))


class _EpochBatches:
    """A loader's batch sampler whose batches are replaced every epoch, so that one loader (and its
    persistent worker processes) serves the whole run."""

    def __init__(self):
        self.batches: list = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class ImageBatches:
    """Fine-tuning on images decoded and augmented one by one (`TransformSpec.build()`) in --workers
    loader processes.  One loader serves every epoch: its workers persist, batches come in pinned
    memory on CUDA and are prefetched.  Each image's augmentation is seeded on its own (from the
    epoch's generator), so the worker count does not change the run."""

    def __init__(self, cfg: SourceConfig):
        self.backbone, self.splits, self.transform, self.dcfg = cfg.backbone, cfg.splits, cfg.transform, cfg.dcfg
        self.warmup_epochs, self.progress = cfg.warmup_epochs, cfg.progress
        self.n_train = cfg.train_stages()
        self.bn_freeze, self.device = cfg.bn_freeze, cfg.device
        self.labels = np.asarray(self.splits.train.labels)
        self.memory_format = torch.contiguous_format  # of the inputs `embed` gives the model (the trainer's choice)
        self._loader: Any = None
        self._val_loader: Any = None
        self._epoch = _EpochBatches()

    def start_epoch(self, epoch: int, model) -> None:
        model.train()
        set_trainable(self.backbone, self.n_train, epoch >= self.warmup_epochs, self.bn_freeze)

    def batches(self, index_batches, generator: torch.Generator | None = None):
        from data.loader import make_loader
        from model.preprocess import transform_for

        if self._loader is None:
            train_transform = transform_for(self.backbone, self.dcfg, augment=True)
            self._loader = make_loader(self.splits.train, train_transform.build(), workers=self.dcfg.workers,
                                       batch_sampler=self._epoch, persistent=True,
                                       pin_memory=self.device.type == "cuda")
        generator = draw_generator(generator)
        self._epoch.batches = [list(zip(b.tolist(), torch.randint(2**62, (len(b),), generator=generator).tolist(),
                                        strict=True)) for b in index_batches]
        for images, y, _, bad in self._loader:
            for _, msg in bad:
                log.warning("skipped: %s", msg)
            yield images, y.numpy(), bad

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def embed(self, model, subset) -> tuple[np.ndarray, np.ndarray]:
        from model.features import subset_loader

        loader = None
        if subset is self.splits.val:  # every epoch: one loader, its workers kept
            if self._val_loader is None:
                self._val_loader = subset_loader(subset, self.transform, self.dcfg, self.device, persistent=True)
            loader = self._val_loader
        e, y, _, _ = embed_subset(model, subset, self.transform, self.dcfg, f"embed {subset.name}", self.progress,
                                  device=self.device, loader=loader)
        return e, y

    def close(self) -> None:
        """Stop the loaders' worker processes."""
        for loader in (self._loader, self._val_loader):
            it = getattr(loader, "_iterator", None)
            if it is not None and hasattr(it, "_shutdown_workers"):
                it._shutdown_workers()
        self._loader = self._val_loader = None


# a device keeps a decoded-image cache in its memory when the cache takes at most this share of its free memory
DEVICE_CACHE_SHARE = 0.25


class CachedImages(ImageBatches):
    """Fine-tuning on the decoded-image cache (model/features.cached_images): the training images
    squashed to the input size, the validation images as the evaluation transform leaves them, both
    uint8 and memory-mapped.  Each step cuts its batch's crops with model/augment.BatchAugment on the
    training device; validation normalises the cached pixels, no loader involved.  On CUDA each
    cache is copied into device memory when it fits (DEVICE_CACHE_SHARE of the free memory);
    otherwise a thread gathers the next batch's rows into pinned memory while the current one trains."""

    def __init__(self, cfg: SourceConfig):
        from model.augment import BatchAugment
        from model.preprocess import transform_for

        super().__init__(cfg)
        train_transform = transform_for(self.backbone, self.dcfg, augment=True)
        self.train_cache = cached_images(self.splits, self.splits.train, train_transform, self.dcfg, cfg.cache_dir,
                                         self.progress)
        self.val_cache = cached_images(self.splits, self.splits.val, self.transform, self.dcfg, cfg.cache_dir,
                                       self.progress)
        self.augment = BatchAugment(train_transform)
        self.row_of = np.full(len(self.labels), -1, np.int64)  # subset index → cache row (-1: unreadable)
        self.row_of[self.train_cache.kept] = np.arange(len(self.train_cache.kept))
        sizes = self.train_cache.sizes.astype(np.float64)
        self.aspect = torch.from_numpy(sizes[:, 0] / sizes[:, 1])
        self.train_images = self._place(self.train_cache.pixels)
        self.val_images = self._place(self.val_cache.pixels)
        # the training cache is where the step runs: in device memory, or the CPU training on its memory map
        self.resident = self.train_images.device == self.device
        self._prefetch: ThreadPoolExecutor | None = None

    def _place(self, pixels: np.ndarray) -> torch.Tensor:
        """The cache as a tensor: over the memory map (CPU), or copied to the device when it fits there."""
        t = torch.from_numpy(pixels)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if pixels.nbytes <= DEVICE_CACHE_SHARE * free:
                return t.to(self.device)
        return t

    def batches(self, index_batches, generator: torch.Generator | None = None):
        generator = draw_generator(generator)
        picks = []
        for b in index_batches:
            rows = self.row_of[b]
            ok = rows >= 0
            bad = [(int(i), self.train_cache.skipped.get(int(i), "unreadable image")) for i in b[~ok]]
            picks.append((torch.from_numpy(rows[ok]), self.labels[b[ok]], bad))
        staged: list[Any] = []
        if not self.resident:  # rows gathered into pinned memory one batch ahead, by a helper thread
            self._prefetch = self._prefetch or ThreadPoolExecutor(1, thread_name_prefix="prefetch")
            staged = [self._prefetch.submit(self._gather, rows) for rows, _, _ in picks[:1]]
        for k, (rows, y, bad) in enumerate(picks):
            if staged and k + 1 < len(picks):
                staged.append(self._prefetch.submit(self._gather, picks[k + 1][0]))  # type: ignore[union-attr]
            for _, msg in bad:
                log.warning("skipped: %s", msg)
            if not len(rows):
                yield None, y, bad
            elif staged:
                pixels = staged[k].result().to(self.device, non_blocking=True)
                staged[k] = None
                yield self.augment(pixels, torch.arange(len(rows)), self.aspect[rows], generator), y, bad
            else:
                yield self.augment(self.train_images, rows, self.aspect[rows], generator), y, bad

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        t = torch.from_numpy(self.train_cache.pixels[rows.numpy()])
        return t.pin_memory() if self.device.type == "cuda" else t

    @torch.inference_mode()
    def embed(self, model, subset) -> tuple[np.ndarray, np.ndarray]:
        if subset is not self.splits.val:  # test: embedded once, through the loader
            return super().embed(model, subset)
        model.eval()
        bs, out = self.dcfg.eval_batch_size, []
        for i in range(0, len(self.val_cache.labels), bs):
            x = self.val_images[i: i + bs].to(self.device, non_blocking=True).permute(0, 3, 1, 2)
            x = self.transform.normalize(x).contiguous(memory_format=self.memory_format)
            out.append(model(x).float().cpu())
        return torch.cat(out).numpy(), self.val_cache.labels

    def close(self) -> None:
        super().close()
        self.augment.close()
        if self._prefetch is not None:
            self._prefetch.shutdown()
            self._prefetch = None
