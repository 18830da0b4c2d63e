"""The training loop: frozen-backbone (cached features) or full fine-tuning.

Model selection uses MAP@R on the validation classes only; the selected
checkpoint is evaluated once on the test classes at the end.  Every epoch
writes `latest.pt` atomically, so a run killed at any moment resumes from its
last complete epoch (`--resume`); each epoch's randomness is seeded from
(seed, epoch), so a resumed run matches an uninterrupted one exactly.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from core.atomic import write_json, write_text
from core.errors import UserError
from evaluation import evaluate
from model.backbones import build_backbone
from model.checkpoint import read_checkpoint, save_checkpoint
from model.network import EmbeddingModel

from data import load_data
from data.config import resolve
from model.features import cached_features, embed_subset
from model.preprocess import transform_for

from .config import RUNTIME_FIELDS, TrainConfig
from .losses import LOSSES, build_loss

log = logging.getLogger("training")


def seed_epoch(seed: int, epoch: int) -> None:
    s = (seed * 100_003 + epoch) % (2**31)
    torch.manual_seed(s)
    np.random.seed(s)
    import random

    random.seed(s)


class Run:
    """Everything one training run holds; `fit()` trains, selects and tests."""

    def __init__(self, cfg: TrainConfig, on_epoch_end=None):
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.on_epoch_end = on_epoch_end  # test hook: called with the epoch number
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if cfg.loss not in LOSSES:
            raise UserError(f"unknown loss {cfg.loss!r}; choose from {sorted(LOSSES)}")
        if cfg.batch_size % cfg.m_per_class:
            raise UserError(f"batch size {cfg.batch_size} must be a multiple of m_per_class {cfg.m_per_class}")

    # ------------------------------------------------------------ set-up
    def setup(self):
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        self.splits = load_data(cfg.data_config(), progress=cfg.progress)
        # concrete size and resize mode, recorded in every checkpoint for downstream commands
        self.dcfg = resolve(cfg.data_config(), self.splits)
        self.backbone = build_backbone(cfg.backbone, weights=cfg.weights)
        self.model = EmbeddingModel(self.backbone, cfg.embed_dim)
        self.spec = transform_for(self.backbone, self.dcfg)
        train_classes = self.splits.train.classes
        if len(train_classes) < 2:
            raise UserError("training needs at least 2 train classes")
        self.label_map = {c: i for i, c in enumerate(train_classes)}
        self.loss, self.loss_params = build_loss(cfg.loss, len(train_classes), cfg.embed_dim, cfg.loss_param)
        from .regularizers import build_regularizers

        self.regs = build_regularizers(cfg, self)
        if cfg.mode == "frozen":
            self._load_feature_cache()
        self.opt = self._optimizer()
        self.sched = (torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=max(1, cfg.epochs))
                      if cfg.schedule == "cosine" else torch.optim.lr_scheduler.LambdaLR(self.opt, lambda e: 1.0))

    def _embed(self, subset, spec):
        fn = self.backbone.eval()
        return embed_subset(fn, subset, spec, self.dcfg, f"features {subset.name}", self.cfg.progress)

    def _load_feature_cache(self):
        self.cache = {}
        for name in ("train", "val"):
            sub = self.splits.get(name)
            f, y, _ = cached_features(self.backbone, self.splits, sub, self.spec, self._embed,
                                      self.cfg.cache_dir, self.cfg.progress)
            self.cache[name] = (torch.from_numpy(f), y)
        for p in self.backbone.parameters():
            p.requires_grad_(False)

    def _optimizer(self):
        cfg = self.cfg
        groups = [{"params": list(self.model.neck.parameters()), "lr": cfg.lr * cfg.neck_lr_mult, "name": "neck"}]
        if cfg.mode == "finetune":
            groups.append({"params": list(self.backbone.parameters()), "lr": cfg.lr, "name": "backbone"})
        loss_params = list(self.loss.parameters())
        for reg in self.regs:  # a regularizer's own copy of the loss (dueling g_max) is a loss too
            loss_params += [p for n, p in reg.module.named_parameters() if n.startswith("max_loss")]
        if loss_params:
            groups.append({"params": loss_params, "lr": cfg.lr * cfg.proxy_lr_mult, "name": "loss",
                           "weight_decay": 0.0})
        heads = [p for h in (self.model.trunk_head, self.model.embed_head) if h is not None for p in h.parameters()]
        if heads:  # flow metric layers: 1e-3 with the default base lr 1e-4 (paper 000)
            groups.append({"params": heads, "lr": cfg.lr * 10.0, "name": "heads"})
        for reg in self.regs:
            ps = [p for n, p in reg.module.named_parameters() if p.requires_grad and not n.startswith("max_loss")]
            if ps:
                groups.append({"params": ps, "lr": cfg.lr * reg.lr_mult, "name": f"reg:{reg.name}"})
        # a proxy loss whose proxies miss the optimizer silently never learns them
        in_opt = {id(p) for g in groups for p in g["params"]}
        missing = [n for n, p in self.loss.named_parameters() if id(p) not in in_opt]
        assert not missing, f"loss parameters not optimised: {missing}"
        return torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)

    # ------------------------------------------------------------ batches
    def _epoch_batches(self, labels: np.ndarray, steps: int) -> list[np.ndarray]:
        from pytorch_metric_learning.samplers import MPerClassSampler

        cfg = self.cfg
        if self.paired:  # CGML: two class-aligned half-size batches per step (X′ then X″)
            from .samplers import paired_class_batches

            n_cls = max(2, cfg.batch_size // (2 * cfg.m_per_class))
            return paired_class_batches(labels, n_cls, cfg.m_per_class, steps, np.random.default_rng(
                np.random.randint(2**31)))
        n_classes = len(np.unique(labels))
        bs = min(cfg.batch_size, cfg.m_per_class * n_classes)
        bs -= bs % cfg.m_per_class
        sampler = MPerClassSampler(labels, cfg.m_per_class, batch_size=bs, length_before_new_iter=steps * bs)
        idx = np.fromiter(iter(sampler), dtype=np.int64)
        return [idx[i: i + bs] for i in range(0, len(idx), bs)]

    def steps_per_epoch(self, n: int) -> int:
        return max(1, math.ceil(n / self.cfg.batch_size))

    @property
    def paired(self) -> bool:
        return any(r.paired for r in self.regs)

    def _train_step(self, backbone_feats: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """One step's loss from backbone outputs: base loss (per half when paired) + regularizers."""
        phi = self.model.head_trunk(backbone_feats)
        neck = self.model.neck(phi)
        emb = neck if self.model.embed_head is None else self.model.embed_head(neck)
        parts: dict[str, float] = {}
        ctx = {"y": y, "emb": emb, "neck": neck, "trunk": phi, "backbone": backbone_feats,
               "loss": self.loss, "model": self.model, "parts": parts}
        if self.paired:
            h = len(y) // 2
            loss = self.loss(emb[:h], y[:h]) + self.loss(emb[h:], y[h:])
            ctx["emb_halves"] = (emb[:h], emb[h:])
        else:
            loss = self.loss(emb, y)
        parts["loss"] = float(loss.detach())
        for reg in self.regs:
            t = reg.term(ctx)
            parts[reg.name] = float(t.detach())
            loss = loss + t
        return loss, parts

    def _step(self, loss: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.cfg.grad_clip > 0:
            params = [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        self.opt.step()

    def _train_epoch_frozen(self, epoch: int) -> dict:
        feats, labels = self.cache["train"]
        ymap = torch.tensor([self.label_map[int(v)] for v in labels])
        self.model.train()
        self.backbone.eval()  # frozen: its BatchNorm statistics stay as they are
        sums: dict[str, float] = {}
        batches = self._epoch_batches(labels, self.steps_per_epoch(len(labels)))
        for b in tqdm(batches, desc=f"epoch {epoch + 1}", leave=False, disable=not self.cfg.progress):
            bt = torch.from_numpy(b)
            loss, parts = self._train_step(feats[bt], ymap[bt])
            self._step(loss)
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v
        return {k: v / len(batches) for k, v in sums.items()}

    def _train_epoch_finetune(self, epoch: int) -> dict:
        cfg = self.cfg
        sub = self.splits.train
        labels = np.asarray(sub.labels)
        frozen = epoch < cfg.warmup_epochs
        for p in self.backbone.parameters():
            p.requires_grad_(not frozen)
        self.model.train()
        if frozen:
            self.backbone.eval()
        spec = dataclasses.replace(self.spec, augment=True)
        batches = self._epoch_batches(labels, self.steps_per_epoch(len(labels)))
        from torch.utils.data import DataLoader

        from data.loader import ImageDataset, collate_skip

        loader = DataLoader(ImageDataset(sub, spec.build()), batch_sampler=batches,
                            num_workers=self.dcfg.workers, collate_fn=collate_skip)
        sums: dict[str, float] = {}
        n = 0
        self.skipped = getattr(self, "skipped", 0)
        for images, y, _, bad in tqdm(loader, desc=f"epoch {epoch + 1}", leave=False, disable=not cfg.progress):
            self.skipped += len(bad)
            for _, msg in bad:
                log.warning("skipped: %s", msg)
            if images is None or len(y) < 2 or (self.paired and bad):
                continue  # (a paired batch that lost an image is no longer class-aligned)
            ymap = torch.tensor([self.label_map[int(v)] for v in y])
            loss, parts = self._train_step(self.backbone(images), ymap)
            self._step(loss)
            n += 1
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + v
        return {k: v / max(n, 1) for k, v in sums.items()}

    # ------------------------------------------------------------ evaluation
    @torch.inference_mode()
    def embed_split(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        self.model.eval()
        if self.cfg.mode == "frozen" and name in self.cache:
            f, y = self.cache[name]
            return self.model.embed_of_backbone(f).numpy(), y
        sub = self.splits.get(name)
        e, y, _, _ = embed_subset(self.model, sub, self.spec, self.dcfg, f"embed {name}", self.cfg.progress)
        return e, y

    def validate(self) -> dict:
        e, y = self.embed_split("val")
        return evaluate(e, y, clustering=False)

    # ------------------------------------------------------------ checkpoints
    def _extra(self, epoch: int, best: float, best_epoch: int, history: list, with_opt: bool) -> dict:
        extra = {"loss_name": self.cfg.loss, "loss_params": self.loss_params,
                 "loss_state": {k: v.detach().cpu() for k, v in self.loss.state_dict().items()},
                 "label_map": [[int(k), int(v)] for k, v in self.label_map.items()],
                 "regularizers": {r.name: r.export() for r in self.regs},
                 "epoch": epoch, "best": best, "best_epoch": best_epoch, "history": history}
        if with_opt:
            extra["optimizer"] = self.opt.state_dict()
            extra["scheduler"] = self.sched.state_dict()
            extra["reg_state"] = {r.name: {k: v.detach().cpu() for k, v in r.module.state_dict().items()}
                                  for r in self.regs}
        return extra

    def _data_record(self) -> dict:
        return {"config": self.dcfg.data_fields(), "transform": self.spec.describe()}

    def _split_record(self) -> dict:
        return {k: s.classes for k, s in self.splits.subsets().items()}

    def _save(self, name: str, epoch, best, best_epoch, history, metrics=None, with_opt=False):
        save_checkpoint(self.out / name, self.model, config=dataclasses.asdict(self.cfg),
                        split=self._split_record(), metrics=metrics or {}, data=self._data_record(),
                        extra=self._extra(epoch, best, best_epoch, history, with_opt))

    def _restore(self, ck: dict) -> tuple[int, float, int, list]:
        self.model.load_state_dict(ck["state_dict"])
        ex = ck["extra"]
        self.loss.load_state_dict(ex["loss_state"])
        for r in self.regs:
            r.module.load_state_dict(ex["reg_state"][r.name])
        self.opt.load_state_dict(ex["optimizer"])
        self.sched.load_state_dict(ex["scheduler"])
        return ex["epoch"], ex["best"], ex["best_epoch"], ex["history"]

    # ------------------------------------------------------------ the run
    def fit(self) -> dict:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        cfg_path = self.out / "config.json"
        start, best, best_epoch, history = 0, -1.0, -1, []
        if cfg.resume and (self.out / "latest.pt").is_file():
            old = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
            old_id = {k: v for k, v in old.items() if k not in RUNTIME_FIELDS}
            if json.loads(json.dumps(old_id)) != json.loads(json.dumps(cfg.identity())):
                raise UserError(f"cannot resume {self.out}: its config.json differs from this run's config")
        self.setup()
        if cfg.resume and (self.out / "latest.pt").is_file():
            start, best, best_epoch, history = self._restore(read_checkpoint(self.out / "latest.pt"))
            log.info("resumed %s at epoch %d (best val MAP@R %.4f)", self.out, start, best)
        elif cfg.resume:
            log.info("nothing to resume in %s; starting fresh", self.out)
        write_json(cfg_path, dataclasses.asdict(cfg))
        t0 = time.time()
        for epoch in range(start, cfg.epochs):
            seed_epoch(cfg.seed, epoch)
            te = time.time()
            parts = (self._train_epoch_frozen(epoch) if cfg.mode == "frozen" else self._train_epoch_finetune(epoch))
            self.sched.step()
            val = self.validate()
            rec = {"epoch": epoch + 1, **{f"train_{k}": v for k, v in parts.items()},
                   "val_map@r": val["map@r"], "val_recall@1": val["recall@1"],
                   "val_r_precision": val["r_precision"], "seconds": round(time.time() - te, 3)}
            history.append(rec)
            log.info("epoch %d/%d loss %.4f val MAP@R %.4f R@1 %.4f", epoch + 1, cfg.epochs,
                     parts.get("loss", float("nan")), val["map@r"], val["recall@1"])
            if val["map@r"] > best:
                best, best_epoch = val["map@r"], epoch + 1
                self._save("best.pt", epoch + 1, best, best_epoch, history, metrics={"val": val})
            self._save("latest.pt", epoch + 1, best, best_epoch, history, with_opt=True)
            write_text(self.out / "log.jsonl", "".join(json.dumps(h) + "\n" for h in history))
            if self.on_epoch_end:
                self.on_epoch_end(epoch + 1)
        return self.finish(best, best_epoch, history, time.time() - t0)

    def finish(self, best, best_epoch, history, train_seconds) -> dict:
        """Load the validation-selected checkpoint and evaluate it once on test."""
        ck = read_checkpoint(self.out / "best.pt")
        self.model.load_state_dict(ck["state_dict"])
        self.loss.load_state_dict(ck["extra"]["loss_state"])
        test = self.test_metrics()
        metrics = {"selected_epoch": best_epoch, "val": ck["metrics"]["val"], "test": test,
                   "train_seconds": round(train_seconds, 2), "epochs": self.cfg.epochs,
                   "n_skipped_images": int(getattr(self, "skipped", 0))}
        save_checkpoint(self.out / "best.pt", self.model, config=ck["config"], split=ck["split"],
                        metrics=metrics, extra=ck["extra"], data=ck["data"])
        write_json(self.out / "metrics.json", metrics)
        plot_curves(history, self.out / "curve.png", best_epoch)
        return metrics

    @torch.inference_mode()
    def test_metrics(self) -> dict:
        self.model.eval()
        query, gallery = self.splits.eval_pair("test")
        if self.cfg.mode == "frozen":
            def embed(sub):
                f, y, _ = cached_features(self.backbone, self.splits, sub, self.spec, self._embed,
                                          self.cfg.cache_dir, self.cfg.progress)
                return self.model.embed_of_backbone(f), y
        else:
            def embed(sub):
                e, y, _, _ = embed_subset(self.model, sub, self.spec, self.dcfg, f"embed {sub.name}",
                                          self.cfg.progress)
                return e, y
        from evaluation.diagnostics import embedding_diagnostics

        q, ql = embed(query)
        if gallery is None:
            return evaluate(q, ql) | embedding_diagnostics(q, ql)
        g, gl = embed(gallery)
        return evaluate(q, ql, g, gl) | embedding_diagnostics(g, gl)


def plot_curves(history: list, path: Path, best_epoch: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from core.atomic import write_with

    ep = [h["epoch"] for h in history]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
    for k in [k for k in history[0] if k.startswith("train_")]:
        ax[0].plot(ep, [h[k] for h in history], label=k[6:])
    ax[0].set_xlabel("epoch")
    ax[0].set_title("training loss terms")
    ax[0].legend(fontsize=7)
    ax[1].plot(ep, [h["val_map@r"] for h in history], label="val MAP@R")
    ax[1].plot(ep, [h["val_recall@1"] for h in history], label="val R@1")
    ax[1].axvline(best_epoch, color="gray", ls=":", label="selected")
    ax[1].set_xlabel("epoch")
    ax[1].set_title("validation classes")
    ax[1].legend(fontsize=7)
    fig.tight_layout()
    write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=90))
    plt.close(fig)


def train(cfg: TrainConfig, on_epoch_end=None) -> dict:
    return Run(cfg, on_epoch_end).fit()


def finished_run(cfg: TrainConfig) -> dict | None:
    """metrics.json of a completed run in cfg.out with the same identity, else None."""
    out = Path(cfg.out)
    try:
        old = json.loads((out / "config.json").read_text())
        metrics = json.loads((out / "metrics.json").read_text())
    except (OSError, ValueError):
        return None
    if not (out / "best.pt").is_file():
        return None
    same = {k: v for k, v in old.items() if k in cfg.identity()} == json.loads(json.dumps(cfg.identity()))
    return metrics if same else None


def train_or_reuse(cfg: TrainConfig) -> tuple[dict, bool]:
    """Reuse a finished run of the same config; otherwise train (resuming if possible)."""
    m = finished_run(cfg)
    if m is not None:
        log.info("reusing trained run %s (same config)", cfg.out)
        return m, True
    latest = Path(cfg.out) / "latest.pt"
    return train(dataclasses.replace(cfg, resume=latest.is_file())), False
