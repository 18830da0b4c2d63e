"""Data-parallel training under `torchrun`: the process group, the global batch for the losses,
and the DDP-wrapped step.

Launch: `torchrun --nproc_per_node N -m training train …`; RANK, WORLD_SIZE, LOCAL_RANK and
MASTER_ADDR/PORT come from the environment torchrun sets.  NCCL on CUDA (cuda:LOCAL_RANK), gloo
on the CPU.  Without those variables nothing here is used.  Each rank's batches are its block of
classes of the one-process batches (training/samplers.py).  `StepModule` puts the model, the loss
and every regularizer's module under one DDP whose forward is the step's loss, so every trained
parameter's gradient is averaged over the ranks; losses see the global batch through PML's
distributed wrappers or `global_batch`.  docs/scale-out.md gives the gradient arithmetic that
makes W ranks × B/W follow one process × B (tests/training/test_ddp.py).
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from core.errors import UserError

if TYPE_CHECKING:
    from .step import Step


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
