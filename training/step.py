"""One optimisation step: forward through the heads and neck, the metric loss (per half for a
paired batch), the regularizers' terms, backward, gradient clipping, optimizer step.

Under torchrun (`distribute`) the step's loss runs as the forward of a DDP-wrapped module
(training/distributed.py), so the gradients of the model, the loss and the regularizers are
averaged over the ranks in backward; the logged parts are averaged over the ranks too."""
from __future__ import annotations

import math

import torch

from core.errors import UserError

from .distributed import global_batch, mean_over_ranks, wrap_step
from .regularizers import BatchContext


def build_optimizer(cfg, model, loss, regs, n_train: int) -> torch.optim.Optimizer:
    """AdamW with one parameter group per role, each at its own learning rate.  The backbone's last
    `n_train` stages get one group each: the last at `lr × backbone_lr_mult`, each earlier one `lr_decay` times the
    next (layer-wise decay keeps the pretrained early stages close to where they were)."""
    # --neck-lr-mult 0: the neck is frozen at its initialisation (no group: weight decay would move it)
    groups = ([{"params": list(model.neck.parameters()), "lr": cfg.lr * cfg.neck_lr_mult, "name": "neck"}]
              if cfg.neck_lr_mult > 0 else [])
    stages = model.backbone.stages()
    for k, (name, m) in enumerate(reversed(stages[len(stages) - n_train:] if n_train else [])):
        groups.append({"params": list(m.parameters()), "lr": cfg.lr * cfg.backbone_lr_mult * cfg.lr_decay ** k,
                       "name": f"backbone:{name}"})
    # a regularizer's own copy of the loss (dueling g_max) is trained like the loss
    loss_params = list(loss.parameters()) + [p for r in regs for p in r.loss_parameters()]
    if loss_params:
        scale = math.prod(r.proxy_lr_scale for r in regs)  # e.g. NIR's official proxy rate
        groups.append({"params": loss_params, "lr": cfg.lr * cfg.proxy_lr_mult * scale, "name": "loss",
                       "weight_decay": 0.0})
    heads = [p for h in (model.trunk_head, model.embed_head) if h is not None for p in h.parameters()]
    if heads:  # flow metric layers: 1e-3 with the default base lr 1e-4 (paper 000)
        groups.append({"params": heads, "lr": cfg.lr * 10.0, "name": "heads"})
    for r in regs:
        ps = r.parameters()
        if ps:
            decay = {} if r.weight_decay is None else {"weight_decay": r.weight_decay}
            groups.append({"params": ps, "lr": cfg.lr * r.lr_mult, "name": f"reg:{r.name}", **decay})
    # a proxy loss whose proxies miss the optimizer silently never learns them
    in_opt = {id(p) for g in groups for p in g["params"]}
    missing = [n for n, p in loss.named_parameters() if id(p) not in in_opt]
    assert not missing, f"loss parameters not optimised: {missing}"
    # fused: one kernel over every parameter instead of ~10 small ops per tensor; a flow head's
    # ~150 small tensors otherwise cost more optimizer time than the backbone's step
    return torch.optim.AdamW(groups, weight_decay=cfg.weight_decay, fused=True)


def paired_batches(regs) -> str | None:
    """Two class-aligned batches per step, each "full" or "split", when a regularizer asks for them
    (regularizers/cgml.py); None: one batch."""
    return next((getattr(r, "pair_batches", "full") for r in regs if r.paired), None)


class Step:
    """`encode` (the batch source's: backbone outputs from the batch inputs) runs under autocast at
    `precision`; the neck, flow heads, losses and regularizers run in fp32 (log-determinants and loss
    reductions would overflow in fp16).  fp16 scales the loss (GradScaler).  Image-shaped inputs take
    `memory_format` (channels_last where the backbone runs faster in it).  The logged parts are read
    back once, after the optimizer step: an accelerator is never left waiting on the host mid-step."""

    def __init__(self, model, loss, regs, opt: torch.optim.Optimizer, grad_clip: float,
                 device: torch.device | None = None, precision: str = "fp32",
                 memory_format: torch.memory_format = torch.contiguous_format):
        self.model, self.loss, self.regs, self.opt, self.grad_clip = model, loss, regs, opt, grad_clip
        self.memory_format = memory_format
        self.paired = paired_batches(regs)
        self.wants_proxies = any(r.needs_proxies for r in regs)
        self.device, self.precision = device or torch.device("cpu"), precision
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=precision == "fp16")
        self.ddp: torch.nn.parallel.DistributedDataParallel | None = None  # the DDP-wrapped step under torchrun

    def distribute(self, dist, find_unused: bool | None = None) -> None:
        """Run the step data-parallel: DDP over its modules (call when every parameter that will ever
        train has requires_grad set; see distributed.wrap_step)."""
        self.ddp = wrap_step(self, dist, find_unused)

    def forward(self, backbone_feats: torch.Tensor, y: torch.Tensor,
                generator: torch.Generator) -> tuple[torch.Tensor, dict]:
        """The step's loss from backbone outputs, and its named parts (floats, for the log)."""
        loss, parts = self.terms(backbone_feats, y, generator)
        return loss, as_floats(parts)

    def terms(self, backbone_feats: torch.Tensor, y: torch.Tensor,
              generator: torch.Generator) -> tuple[torch.Tensor, dict]:
        """`forward` with its parts left as detached tensors (read back later, in one transfer)."""
        model = self.model
        head_terms = {}
        phi = backbone_feats
        if model.trunk_head is not None:
            phi, *head_terms["trunk_head"] = model.trunk_head.with_terms(backbone_feats)
        neck = emb = model.neck(phi)
        if model.embed_head is not None:
            emb, *head_terms["embed_head"] = model.embed_head.with_terms(neck)
        halves = None
        if self.paired:  # X′ then X″: the metric loss on each
            h = len(y) // 2
            halves = (emb[:h], emb[h:])
            loss = self.loss(emb[:h], y[:h]) + self.loss(emb[h:], y[h:])
            if self.ddp is not None:
                # this rank holds a class-aligned share [X′_r, X″_r] of one global pair (the sampler); the
                # graph-consistency term sees the global X′ and X″ (the ranks' shares in rank order, this
                # rank's rows with W × their gradient, as the losses do): the one-process term
                halves = (global_batch(halves[0])[0], global_batch(halves[1])[0])
        else:
            loss = self.loss(emb, y)
        parts = {"loss": loss.detach()}  # the metric loss as computed, before any scale
        scale = math.prod(r.base_loss_scale for r in self.regs)
        if scale != 1.0:
            loss = scale * loss
        ctx = BatchContext(labels=y, embeddings=emb, neck=neck, trunk=phi, backbone=backbone_feats,
                           loss=self.loss, neck_layer=model.neck, generator=generator,
                           proxies=self.loss.class_proxies() if self.wants_proxies else None,
                           halves=halves, head_terms=head_terms)
        for reg in self.regs:
            terms = reg.terms(ctx)
            parts |= {k: v.detach() for k, v in terms.items() if k != reg.name}
            parts[reg.name] = terms[reg.name].detach()
            loss = loss + terms[reg.name]
        return loss, parts

    def loss_of_batch(self, encode, x: torch.Tensor, y: torch.Tensor,
                      generator: torch.Generator) -> tuple[torch.Tensor, dict]:
        from model.device import autocast

        with autocast(self.device, self.precision):
            feats = encode(x)
        return self.terms(feats.float(), y, generator)

    def __call__(self, encode, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator) -> dict:
        x = x.to(self.device, non_blocking=True)
        if x.dim() == 4:
            x = x.contiguous(memory_format=self.memory_format)
        y = y.to(self.device, non_blocking=True)
        if self.ddp is not None:  # one DDP forward: backward averages every trained gradient over the ranks
            loss, parts = self.ddp(encode, x, y, generator)
        else:
            loss, parts = self.loss_of_batch(encode, x, y, generator)
        packed = Packed(parts)  # a copy of the values now: the optimizer step may move what a part views
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.grad_clip > 0:
            self.scaler.unscale_(self.opt)
            params = [p for g in self.opt.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.grad_clip, foreach=True)  # one norm op, not one per tensor
        self.scaler.step(self.opt)
        self.scaler.update()
        parts = as_floats(packed)
        if self.ddp is not None:
            parts = mean_over_ranks(parts, self.device)
        check_finite(parts)  # after the mean over ranks: every rank sees the same parts and stops together
        return parts


class Packed:
    """Named scalars (tensors or numbers) copied into one tensor, read back by `as_floats` in one
    transfer."""

    def __init__(self, parts: dict):
        self.keys = [k for k, v in parts.items() if isinstance(v, torch.Tensor)]
        self.numbers = {k: float(v) for k, v in parts.items() if not isinstance(v, torch.Tensor)}
        self.values = (torch.stack([parts[k].detach().to(torch.float64).reshape(()) for k in self.keys])
                       if self.keys else None)
        self.order = list(parts)

    def floats(self) -> dict:
        read = dict(zip(self.keys, self.values.tolist(), strict=True)) if self.values is not None else {}
        return {k: float(read[k]) if k in read else self.numbers[k] for k in self.order}


def as_floats(parts) -> dict:
    """Parts (a dict of tensors or numbers, or `Packed`) as floats."""
    return (parts if isinstance(parts, Packed) else Packed(parts)).floats()


class Diverged(UserError):
    """A training step's loss (or one of its parts) became NaN or infinite."""


def check_finite(parts: dict) -> None:
    """Stop a run whose loss has diverged, naming the parts that did, instead of training on
    NaN weights until an evaluation fails on NaN embeddings."""
    bad = {k: v for k, v in parts.items() if not math.isfinite(v)}
    if bad:
        raise Diverged("training diverged: " + ", ".join(f"{k} = {v}" for k, v in bad.items())
                       + " (lower --lr, or the weight of the regularizer named)")
