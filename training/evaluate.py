"""`training evaluate` on a model: embed a split (or In-Shop's query/gallery) and run the evaluator."""
from __future__ import annotations

import numpy as np
import torch

from data import DataConfig
from evaluation import evaluate
from model.features import cached_features, embed_subset
from model.preprocess import transform_for


def evaluate_model_on_split(fn, backbone, splits, split: str, cfg: DataConfig, *, ks,
                            normalize: bool = True, progress: bool = True, cache_dir: str | None = None,
                            device: torch.device | None = None) -> dict:
    """Embed `split` with `fn` (a backbone or a model, on `device`) and evaluate it.  With
    `cache_dir`, `fn` is the raw backbone and its features come from (and go into) the feature cache."""
    spec = transform_for(backbone, cfg)

    def run(subset, sp):
        return embed_subset(fn, subset, sp, cfg, f"embed {subset.name}", progress, device=device)

    def embed(subset):
        if cache_dir:
            f, y, kept = cached_features(backbone, splits, subset, spec, run, cache_dir, progress)
            return f, y, len(subset) - len(kept)
        e, y, _, skipped = run(subset, spec)
        return e, y, len(skipped)

    query, gallery = splits.eval_pair(split)
    q, ql, skipped = embed(query)
    if gallery is None:
        res = evaluate(q, ql, ks=ks, normalize=normalize)
    else:
        g, gl, gskip = embed(gallery)
        res = evaluate(q, ql, g, gl, ks=ks, normalize=normalize)
        skipped += gskip
    return res | {"n_skipped_images": skipped, "n_classes": len(np.unique(ql))}
