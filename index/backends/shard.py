"""Embedding a large gallery in parallel: shards of one split, merged into one index.

Two routes, one format:
  * `index build --shard i/N` on separate machines writes shard indexes whose ids are positions
    in the whole split; `index merge SHARD… --out IDX` joins them;
  * `torchrun --nproc_per_node N -m index build …` does both in one command: rank r embeds
    shard r/N into a temporary sibling of --out, rank 0 merges once every rank is done.

A merge refuses shards that do not belong together: another checkpoint, dimension,
normalisation, transform, data configuration or split, a missing or repeated shard.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np

from core.errors import UserError

from .store import Items, read_index, write_index

# manifest fields every shard of one index shares
SAME = ("checkpoint_sha256", "backbone", "trunk_dim", "embed_dim", "normalize", "transform", "data", "split",
        "dataset")


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise UserError(f"--shard wants i/N (e.g. 0/4), got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise UserError(f"--shard {text}: need N ≥ 1 and 0 ≤ i < N")
    return i, n


def merge_shards(shard_dirs, out, factory: str | None = None) -> Path:
    """One index from the shards of one split (any order); ids and rows as a single build's."""
    if not shard_dirs:
        raise UserError("give the shard index directories to merge")
    shards = [read_index(d) for d in shard_dirs]
    first = shards[0].manifest
    for d, s in zip(shard_dirs, shards, strict=True):
        m = s.manifest
        if "shard" not in m:
            raise UserError(f"{d} is not a shard (built without --shard)")
        diff = [k for k in SAME if m.get(k) != first.get(k)]
        if diff or not np.array_equal(s.W, shards[0].W):
            raise UserError(f"{d} does not belong with {shard_dirs[0]}: they differ in "
                            f"{', '.join(diff) or 'the neck W'}")
    count = first["shard"]["count"]
    got = sorted(s.manifest["shard"]["index"] for s in shards)
    if any(s.manifest["shard"]["count"] != count for s in shards) or got != list(range(count)):
        raise UserError(f"shards {got} of {count}: merge needs each shard 0 … {count - 1} exactly once")
    feats = np.concatenate([np.asarray(s.features) for s in shards])
    items = shards[0].items
    for s in shards[1:]:
        items = items.concat(s.items)
    order = np.argsort(items.ids, kind="stable")
    items = Items(items.ids[order], items.labels[order], [items.paths[i] for i in order],
                  [items.splits[i] for i in order])
    names: dict = {}
    for s in shards:
        names.update(s.class_names)
    info = {k: first[k] for k in ("checkpoint", "checkpoint_sha256", "backbone", "transform", "dataset", "split",
                                  "data") if k in first}
    # features are stored normalised when the index normalises: normalising again is a no-op
    return write_index(out, feats[order], items, shards[0].W, normalize=first["normalize"], info=info,
                       factory=factory, class_names=names, root=shards[0].root)


def distributed_rank() -> tuple[int, int]:
    """(rank, world size) under torchrun; (0, 1) in a plain process."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def distributed_build(build_shard, prepare, out, factory: str | None = None) -> Path | None:
    """Under torchrun: rank 0 prepares the data (renders kanji, say) while the others wait, every
    rank builds its shard, rank 0 merges them into `out` and removes the shards.  Returns the
    index path on rank 0, None on the others.  gloo carries only the barriers."""
    import torch.distributed as dist

    rank, world = distributed_rank()
    dist.init_process_group("gloo")
    tmp = Path(out).parent / f".{Path(out).name}.shards-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    try:
        if rank == 0:
            prepare()  # one writer for shared caches: no two processes write the same file
        dist.barrier()
        build_shard((rank, world), tmp / str(rank))
        dist.barrier()
        path = None
        if rank == 0:
            path = merge_shards([tmp / str(r) for r in range(world)], out, factory)
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        return path
    finally:
        dist.destroy_process_group()
