"""Batched feature extraction over a data set, with a progress bar."""
from __future__ import annotations

import logging
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

log = logging.getLogger(__name__)


@torch.inference_mode()
def extract(fn: Callable[[torch.Tensor], torch.Tensor], loader, desc: str = "embed",
            progress: bool = True):
    """Run `fn` over every batch.  Returns (features float32 N×d, labels, kept indices, skipped).

    `skipped` lists (index, message) of unreadable images; they are absent from
    the outputs, and the count is logged.
    """
    feats, labels, idx, skipped = [], [], [], []
    for images, y, i, bad in tqdm(loader, desc=desc, unit="batch", disable=not progress):
        skipped.extend(bad)
        for j, msg in bad:
            log.warning("skipped: %s", msg)
        if images is None:
            continue
        feats.append(fn(images).float().cpu().numpy())
        labels.append(y.numpy())
        idx.append(i.numpy())
    if skipped:
        log.warning("%d unreadable image(s) skipped in %s", len(skipped), desc)
    if not feats:
        return np.zeros((0, 0), np.float32), np.zeros(0, np.int64), np.zeros(0, np.int64), skipped
    return (np.concatenate(feats).astype(np.float32), np.concatenate(labels).astype(np.int64),
            np.concatenate(idx).astype(np.int64), skipped)
