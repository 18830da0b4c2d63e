"""The typed training configuration; the CLI is generated from it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from data import DataConfig

# fields that do not change what a run computes (so resume/reuse may differ in them)
RUNTIME_FIELDS = ("resume", "progress", "threads", "workers", "cache_dir", "out", "eval_batch_size")


@dataclass
class TrainConfig(DataConfig):
    out: str = field(default="runs/default", metadata={"help": "run folder (checkpoints, logs, plots)"})
    backbone: str = field(default="efficientnet_lite0", metadata={"help": "backbone registry name"})
    weights: str | None = field(default=None, metadata={"help": "backbone weights: imagenet | none | PATH"})
    embed_dim: int = field(default=128, metadata={"help": "embedding size (rows of W)"})
    loss: str = field(default="proxy_anchor", metadata={"help": "loss registry name"})
    loss_param: tuple[str, ...] = field(default=(), metadata={"help": "loss parameters key=value,..."})
    mode: Literal["frozen", "finetune"] = field(default="frozen", metadata={
        "help": "frozen: train the neck (and losses) on cached trunk features; finetune: whole network"})
    epochs: int = field(default=30, metadata={"help": "training epochs"})
    batch_size: int = field(default=120, metadata={"help": "batch size"})
    m_per_class: int = field(default=4, metadata={"help": "images per class in a batch (m-per-class sampler)"})
    lr: float = field(default=1e-4, metadata={"help": "base learning rate (backbone)"})
    neck_lr_mult: float = field(default=10.0, metadata={"help": "neck learning rate = lr × this"})
    proxy_lr_mult: float = field(default=100.0, metadata={"help": "proxy/loss learning rate = lr × this"})
    weight_decay: float = field(default=1e-4, metadata={"help": "AdamW weight decay"})
    warmup_epochs: int = field(default=0, metadata={"help": "finetune: epochs with the backbone frozen"})
    grad_clip: float = field(default=10.0, metadata={"help": "gradient-norm clip (0 = off)"})
    schedule: Literal["cosine", "none"] = field(default="cosine", metadata={"help": "learning-rate schedule"})
    seed: int = field(default=0, metadata={"help": "training seed: same seed, same metrics"})
    regularizer: tuple[str, ...] = field(default=(), metadata={"help": "regularizers to add (comma-separated)"})
    reg_weight: tuple[float, ...] = field(default=(), metadata={"help": "their weights, same order"})
    reg_param: tuple[str, ...] = field(default=(), metadata={"help": "regularizer parameters name.key=value,..."})
    resume: bool = field(default=False, metadata={"help": "continue from the run folder's latest checkpoint"})
    cache_dir: str = field(default="cache/features", metadata={"help": "trunk-feature cache folder"})
    threads: int = field(default=0, metadata={"help": "torch threads (0 = default)"})
    progress: bool = field(default=True, metadata={"help": "show progress bars"})

    def identity(self) -> dict:
        """What decides the result: everything but the runtime fields."""
        d = dataclasses.asdict(self)
        for k in RUNTIME_FIELDS:
            d.pop(k, None)
        return d

    def data_config(self) -> DataConfig:
        names = {f.name for f in dataclasses.fields(DataConfig)}
        return DataConfig(**{k: v for k, v in dataclasses.asdict(self).items() if k in names})
