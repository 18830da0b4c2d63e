"""The typed training configuration; the CLI is generated from it, and `validate()` checks all
of it before a run reads or writes anything."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from core.errors import UserError
from core.params import param
from data import DataConfig
from data.config import RUNTIME_FIELDS as DATA_RUNTIME_FIELDS

# fields that do not change what a run computes (so resume/reuse may differ in them)
RUNTIME_FIELDS = ("resume", "overwrite", "progress", "threads", "cache_dir", "out", "device", "tensorboard",
                  "channels_last", "compile", "deterministic", *DATA_RUNTIME_FIELDS)
# --image-cache auto: the decoded-image cache (train + validation, uint8) is used up to this size
IMAGE_CACHE_AUTO_BYTES = 16 * 2**30


@dataclass
class TrainConfig(DataConfig):
    out: str = param("runs/default", "run folder (checkpoints, logs, plots)")
    backbone: str = param("efficientnet_lite0", "backbone")
    weights: str | None = param(None, "backbone weights: imagenet | hub (timm:NAME: timm's weights from the local "
                                      "Hugging Face cache, offline) | none | PATH (safetensors or a state dict); "
                                      "default: the backbone's own (`list backbones`)")
    embed_dim: int = param(128, "embedding size (rows of W)", bounds="[1, inf)", search="64/128/256/512")
    loss: str = param("proxy_anchor", "metric loss")
    loss_param: tuple[str, ...] = param((), "loss parameters key=value,...")
    mode: Literal["frozen", "tail", "finetune"] = param(
        "frozen", "frozen: train the neck (and losses) on cached trunk features; tail: also the last --train-blocks "
        "stages, over the frozen prefix's cached output maps (no augmentation: the cache holds one view per image); "
        "finetune: the whole network on augmented images", search="frozen/tail/finetune")
    train_blocks: int = param(0, "stages trained at the end of the backbone (`python -m training list backbones` "
                                 "lists them); N > 0 alone means --mode tail; 0: the mode's own (frozen 0, tail 1, "
                                 "finetune all)", bounds="[0, inf)", search={"tail": "1..3"})
    bn_freeze: Literal["auto", "on", "off"] = param(
        "auto", "keep the trained stages' BatchNorm statistics frozen too (eval mode; the frozen prefix's always "
        "are), as in the Proxy-Anchor recipe: small class-balanced batches make them drift; auto: on for pretrained "
        "weights, off from scratch (--weights none)")
    lr_decay: float = param(1.0, "layer-wise learning-rate decay: each trained stage, counting back from the last, "
                                 "gets lr × this^k", bounds="(0, 1]")
    # searched per mode: a tail or fine-tune epoch costs 5-50 times a frozen-neck one on cached features
    epochs: int = param(30, "training epochs", bounds="[1, inf)",
                        search={"frozen": "10..40", "tail": "3..12", "finetune": "2..8"})
    batch_size: int = param(120, "batch size", bounds="[1, inf)", search="60/120/240")
    m_per_class: int = param(4, "images per class in a batch (m-per-class sampler)", bounds="[1, inf)",
                           search="2/4")
    lr: float = param(1e-4, "base learning rate", bounds="(0, inf)", search="1e-5..1e-3 log")
    backbone_lr_mult: float = param(1.0, "trained backbone stages' learning rate = lr × this (the last one; see "
                                         "--lr-decay)", bounds="(0, inf)")
    neck_lr_mult: float = param(10.0, "neck learning rate = lr × this; 0 keeps the neck W at its initialisation "
                                      "while the rest trains (paper 004's regime: its checkpoints train the neck "
                                      "at lr 1e-6, so W barely moves)", bounds="[0, inf)")
    neck_init: Literal["orthogonal", "pytorch"] = param(
        "orthogonal", "the neck's initial W: orthogonal (rows orthonormal) | pytorch (nn.Linear's default uniform "
        "init, as paper 004's checkpoints: tr(WᵀW) ≈ 42.7 for 128 rows)")
    proxy_lr_mult: float = param(100.0, "proxy/loss learning rate = lr × this", bounds="(0, inf)")
    weight_decay: float = param(1e-4, "AdamW weight decay", bounds="[0, inf)")
    warmup_epochs: int = param(0, "tail/finetune: first epochs with the backbone frozen (the neck and proxies "
                                  "settle first: a gradual unfreeze)", bounds="[0, inf)")
    probe_epochs: int = param(-1, "tail/finetune: epochs that train the neck and the loss alone, on cached "
                                  "frozen-trunk features, before the trunk trains (linear probing, then "
                                  "fine-tuning: settled proxies keep the first steps from distorting the "
                                  "pretrained trunk); the probe's best epoch, as a frozen-neck run selects it, is "
                                  "the first selection candidate (epoch 0), so the run never selects a model below "
                                  "the frozen neck of the same seed on validation; -1: 30 for tail and finetune "
                                  "from pretrained weights (without it a 2-stage tail fell below the frozen neck "
                                  "on a 1,900-class icon folder: its random neck and proxies pull the trunk off "
                                  "its features first), 0 from scratch")
    grad_clip: float = param(10.0, "gradient-norm clip (0 = off)", bounds="[0, inf)")
    schedule: Literal["cosine", "none"] = param("cosine", "learning-rate schedule")
    seed: int = param(0, "training seed: same seed, same metrics", bounds="[0, inf)")
    regularizer: tuple[str, ...] = param((), "regularizers to add (comma-separated)")
    reg_weight: tuple[float, ...] = param((), "their weights, same order; empty: each regularizer's own",
                                          bounds="[0, inf)")
    reg_param: tuple[str, ...] = param((), "regularizer parameters name.key=value,...")
    resume: bool = param(False, "continue from the run folder's latest checkpoint")
    overwrite: bool = param(False, "replace an existing run in --out (only a run folder of ours; without it such a "
                                   "folder is refused unless --resume)")
    precision: Literal["fp32", "bf16", "fp16"] = param(
        "fp32", "forward-pass precision (autocast; fp16 adds a gradient scaler and needs CUDA); losses, flows and "
        "log-determinants stay fp32. Its cost for efficientnet_lite0 (docs/training.md#precision): a bf16 training "
        "step runs at 0.58x fp32's speed at 64 px and 1.11x at 224 px on the 2-core CPU, and at 0.88x (64 px) and "
        "1.12x (224 px, channels_last) on an H200")
    device: str = param("auto", "auto (CUDA when available) | cpu | cuda | cuda:N")
    image_cache: Literal["auto", "on", "off"] = param(
        "auto", "finetune: decode every training and validation image once into a uint8 cache at the input size "
        "(memory-mapped under --cache-dir, reused by every epoch and run), cut each batch's random crops and flips "
        "with torch on the training device, and validate from the cache; off: decode and augment each image in "
        "--workers loader processes every epoch; auto: on while the cache takes at most 16 GiB (the two give "
        "different crops from the same seed)")
    channels_last: Literal["auto", "on", "off"] = param(
        "auto", "tail/finetune: run the backbone in channels_last memory layout; auto: where it was measured faster "
        "for fine-tuning efficientnet_lite0 (docs/training.md#training-speed): on the CPU (1.54x at 64 px, 1.51x at "
        "224 px, fp32) and on CUDA from 128 px (1.54x at 224 px on an H200, slower at 64 px); a tail stays "
        "in the default layout, so that tail runs reproduce their recorded results (on: 1.55x at 64 px, 1.10x at "
        "224 px on the CPU)")
    compile: bool = param(False, "tail/finetune: compile the trained part of the backbone with torch.compile (CUDA: "
                                 "its CUDA-graph mode, reduce-overhead; the CPU: inductor's default); the first step "
                                 "pays the compilation. On the CPU, compiled, efficientnet_lite0's fine-tuning step "
                                 "at 64 px ran at 0.97x the eager one, after about 2 minutes of compiling; on CUDA "
                                 "it is not measured yet")
    deterministic: bool = param(False, "deterministic kernels only (cuDNN without autotuning, cuBLAS with a fixed "
                                       "workspace): a CUDA run then repeats bit for bit, at some cost in speed; an op "
                                       "with no deterministic kernel warns")
    tensorboard: bool = param(False, "also write TensorBoard events to the run folder's tb/ (losses, learning "
                                     "rates, validation, the test embeddings for the projector)")
    cache_dir: str = param("cache/features", "trunk-feature and prefix-map cache folder")
    threads: int = param(0, "torch threads for this command (0 = torch's default)", bounds="[0, inf)")
    progress: bool = param(True, "show progress bars")

    def identity(self) -> dict:
        """What decides the result: everything but the runtime fields."""
        d = dataclasses.asdict(self)
        for k in RUNTIME_FIELDS:
            d.pop(k, None)
        d["probe_epochs"] = self.resolved_probe_epochs()  # "auto" is what it means for this mode
        return d

    def resolved_probe_epochs(self) -> int:
        """The probe's epochs: none in frozen mode (the whole run is one); -1 means the mode's default."""
        mode = self.resolved_mode()
        if mode == "frozen" or self.probe_has_nothing_to_train():
            return 0
        if self.probe_epochs < 0:  # there is nothing to preserve in random weights
            return 30 if self.pretrained() else 0
        return self.probe_epochs

    def probe_has_nothing_to_train(self) -> bool:
        """A neck held at its initialisation with a loss without proxies and no regularizer: the
        probe (neck, loss, regularizer modules) has no parameter to train, so the run skips it, and
        its recorded probe is 0 (a reused run compares equal)."""
        from .losses.registry import LOSSES  # the loss's registration says whether it has proxies

        return (self.neck_lr_mult == 0 and not self.regularizer and self.loss in LOSSES
                and not LOSSES.get(self.loss).spec.proxies)

    def resolved_mode(self) -> str:
        """`--train-blocks N` alone (mode left at frozen) means tail."""
        return "tail" if self.mode == "frozen" and self.train_blocks > 0 else self.mode

    def n_train_blocks(self, n_stages: int) -> int:
        """How many of the backbone's `n_stages` stages train."""
        mode = self.resolved_mode()
        if mode == "frozen":
            return 0
        if mode == "finetune":
            return self.train_blocks or n_stages
        return self.train_blocks or 1

    def pretrained(self) -> bool:
        from model.backbones import BACKBONES

        return (self.weights or BACKBONES.get(self.backbone).spec.default_weights) != "none"

    def freezes_bn(self) -> bool:
        return self.pretrained() if self.bn_freeze == "auto" else self.bn_freeze == "on"

    def uses_image_cache(self, n_images: int, image_size: int) -> bool:
        """Fine-tuning from the decoded-image cache (`n_images` train + validation images at
        `image_size` px), rather than a loader that decodes every epoch."""
        from model.features import image_cache_bytes

        if self.resolved_mode() != "finetune" or self.image_cache == "off":
            return False
        return self.image_cache == "on" or image_cache_bytes(n_images, image_size) <= IMAGE_CACHE_AUTO_BYTES

    def data_config(self) -> DataConfig:
        """The data settings; `--image-size 0` on a photo data set means the backbone's own input size."""
        from model.backbones.registry import sized_for

        return sized_for(DataConfig.from_dict(dataclasses.asdict(self)), self.backbone)

    def validate(self) -> None:
        """Refuse an impossible configuration, all of it, before anything is read or written."""
        from model.backbones import BACKBONES
        from model.backbones.registry import stage_count
        from model.device import resolve_device

        from .losses import LOSSES, has_proxies
        from .regularizers import REGULARIZERS, regularizer_params

        DataConfig.validate(self)
        BACKBONES.get(self.backbone)
        resolve_device(self.device)
        n_stages = stage_count(self.backbone)  # 0 for timm:NAME: its stages are known once it is built
        LOSSES.params(self.loss, self.loss_param)
        checks = [
            (bool(self.cache_dir.strip()), "--cache-dir must name a folder: training keeps the trunk's features, "
                                           "prefix maps and decoded images there"),
            (self.batch_size % max(self.m_per_class, 1) == 0,
             f"batch size {self.batch_size} must be a multiple of m_per_class {self.m_per_class}"),
            (self.probe_epochs >= -1,
             f"--probe-epochs must be ≥ 0 (or -1: the mode's default), got {self.probe_epochs}"),
            (len(set(self.regularizer)) == len(self.regularizer),
             f"regularizer listed twice: {list(self.regularizer)}"),
            (not self.reg_weight or len(self.reg_weight) == len(self.regularizer),
             f"--reg-weight has {len(self.reg_weight)} values for {len(self.regularizer)} regularizer(s)"),
            (not (self.resume and self.overwrite), "give --resume or --overwrite, not both"),
            (self.resolved_mode() != "tail" or not n_stages or self.n_train_blocks(n_stages) < n_stages,
             f"--mode tail trains 1 … {(n_stages or 2) - 1} of {self.backbone}'s {n_stages} stages, got "
             f"--train-blocks {self.train_blocks} (all of them is --mode finetune)"),
            (self.resolved_mode() != "finetune" or not n_stages or self.train_blocks in (0, n_stages),
             f"--mode finetune trains all {n_stages} stages; for fewer use --mode tail --train-blocks N"),
            (self.precision != "fp16" or resolve_device(self.device).type == "cuda",
             "--precision fp16 needs CUDA; on the CPU use bf16 or fp32"),
        ]
        for ok, msg in checks:
            if not ok:
                raise UserError(msg)
        for name in self.regularizer:
            if getattr(REGULARIZERS.get(name).builder, "needs_proxies", False) and not has_proxies(self.loss):
                proxy_losses = ", ".join(n for n in LOSSES.names() if has_proxies(n))
                raise UserError(f"regularizer {name!r} acts on class proxies; loss {self.loss!r} has none "
                                f"(use a proxy loss: {proxy_losses})")
        regularizer_params(self.regularizer, self.reg_param)


def as_in_train(name: str):
    """A field of another command's settings with `train`'s default and help: one flag, one meaning."""
    f = TrainConfig.__dataclass_fields__[name]
    return dataclasses.field(default=f.default, metadata=f.metadata)
