"""Data-parallel training on the CPU: 1 process × 2 threads against 2 processes × 1 thread (gloo,
127.0.0.1), the same global batch, in optimizer steps per second.

Two workloads, both the trainer's own Step (training/step.py) with Proxy-Anchor:
  * finetune: small_cnn on random 3 × S × S images, the whole network trained (the step is
    dominated by the backbone, which DDP splits);
  * frozen:   cached-feature mode, the neck alone on random 1280-d features (the step is tiny,
    so the gathers and the all-reduce are what is left).
The 2-process run goes through the same DDP-wrapped step `torchrun -m training train` uses.
Times are medians over repeats of `--steps` steps after warm-up steps.

    python bench/ddp_bench.py [--steps 20] [--batch 64] [--size 64] [--out bench/results/ddp/results.md]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from common import ROOT, free_port

CLASSES, EMBED = 100, 128


def build(workload: str):
    from model.backbones import build_backbone
    from model.network import EmbeddingModel
    from training.config import TrainConfig
    from training.losses import build_loss
    from training.step import Step, build_optimizer

    torch.manual_seed(0)
    cfg = TrainConfig(embed_dim=EMBED, lr=1e-4)
    backbone = build_backbone("small_cnn", "none")
    n_train = len(backbone.stages()) if workload == "finetune" else 0
    trunk = backbone.dim if workload == "finetune" else 1280
    model = EmbeddingModel(backbone, EMBED)
    if workload == "frozen":  # the neck on 1280-d cached features (efficientnet_lite0's size)
        from model.network import EmbeddingNeck
        model.neck = EmbeddingNeck(trunk, EMBED)
    loss, _ = build_loss("proxy_anchor", CLASSES, EMBED)
    for p in backbone.parameters():
        p.requires_grad_(workload == "finetune")
    opt = build_optimizer(cfg, model, loss, [], n_train)
    encode = backbone if workload == "finetune" else (lambda x: x)
    model.train()
    return Step(model, loss, [], opt, cfg.grad_clip), encode, trunk


def batches(workload: str, batch: int, size: int, trunk: int, n: int, rank: int, world: int):
    g = torch.Generator().manual_seed(1)
    share = batch // world
    out = []
    for _ in range(n):
        y = torch.arange(batch // 4).repeat_interleave(4) % CLASSES  # m = 4 per class
        x = torch.randn(batch, 3, size, size, generator=g) if workload == "finetune" else \
            torch.randn(batch, trunk, generator=g)
        out.append((x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]))
    return out


def timed(workload, batch, size, steps, warmup, repeats, rank=0, world=1, dist=None) -> list[float]:
    step, encode, trunk = build(workload)
    if dist is not None:
        step.distribute(dist)
    data = batches(workload, batch, size, trunk, warmup + steps, rank, world)
    gen = torch.Generator().manual_seed(2)
    rates = []
    for _ in range(repeats):
        for x, y in data[:warmup]:
            step(encode, x, y, gen)
        if dist is not None:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        for x, y in data[warmup:]:
            step(encode, x, y, gen)
        rates.append(steps / (time.perf_counter() - t0))
    return rates


def _worker(rank, world, port, args, out):
    from training.distributed import Dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = {w: timed(w, args.batch, args.size, args.steps, args.warmup, args.repeats, rank, world,
                        Dist(rank, world, rank, torch.device("cpu"))) for w in args.workloads}
        if rank == 0:
            torch.save(res, out)
    finally:
        from training.distributed import leave

        leave(None)  # gloo's threads joined before the interpreter exits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64, help="global batch")
    ap.add_argument("--size", type=int, default=64, help="image side for the finetune workload")
    ap.add_argument("--workloads", default="finetune,frozen")
    ap.add_argument("--out", default=str(ROOT / "bench/results/ddp/results.md"))
    args = ap.parse_args()
    args.workloads = args.workloads.split(",")
    import tempfile

    import torch.multiprocessing as mp

    t0 = time.time()
    torch.set_num_threads(2)
    one = {w: timed(w, args.batch, args.size, args.steps, args.warmup, args.repeats) for w in args.workloads}
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.pt")
        mp.spawn(_worker, args=(2, port, args, out), nprocs=2, join=True)
        two = torch.load(out)
    load = os.getloadavg()
    rows = []
    for w in args.workloads:
        a, b = statistics.median(one[w]), statistics.median(two[w])
        rows.append(f"| {w} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
        print(f"{w}: 1 process × 2 threads {a:.2f} steps/s · 2 processes × 1 thread {b:.2f} steps/s "
              f"(ratio {b / a:.2f}); repeats {[round(v, 2) for v in one[w]]} / {[round(v, 2) for v in two[w]]}")
    cmd = "python bench/ddp_bench.py " + " ".join(sys.argv[1:])
    text = f"""# DDP training on the CPU: 1 process × 2 threads vs 2 processes × 1 thread

Command: `{cmd.strip()}` ({time.time() - t0:.0f} s).

The trainer's own step (`training/step.py`, Proxy-Anchor, AdamW, grad clip 10), global batch
{args.batch} (m = 4), median steps/s over {args.repeats} repeats of {args.steps} steps after {args.warmup}
warm-up steps; the 2-process run is the DDP-wrapped step `torchrun -m training train` uses (gloo,
127.0.0.1), each process with half the batch.  finetune: small_cnn trained whole on random
3 × {args.size} × {args.size} images; frozen: the neck alone on random 1280-d cached features.

| workload | 1 proc × 2 threads, steps/s | 2 procs × 1 thread, steps/s | ratio (2 procs / 1) |
|---|---|---|---|
{chr(10).join(rows)}

Machine: {os.cpu_count()} CPU cores, shared with other benchmark jobs (load average
{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the end), torch {torch.__version__}, {platform.python_version()}.
Ratios come from one run on a loaded machine; repeat before reading much into the second digit.
Not measured here, so a reading rather than a finding: on a machine this busy a process with two
intra-op threads waits at the end of every operator for whichever thread the other jobs preempted,
while two one-thread processes meet only at the gathers and the gradient all-reduce; an idle
machine may show a smaller gap.
"""
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
