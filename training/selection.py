"""Evaluation and model selection: MAP@R on the validation classes picks the epoch; the
selected model is evaluated once, at the end, on the test classes."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from evaluation import evaluate
from evaluation.diagnostics import embedding_diagnostics


@torch.inference_mode()
def val_metrics(model, source) -> dict:
    model.eval()
    e, y = source.embed(model, source.splits.val)
    return evaluate(e, y, clustering=False) | {"n_classes": len(np.unique(y))}


@torch.inference_mode()
def test_metrics(model, source) -> dict:
    model.eval()
    query, gallery = source.splits.eval_pair("test")
    q, ql = source.embed(model, query)
    counts = {"n_classes": len(np.unique(ql))}
    if gallery is None:
        return evaluate(q, ql) | embedding_diagnostics(q, ql) | counts
    g, gl = source.embed(model, gallery)
    return evaluate(q, ql, g, gl) | embedding_diagnostics(g, gl) | counts


@dataclass
class Selection:
    best: float = -1.0          # best validation MAP@R so far
    best_epoch: int = -1
    history: list = field(default_factory=list)

    def record(self, epoch: int, parts: dict, val: dict, seconds: float) -> bool:
        """Log one epoch; True when its validation MAP@R is the best so far."""
        self.history.append({"epoch": epoch, **{f"train_{k}": v for k, v in parts.items()},
                             "val_map@r": val["map@r"], "val_recall@1": val["recall@1"],
                             "val_r_precision": val["r_precision"], "seconds": round(seconds, 3)})
        if val["map@r"] > self.best:
            self.best, self.best_epoch = val["map@r"], epoch
            return True
        return False
