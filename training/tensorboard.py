"""`--tensorboard`: a run's events in its folder's tb/ (view with `tensorboard --logdir RUN/tb`).

Per step: the base loss and each regularizer term, and every parameter group's
learning rate.  Per epoch: the validation metrics.  At the end: the selected
model's test embeddings with sprite thumbnails, for TensorBoard's projector.
The JSON-lines log and curve.png are written either way; this is an extra view.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

log = logging.getLogger("training")

PROJECTOR_POINTS = 2000   # a sprite of 2,000 32-px thumbnails stays well inside TensorBoard's 8,192-px limit
THUMB = 32


class RunBoard:
    def __init__(self, out: Path, enabled: bool):
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(out) / "tb"))
        self.global_step = 0

    def step(self, parts: dict, opt) -> None:
        self.global_step += 1
        if self.writer is None:
            return
        for k, v in parts.items():
            self.writer.add_scalar(f"train/{k}", v, self.global_step)
        for g in opt.param_groups:
            self.writer.add_scalar(f"lr/{g.get('name', 'group')}", g["lr"], self.global_step)

    def epoch(self, epoch: int, val: dict) -> None:
        if self.writer is None:
            return
        for k in ("map@r", "recall@1", "r_precision"):
            self.writer.add_scalar(f"val/{k}", val[k], epoch)
        self.writer.flush()

    def projector(self, model, source, subset, class_names: dict | None = None) -> None:
        """The test embeddings (a seeded sample of PROJECTOR_POINTS) with their thumbnails."""
        if self.writer is None:
            return
        import torch

        from core.images import load_rgb

        e, y = source.embed(model, subset)
        rows = np.arange(len(e))
        if len(rows) > PROJECTOR_POINTS:
            rows = np.sort(np.random.default_rng(0).choice(rows, PROJECTOR_POINTS, replace=False))
        meta = [str((class_names or {}).get(int(v), int(v))) for v in y[rows]]
        thumbs = None
        if len(e) == len(subset):  # every image was readable: rows line up with the subset's paths
            ims = [np.asarray(load_rgb(subset.abspath(i)).resize((THUMB, THUMB)), np.float32) / 255
                   for i in rows]
            thumbs = torch.from_numpy(np.stack(ims)).permute(0, 3, 1, 2)
        else:
            log.warning("tensorboard projector: %d unreadable test images, so no thumbnails", len(subset) - len(e))
        self.writer.add_embedding(torch.from_numpy(np.ascontiguousarray(e[rows])), metadata=meta,
                                  label_img=thumbs, tag="test_embeddings")
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
