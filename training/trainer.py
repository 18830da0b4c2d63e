"""The training run: frozen backbone (cached features), trained tail (cached frozen prefix) or
full fine-tuning, on any device, in one process or data-parallel under torchrun.

`Run` reads as its steps: `setup` (data, model, batch source, device placement, the optional
linear probe, optimizer and step, run folder), `train_epoch` and `end_epoch` (validate, select,
checkpoint), and `fit` (set up, resume, the epochs, test the selected checkpoint once).  Parts:
batch sources (training/batches.py), the batch draw (training/samplers.py), the step
(training/step.py), checkpoints (training/checkpoints.py), selection on validation MAP@R
(training/selection.py).  Every epoch writes `latest.pt` atomically, and every random stream is
seeded by (seed, epoch), so `--resume` ends exactly where an uninterrupted run does.

Under `torchrun --nproc_per_node N -m training train …` (training/distributed.py) each rank
trains on its block of classes of the one-process batches through a DDP-wrapped step; rank 0
builds the data and caches first, validates and broadcasts the result, and alone writes the run
folder.  docs/training.md and docs/scale-out.md describe both.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from core.atomic import write_json, write_text
from core.errors import UserError
from data import load_data
from data.config import resolve
from model.backbones import build_backbone
from model.checkpoint import read_checkpoint, save_checkpoint
from model.device import compiled, deterministic_algorithms, resolve_device, use_channels_last
from model.network import EmbeddingModel
from model.preprocess import transform_for

from . import distributed as ddp
from .batches import BatchSource, CachedImages, FrozenFeatures, ImageBatches, PrefixTail, SourceConfig
from .checkpoints import Checkpoints, check_out, recorded_config, same_identity, write_config
from .config import TrainConfig
from .losses import build_loss, has_proxies
from .regularizers import build_regularizers
from .regularizers.skewed_mean import max_proxy_cosine
from .samplers import check_split, epoch_batches, epoch_rng, epoch_seed, epoch_steps
from .selection import Selection, test_metrics, val_metrics
from .step import Step, build_optimizer, paired_batches
from .tensorboard import RunBoard

log = logging.getLogger("training")


def epoch_generators(seed: int, epoch: int, device: torch.device | str = "cpu", rank: int | None = None
                     ) -> tuple[np.random.RandomState, torch.Generator, int]:
    """An epoch's generators, all from (seed, epoch): the sampler's numpy generator (the same on
    every rank: samplers.epoch_rng), a torch generator for the regularizers, and the seed torch's
    own generator gets for this epoch (dropout; a loader's worker seeds).  With `rank` (a torchrun
    run of several ranks) the regularizers' stream is seeded by (seed, epoch, rank): each rank
    draws its own tangent-plane partners (and, from augment_generator, its own augmentations),
    reproducibly on resume."""
    reg_seed = int(_epoch_seeds(seed, epoch, rank)[0])
    # the regularizers draw on the model's device, so their generator lives there
    return epoch_rng(seed, epoch), torch.Generator(device=device).manual_seed(reg_seed), epoch_seed(seed, epoch)


def _epoch_seeds(seed: int, epoch: int, rank: int | None) -> np.ndarray:
    key = [seed, epoch] if rank is None else [seed, epoch, rank]
    return np.random.SeedSequence(key).generate_state(2)


def augment_generator(seed: int, epoch: int, rank: int | None = None) -> torch.Generator:
    """The CPU generator an epoch's augmentations come from (a stream of its own, beside
    epoch_generators'): the same crops on every device, redrawn exactly on resume."""
    return torch.Generator().manual_seed(int(_epoch_seeds(seed, epoch, rank)[1]))


@contextlib.contextmanager
def torch_seeded(seed: int):
    """torch's own generator seeded for this block only; the caller's state is restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


class Run:
    """One training run; `fit()` trains, selects on validation and tests once."""

    def __init__(self, cfg: TrainConfig, on_epoch_end=None, report=None):
        cfg.validate()
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.on_epoch_end = on_epoch_end  # test hook: called with the epoch number
        # called after each epoch with (step, best validation MAP@R so far), a tuner prunes or stops the run
        # from it by raising; the probe's epochs are the first steps, so a tail's or fine-tune's probe is
        # compared step for step with a frozen-neck run's epochs, which it repeats
        self.report = report
        self.dist: ddp.Dist | None = None  # set under torchrun
        self.main = True                   # this process writes the run folder (rank 0)
        self.skipped = 0                   # unreadable images skipped by training batches
        self.probe_best: tuple[dict, int, dict] | None = None  # the probe's (val, epoch, state); see probe()

    # ------------------------------------------------------------ set-up
    def setup(self, resuming: bool = False) -> None:
        """Everything a run holds, in order; `resuming`: a run with a latest.pt to continue."""
        self.load_splits()
        self.build_model()
        self.device = self.dist.device if self.dist else resolve_device(self.cfg.device)
        # the frozen part's outputs are computed (and cached) before anything moves: same bits on any device
        probe_source, n_probe = self.build_sources(resuming)
        self.place_on_device()
        # before DDP wraps the step: every rank probes alike, and DDP then starts them from rank 0's state
        self.probe_entry = self.probe(probe_source, n_probe) if probe_source is not None else None
        self.build_step()
        self.open_folder(resuming)

    def load_splits(self) -> None:
        """The data set's splits (rank 0 renders/verifies it while the others wait), and the concrete
        size and resize mode, recorded in every checkpoint for downstream commands."""
        cfg = self.cfg
        with ddp.rank_zero_first():
            self.splits = load_data(cfg.data_config(), progress=cfg.progress and self.main)
        if len(self.splits.train.classes) < 2:
            raise UserError("training needs at least 2 train classes")
        self.dcfg = resolve(cfg.data_config(), self.splits)
        self.label_map = {c: i for i, c in enumerate(self.splits.train.classes)}

    def build_model(self) -> None:
        """Backbone, neck, loss and regularizers, their initial weights from the run's seed; refuses a
        batch that does not split over the ranks before any cache is built."""
        cfg = self.cfg
        with torch_seeded(cfg.seed):
            self.backbone = build_backbone(cfg.backbone, weights=cfg.weights)
            self.model = EmbeddingModel(self.backbone, cfg.embed_dim)
            if cfg.neck_init == "pytorch":
                self.model.neck.linear.reset_parameters()  # nn.Linear's own default init
            self.model.neck.requires_grad_(cfg.neck_lr_mult > 0)
            self.loss, self.loss_params = build_loss(cfg.loss, len(self.label_map), cfg.embed_dim, cfg.loss_param)
            self.regs = build_regularizers(cfg, self.loss, self.backbone.dim)
        for r in self.regs:  # flow metric layers a regularizer brings become the model's heads
            for name, head in r.heads().items():
                setattr(self.model, name, head)
        self.transform = transform_for(self.backbone, self.dcfg)
        self.n_train = cfg.n_train_blocks(len(self.backbone.stages()))
        check_split(len(self.label_map), cfg.batch_size, cfg.m_per_class, paired_batches(self.regs),
                    self.dist.world if self.dist else 1)

    def build_sources(self, resuming: bool) -> tuple[BatchSource | None, int]:
        """The run's batch source (rank 0 builds its cache, the others then read it), and the linear
        probe's frozen-feature source with its epoch count (None, 0 when there is no probe)."""
        cfg, mode = self.cfg, self.cfg.resolved_mode()
        sources = SourceConfig(backbone=self.backbone, splits=self.splits, transform=self.transform, dcfg=self.dcfg,
                               cache_dir=cfg.cache_dir, progress=cfg.progress and self.main, device=self.device,
                               n_train=self.n_train, warmup_epochs=cfg.warmup_epochs, bn_freeze=cfg.freezes_bn())
        kinds: dict[str, Callable[[SourceConfig], BatchSource]] = {
            "frozen": FrozenFeatures, "tail": PrefixTail, "finetune": ImageBatches}
        source_type = kinds[mode]
        if mode == "finetune" and cfg.uses_image_cache(len(self.splits.train) + len(self.splits.val),
                                                       self.dcfg.resolved_image_size()):
            source_type = CachedImages
        if mode == "finetune" and self.main:
            log.info("fine-tuning crops: %s", "batched, from the decoded-image cache"
                     if source_type is CachedImages else "per image, in the loader")
        n_probe = 0 if resuming else cfg.resolved_probe_epochs()  # a resumed run has had its probe
        probed = [p for m in (self.model.neck, self.loss, *[r.module for r in self.regs]) for p in m.parameters()]
        if not any(p.requires_grad for p in probed):
            n_probe = 0  # nothing for a probe to train: a neck held at its initialisation and a loss without proxies
        with ddp.rank_zero_first():
            self.source = source_type(sources)
            probe_source = FrozenFeatures(sources) if n_probe else None
        return probe_source, n_probe

    def place_on_device(self) -> None:
        """The modules on the training device; the memory layout and compilation of the trained part."""
        cfg, dev, mode = self.cfg, self.device, self.cfg.resolved_mode()
        for m in (self.model, self.loss, *[r.module for r in self.regs]):  # what a regularizer owns is its module
            m.to(dev)
        # channels_last before the optimizer exists: its state takes the parameters' layout
        fmt = (torch.channels_last if mode != "frozen" and use_channels_last(
            cfg.channels_last, dev, cfg.backbone, self.dcfg.resolved_image_size(), whole_network=mode == "finetune")
            else torch.contiguous_format)
        self.memory_format = fmt
        if fmt == torch.channels_last:
            self.model.backbone.to(memory_format=fmt)
        self.source.memory_format = fmt
        if cfg.compile and mode != "frozen":
            # an instance attribute over the method: every call of the source's encode (the step's, and a
            # tail's embed) runs it compiled
            self.source.encode = compiled(self.source.encode, dev)  # type: ignore[method-assign]

    def build_step(self) -> None:
        """The optimizer, the learning-rate schedule (None: constant), the step (DDP-wrapped under
        torchrun) and the checkpoints that save them."""
        cfg = self.cfg
        opt = build_optimizer(cfg, self.model, self.loss, self.regs, self.n_train)
        self.sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, cfg.epochs))
                      if cfg.schedule == "cosine" else None)
        self.step = Step(self.model, self.loss, self.regs, opt, cfg.grad_clip, self.device, cfg.precision,
                         self.memory_format)
        if self.dist:
            # DDP registers the parameters that require grad when it is built: mark every stage that will
            # ever train (the first epoch after the warm-up); a stage frozen in a warm-up epoch is then an
            # unused parameter, whose gradient DDP leaves None (see training/distributed.py)
            self.source.start_epoch(cfg.warmup_epochs, self.model)
            self.step.distribute(self.dist, find_unused=True if self.n_train and cfg.warmup_epochs else None)
        self.checkpoints = Checkpoints(
            self.out, cfg, self.model, self.loss, self.loss_params, self.regs, opt, self.sched, self.label_map,
            data_record={"config": self.dcfg.data_fields(), "transform": self.transform.describe()},
            split_record={k: s.classes for k, s in self.splits.subsets().items()})
        self.steps_per_epoch = epoch_steps(len(self.source.labels), cfg.batch_size)

    def open_folder(self, resuming: bool) -> None:
        """The run folder (rank 0): a fresh run drops a replaced run's results and TensorBoard events;
        config.toml; the TensorBoard writer (a no-op unless --tensorboard, and on ranks other than 0)."""
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
            if not resuming:
                (self.out / "metrics.json").unlink(missing_ok=True)
                shutil.rmtree(self.out / "tb", ignore_errors=True)
            write_config(self.out, self.cfg)
        self.board = RunBoard(self.out, self.cfg.tensorboard and self.main)

    # ------------------------------------------------------------ the probe
    def probe(self, source: BatchSource, epochs: int) -> dict:
        """Linear probing before fine-tuning (LP-FT, Kumar et al., ICLR 2022): the neck, the loss and the
        regularizers train alone on cached frozen-trunk features, exactly as a frozen-neck run of
        `epochs` epochs would (the same epoch loop), with its own optimizer and cosine schedule.  The
        trunk then starts training under a settled neck and settled proxies, instead of under the
        large, random gradients of a fresh loss.  Returns the log entry (epoch 0: the end state, where
        the trunk starts).  Like a frozen-neck run it validates every epoch and keeps its best one, in
        `self.probe_best` (val, probe epoch, state): the run's first selection candidate (see _fit)."""
        cfg, t0 = self.cfg, time.time()
        opt = build_optimizer(cfg, self.model, self.loss, self.regs, 0)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
        step = Step(self.model, self.loss, self.regs, opt, cfg.grad_clip, self.device, cfg.precision)
        parts: dict = {}
        best: tuple[dict, int, dict] | None = None
        for k in range(epochs):  # a frozen-neck run's epochs, exactly (tests/training/test_probe.py)
            parts = self.run_epoch(source, step, k, desc="probe epoch")
            sched.step()
            val = val_metrics(self.model, source)
            if best is None or val["map@r"] > best[0]["map@r"]:  # the frozen-neck run's own selection rule
                best = (val, k + 1, self.state())
            if self.report:
                self.report(k + 1, best[0]["map@r"])
        if best is None:
            raise ValueError("a probe runs at least one epoch")
        self.probe_best = best
        if self.main:
            log.info("probe: %d epochs on frozen-trunk features, val MAP@R %.4f (best %.4f, probe epoch %d)",
                     epochs, val["map@r"], best[0]["map@r"], best[1])
        return {"epoch": 0, "probe_epochs": epochs, **{f"train_{k}": v for k, v in parts.items()},
                "val_map@r": val["map@r"], "val_recall@1": val["recall@1"], "val_r_precision": val["r_precision"],
                "candidate_probe_epoch": best[1], "candidate_val_map@r": best[0]["map@r"],
                "seconds": round(time.time() - t0, 3)}

    def state(self) -> dict:
        """A copy of what best.pt holds of the training state: the model's and the loss's tensors."""
        return {"model": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
                "loss": {k: v.detach().clone() for k, v in self.loss.state_dict().items()}}

    def save_probe_candidate(self, sel: Selection) -> None:
        """best.pt ← the probe's best epoch, then back to the probe's end state, where the trunk starts."""
        if self.probe_best is None:
            raise ValueError("no probe has run")
        val, _, state = self.probe_best
        now = self.state()
        self.model.load_state_dict(state["model"])
        self.loss.load_state_dict(state["loss"])
        self.checkpoints.save("best.pt", 0, sel.best, sel.best_epoch, sel.history, metrics={"val": val})
        self.model.load_state_dict(now["model"])
        self.loss.load_state_dict(now["loss"])

    # ------------------------------------------------------------ one epoch
    def train_epoch(self, epoch: int) -> dict:
        """One pass over the training classes; the mean of each loss part over its steps."""
        return self.run_epoch(self.source, self.step, epoch, self.dist, self.board)

    def run_epoch(self, source, step: Step, epoch: int, d=None, board=None, desc: str = "epoch") -> dict:
        """One epoch of `step` over `source`'s batches (the run's, or the probe's), under torchrun
        when `d` is given (this rank's block of classes of each batch one process would draw); the
        mean of each loss part over its steps."""
        rank, world = (d.rank, d.world) if d else (0, 1)
        streams = rank if world > 1 else None  # one rank draws exactly what one process does
        rng, gen, global_seed = epoch_generators(self.cfg.seed, epoch, self.device, streams)
        source.start_epoch(epoch, self.model)
        batches = epoch_batches(source.labels, self.cfg.batch_size, self.cfg.m_per_class, step.paired, rng,
                                rank, world)
        sums: dict[str, float] = {}
        n = 0
        with torch_seeded(global_seed):
            shown = tqdm(source.batches(batches, augment_generator(self.cfg.seed, epoch, streams)),
                         total=len(batches), desc=f"{desc} {epoch + 1}", leave=False,
                         disable=not (self.cfg.progress and self.main))
            for (x, y, bad), want in zip(shown, map(len, batches), strict=True):
                self.skipped += len(bad)
                skip = x is None or len(y) < 2 or (step.paired and bad)
                if d:  # the ranks gather equal shares: a step one rank cannot take, no rank takes
                    skip = ddp.any_rank(skip or len(y) != want, self.device)
                if skip:
                    continue  # (a paired batch that lost an image is no longer class-aligned)
                ids = torch.tensor([self.label_map[int(v)] for v in y])
                parts = step(source.encode, x, ids, gen)
                if board is not None:
                    board.step(parts, step.opt)
                n += 1
                for k, v in parts.items():
                    sums[k] = sums.get(k, 0.0) + v
        return {k: v / max(n, 1) for k, v in sums.items()}

    def end_epoch(self, epoch: int, parts: dict, sel: Selection, seconds: float) -> None:
        """After epoch `epoch` (0-based) trained: validate (rank 0, every rank gets the result, so all
        take the same "best" decision), select, log, and save best.pt and latest.pt."""
        cfg = self.cfg
        val = ddp.broadcast(val_metrics(self.model, self.source) if self.main else None)
        if has_proxies(cfg.loss):  # every proxy-loss run, regularized or not, logs the epoch's end value
            parts["max_proxy_cos"] = float(max_proxy_cosine(self.loss.class_proxies()))
        improved = sel.record(epoch + 1, parts, val, seconds)
        self.board.epoch(epoch + 1, val)
        if self.main:
            log.info("epoch %d/%d loss %.4f val MAP@R %.4f R@1 %.4f", epoch + 1, cfg.epochs,
                     parts.get("loss", float("nan")), val["map@r"], val["recall@1"])
            if improved:
                self.checkpoints.save("best.pt", epoch + 1, sel.best, sel.best_epoch, sel.history,
                                      metrics={"val": val})
            self.checkpoints.save("latest.pt", epoch + 1, sel.best, sel.best_epoch, sel.history, with_opt=True)
            write_text(self.out / "log.jsonl", "".join(json.dumps(h) + "\n" for h in sel.history))

    # ------------------------------------------------------------ the run
    def fit(self) -> dict:
        cfg = self.cfg
        owns_group = not torch.distributed.is_initialized()
        self.dist = ddp.init_from_env(resolve_device(cfg.device))  # None in a plain process
        try:
            with deterministic_algorithms(cfg.deterministic):
                result = self._fit()
            if self.dist and owns_group:
                # every rank leaves together: none closes its connections while a peer still waits on it
                ddp.barrier()
            return result
        finally:
            if getattr(self, "board", None) is not None:
                self.board.close()
            if getattr(self, "source", None) is not None:
                self.source.close()  # loader workers, helper threads
            if self.dist and owns_group:
                ddp.leave(getattr(self, "step", None))

    def _fit(self) -> dict:
        self.main = self.dist is None or self.dist.rank == 0
        resuming = check_out(self.cfg)  # before anything is written (every rank sees the same folder)
        ddp.barrier()  # no rank writes before every rank has looked
        self.setup(resuming)
        sel, start = self.selection(resuming)
        self.board.global_step = start * self.steps_per_epoch
        probed = sel.history[0].get("probe_epochs", 0) if sel.history else 0  # steps the probe reported
        t0 = time.time()
        for epoch in range(start, self.cfg.epochs):
            te = time.time()
            parts = self.train_epoch(epoch)
            if self.sched is not None:
                self.sched.step()
            self.end_epoch(epoch, parts, sel, time.time() - te)
            if self.report:
                self.report(probed + epoch + 1, sel.best)
            if self.on_epoch_end:
                self.on_epoch_end(epoch + 1)
        # the probe is part of the run's cost
        return self.finish(sel, time.time() - t0 + (self.probe_entry["seconds"] if self.probe_entry else 0.0))

    def selection(self, resuming: bool) -> tuple[Selection, int]:
        """The model selection the epochs start from, and the first epoch to train: a resumed run's from
        latest.pt (every rank loads it; it holds the probe's entry), else the probe's candidate, if any."""
        sel = Selection()
        if resuming:
            start, sel.best, sel.best_epoch, sel.history = self.checkpoints.restore(
                read_checkpoint(self.out / "latest.pt"))
            state_like_parameters(self.step.opt)
            log.info("resumed %s at epoch %d (best val MAP@R %.4f)", self.out, start, sel.best)
            return sel, start
        if self.probe_entry:
            sel.history.append(self.probe_entry)
        if self.probe_entry and self.probe_best:
            # the probe's best epoch (the frozen-neck run's selected model) is the first candidate: a
            # trained trunk that never beats it on validation is not kept, so the run never selects a
            # model below the frozen neck of the same seed and epochs
            sel.best, sel.best_epoch = self.probe_best[0]["map@r"], 0
            if self.main:
                self.save_probe_candidate(sel)
        return sel, 0

    def finish(self, sel: Selection, train_seconds: float) -> dict:
        """Load the validation-selected checkpoint and evaluate it once on test (rank 0; every rank
        returns its metrics)."""
        if self.dist:  # each rank counted the images it skipped
            total = ddp.mean_over_ranks({"n": float(self.skipped)}, self.device)["n"] * self.dist.world
            self.skipped = int(round(total))
        metrics = self._finish(sel, train_seconds) if self.main else None
        return ddp.broadcast(metrics)

    def _finish(self, sel: Selection, train_seconds: float) -> dict:
        ck = read_checkpoint(self.out / "best.pt")
        self.model.load_state_dict(ck["state_dict"])
        self.loss.load_state_dict(ck["extra"]["loss_state"])
        metrics = {"selected_epoch": sel.best_epoch, "val": ck["metrics"]["val"],
                   "test": test_metrics(self.model, self.source), "train_seconds": round(train_seconds, 2),
                   "epochs": self.cfg.epochs, "n_skipped_images": int(self.skipped)}
        save_checkpoint(self.out / "best.pt", self.model, config=ck["config"], split=ck["split"],
                        metrics=metrics, extra=ck["extra"], data=ck["data"])
        write_json(self.out / "metrics.json", metrics)
        plot_curves(sel.history, self.out / "curve.png", sel.best_epoch)
        query, _ = self.splits.eval_pair("test")
        self.board.projector(self.model, self.source, query, self.splits.class_names)
        return metrics


def state_like_parameters(opt: torch.optim.Optimizer) -> None:
    """Optimizer state restored from a checkpoint in the memory layout of its parameters (a run
    resumed with another --channels-last): the fused optimizer walks them element by element."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p, {})
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.shape == p.shape and v.stride() != p.stride():
                    state[k] = torch.empty_like(p, dtype=v.dtype).copy_(v)


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


def train(cfg: TrainConfig, on_epoch_end=None, report=None) -> dict:
    return Run(cfg, on_epoch_end, report).fit()


def finished_run(cfg: TrainConfig) -> dict | None:
    """metrics.json of a completed run in cfg.out with the same identity, else None."""
    out = Path(cfg.out)
    try:
        recorded = recorded_config(out)
        metrics = json.loads((out / "metrics.json").read_text())
    except (OSError, ValueError, UserError):
        return None
    if recorded is None or not (out / "best.pt").is_file():
        return None
    return metrics if same_identity(recorded, cfg) else None


def train_or_reuse(cfg: TrainConfig, report=None) -> tuple[dict, bool]:
    """Reuse a finished run of the same config; otherwise train, resuming if possible (the
    caller owns cfg.out: a run there that cannot be resumed is replaced)."""
    m = finished_run(cfg)
    if m is not None:
        log.info("reusing trained run %s (same config)", cfg.out)
        return m, True
    latest = Path(cfg.out) / "latest.pt"
    resume = latest.is_file() and _resumable(cfg)
    return train(dataclasses.replace(cfg, resume=resume, overwrite=not resume), report=report), False


def _resumable(cfg: TrainConfig) -> bool:
    try:
        recorded = recorded_config(Path(cfg.out))
    except (OSError, ValueError, UserError):
        return False
    return recorded is not None and same_identity(recorded, cfg)
