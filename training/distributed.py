"""Data-parallel training under `torchrun`: the process group, the samplers, the global batch
for the losses, and the DDP-wrapped step.

Launch: `torchrun --nproc_per_node N -m training train …` (and torchrun's multi-node flags):
RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT come from the environment torchrun sets.  The
backend is NCCL on CUDA (each process on cuda:LOCAL_RANK) and gloo on the CPU.  Without those
variables (a plain `python -m training train`) nothing here is used and a run is unchanged.

Gradients.  The trainer wraps one small module (`StepModule`: the model, the loss module and
every regularizer's module) in `torch.nn.parallel.DistributedDataParallel`; its forward is the
whole step loss (encode, heads, neck, metric loss, regularizer terms), so DDP sees one forward
and averages every trained parameter's gradient across ranks after each backward: the model,
the proxies (SoftTriple centres, ArcFace weights) and the flows stay identical on every rank.
`find_unused_parameters=True` where a step can leave a trained parameter without gradient: a
mined loss can come out with no pairs on a rank (no gradient to the neck that step), and the
backbone's stages change `requires_grad` at the end of a warm-up.  DDP is built once with every
stage that will ever train marked trainable; a stage frozen for the warm-up is then simply
unused (DDP leaves the gradient of a parameter unused on every rank as None, so AdamW skips it
exactly as in one process).

The global batch.  Every rank embeds its own share of the global batch; the losses see all of
it (training/losses/base.py):
  * pair and tuple losses (and their miners) go through pytorch-metric-learning's
    `DistributedLossWrapper` / `DistributedMinerWrapper`: the miner mines the gathered batch,
    the loss is computed on it and multiplied by the world size W, because the gathered
    embeddings of the other ranks carry no gradient: DDP's average of W × ∂L/∂(own embeddings)
    over the W ranks is exactly the one-process gradient;
  * that ×W would also multiply a proxy's gradient (every rank computes the full ∂L/∂proxy),
    so losses with parameters gather through `global_batch` instead: the other ranks'
    embeddings in rank order, this rank's own with its *gradient* (not the loss) scaled by W;
  * losses that are a plain mean of per-sample terms (ArcFace, SoftTriple) need no gather:
    the mean of the W per-rank means of B/W samples is the mean over B, and so are the averaged
    gradients.
With all of these, W ranks × B/W follow one process × B (tests/training/test_ddp.py).
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from core.errors import UserError

if TYPE_CHECKING:
    from .step import Step

from .samplers import pair_classes


# ---------------------------------------------------------------- the process group
@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device


def env_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() and \
        torch.distributed.get_world_size() > 1


def world_size() -> int:
    return torch.distributed.get_world_size() if is_distributed() else 1


def rank() -> int:
    return torch.distributed.get_rank() if is_distributed() else 0


def init_from_env(device: torch.device, timeout_s: float = 1800.0) -> Dist | None:
    """Join torchrun's process group when WORLD_SIZE > 1 (else None: one process).  A CUDA run
    uses cuda:LOCAL_RANK and NCCL; a CPU run gloo.  Reuses a group that is already up."""
    if env_world() <= 1 and not torch.distributed.is_initialized():
        return None
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise UserError(f"LOCAL_RANK {local}: this machine has {torch.cuda.device_count()} CUDA device(s); "
                            "use at most that many processes per node")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                             timeout=datetime.timedelta(seconds=timeout_s))
    return Dist(torch.distributed.get_rank(), torch.distributed.get_world_size(), local, device)


def barrier() -> None:
    if is_distributed():
        torch.distributed.barrier()


def leave(step: Step | None) -> None:
    """Tear this process's group down for good, while the interpreter is alive.  A gloo worker
    thread frees each finished collective's tensors after the waiting rank has moved on; one that
    does so while Python is finalizing cannot take the GIL and aborts the process ("terminate
    called without an active exception").  destroy_process_group alone leaves the group alive
    while the step's DDP wrapper holds it, so that is dropped first; the group's destructor then
    joins its worker threads here (tests/training/test_ddp_trainer.py)."""
    if step is not None:
        step.ddp = None
    gc.collect()  # the DDP module's reference cycles (hooks) hold the group too
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    gc.collect()


@contextlib.contextmanager
def rank_zero_first():
    """Rank 0 runs the block first (rendering a data set, building a feature cache) while the
    others wait at a barrier; then the others run it, reading what rank 0 wrote.  No two
    processes write the same file.  (Multi-node: the data root and cache must be on a shared
    file system.)"""
    if is_distributed() and rank() != 0:
        torch.distributed.barrier()
    yield
    if is_distributed() and rank() == 0:
        torch.distributed.barrier()


def broadcast(obj, src: int = 0):
    """`obj` from rank `src` on every rank (a no-op in one process)."""
    if not is_distributed():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def _device_for_collectives(like: torch.device) -> torch.device:
    return like if torch.distributed.get_backend() != "nccl" else torch.device("cuda", torch.cuda.current_device())


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank when `flag` is true on any (one process: `flag`)."""
    if not is_distributed():
        return flag
    t = torch.tensor([float(flag)], device=_device_for_collectives(device))
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item() > 0)


def mean_over_ranks(parts: dict, device: torch.device) -> dict:
    """The mean of each logged float over the ranks (every rank has the same keys)."""
    if not is_distributed() or not parts:
        return parts
    keys = sorted(parts)
    t = torch.tensor([parts[k] for k in keys], dtype=torch.float64, device=_device_for_collectives(device))
    torch.distributed.all_reduce(t)
    t /= world_size()
    return dict(zip(keys, t.tolist(), strict=True))


# ---------------------------------------------------------------- the global batch
class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x unchanged; the gradient flowing back through it multiplied by `scale`."""
    return _ScaleGrad.apply(x, scale)


def _all_gather(x: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(world_size())]
    torch.distributed.all_gather(parts, x.detach().contiguous())
    return parts


def global_batch(x: torch.Tensor, labels: torch.Tensor | None = None, grad_scale: float | None = None):
    """Every rank's `x` (and labels) concatenated in rank order, which is the order of the one-process
    batch; only this rank's rows carry a gradient, multiplied by `grad_scale` (default W: then the
    gradient DDP averages over the ranks is the one-process gradient of a loss on the whole batch).
    Every rank must pass the same number of rows.  One process: (x, labels) unchanged."""
    if not is_distributed():
        return x, labels
    W, r = world_size(), rank()
    xs = _all_gather(x)
    xs[r] = scale_grad(x, W if grad_scale is None else grad_scale)
    if labels is None:
        return torch.cat(xs), None
    ys = _all_gather(labels.to(x.device))
    ys[r] = labels.to(x.device)
    return torch.cat(xs), torch.cat(ys)


def report_as(value: torch.Tensor, shown: torch.Tensor) -> torch.Tensor:
    """A tensor whose value is `shown` and whose gradient is `value`'s."""
    return shown.detach() + (value - value.detach())


# ---------------------------------------------------------------- the samplers
class DistributedMPerClassSampler:
    """Yields this rank's index lists, one per step; `set_epoch` before each epoch.

    PML's MPerClassSampler has no distributed form (its issues #546 and #336 ask for one).  Each
    step draws one *global* class-balanced batch, B/m classes × m images, from a generator seeded by
    (seed, epoch): every rank draws the same global batch and keeps its own disjoint block of
    classes, so the ranks together see exactly the batch one process would, and a resumed epoch
    redraws the same batches.  `paired` ("full", or True; "split") draws CGML's pair instead: the
    same classes (B/m of them when "full", B/(2m) when "split"; training/samplers.py's pair_classes),
    X′ and X″ with m instances of each (drawn independently), and rank r keeps its block of classes
    *in both halves*, so its share [X′_r, X″_r] is itself class-aligned and the ranks' X′_r (and
    X″_r) in rank order are the global X′ (and X″)."""

    def __init__(self, labels, m: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, steps: int | None = None, paired: bool | str | None = False):
        labels = np.asarray(labels)
        if batch_size % (m * world_size):
            raise UserError(f"batch size {batch_size} must be a multiple of m × ranks = {m} × {world_size}")
        self.classes, inverse = np.unique(labels, return_inverse=True)
        self.members = [np.nonzero(inverse == c)[0] for c in range(len(self.classes))]
        self.paired = bool(paired)
        # classes in one global batch (a CGML pair: in each half, as training/samplers.py draws it)
        self.per_batch = pair_classes(batch_size, m, paired) if paired else batch_size // m
        if self.per_batch > len(self.classes):
            raise UserError(f"a batch of {batch_size} with m = {m} needs {self.per_batch} classes; "
                            f"there are {len(self.classes)}")
        if self.per_batch % world_size:
            raise UserError(f"a batch of {self.per_batch} classes does not split over {world_size} ranks")
        self.m, self.rank, self.world, self.seed = m, rank, world_size, seed
        self.steps = steps or max(1, len(labels) // batch_size)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps

    def _draw(self, rng, chosen) -> np.ndarray:
        return np.stack([rng.choice(self.members[c], size=self.m, replace=len(self.members[c]) < self.m)
                         for c in chosen])

    def global_batches(self):
        """The global batches of this epoch (the same on every rank): arrays of classes × m indices
        (paired: 2 × classes × m, X′ then X″)."""
        rng = np.random.default_rng([self.seed, self.epoch])
        for _ in range(self.steps):
            chosen = rng.choice(len(self.classes), size=self.per_batch, replace=False)
            if self.paired:
                yield np.stack([self._draw(rng, chosen), self._draw(rng, chosen)])
            else:
                yield self._draw(rng, chosen)

    def __iter__(self):
        share = self.per_batch // self.world
        mine = slice(self.rank * share, (self.rank + 1) * share)
        for batch in self.global_batches():
            part = batch[:, mine] if self.paired else batch[mine]
            yield part.reshape(-1).tolist()


def rank_batches(labels, batch_size: int, m: int, paired: bool | str | None, seed: int, epoch: int, dist: Dist
                 ) -> list[np.ndarray]:
    """This rank's index batches for one epoch: as many steps as one process takes
    (⌈n / batch_size⌉), each this rank's share of the global batch."""
    steps = max(1, math.ceil(len(labels) / batch_size))
    s = DistributedMPerClassSampler(labels, m, batch_size, dist.rank, dist.world, seed, steps, paired)
    s.set_epoch(epoch)
    return [np.asarray(b, dtype=np.int64) for b in s]


# ---------------------------------------------------------------- the wrapped step
class StepModule(nn.Module):
    """What DDP wraps: every module a step trains (the model, the loss module, each regularizer's
    module), with the step's whole loss as its forward."""

    step: Step  # set past nn.Module's registration (see __init__)

    def __init__(self, step: Step):
        super().__init__()
        self.model, self.loss = step.model, step.loss
        self.regs = nn.ModuleList([r.module for r in step.regs])
        object.__setattr__(self, "step", step)  # not a submodule: no second registration

    def forward(self, encode, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator):
        return self.step.loss_of_batch(encode, x, y, generator)


def wrap_step(step, dist: Dist, find_unused: bool | None = None) -> nn.parallel.DistributedDataParallel:
    """DDP over the step's modules.  Build it when every parameter that will ever train has
    `requires_grad` set (the trainer calls the source's start_epoch for the first trained epoch
    first): DDP registers exactly those.  `find_unused` (DDP's find_unused_parameters): needed when
    a step can leave a trained parameter without a gradient: a warm-up with frozen stages, or a
    pair/tuple loss (no parameters of its own), whose miner can find nothing to learn from on a
    rank; None: the latter."""
    if find_unused is None:
        find_unused = not any(True for _ in step.loss.parameters())
    module = StepModule(step)
    ids = [dist.device.index] if dist.device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(module, device_ids=ids, find_unused_parameters=find_unused)
