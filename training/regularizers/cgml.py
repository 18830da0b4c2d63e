"""Graph consistency, CGML (paper 002).

Each step takes two class-aligned batches X′ and X″ (the same C classes in the same order, n
instances each, drawn independently: training/samplers.py).  Within each, an RBF graph
S_ij = exp(−‖x_i − x_j‖²/σ) over the L2-normalised embeddings, and L_GC = ‖S′X′ − S″X″‖_F;
total = L_m(X′) + L_m(X″) + λ·L_GC (the trainer adds the two metric losses).  `cgml.batches`:
"full" (default) makes each of X′ and X″ a whole --batch-size batch, "split" the two halves of
one; docs/fidelity.md gives the reading of the paper behind each.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch.nn import functional as F

from core.params import param

from .base import BatchContext, Regularizer
from .registry import REGULARIZERS


@dataclass
class CGMLParams:
    sigma: float = param(1.0, "RBF graph bandwidth σ", bounds="(0, inf)")
    batches: Literal["full", "split"] = param(
        "full", "full: X′ and X″ each a full --batch-size batch (the paper's minibatch of 130 read as each "
                "of them) | split: X′ and X″ share --batch-size, half each (the minibatch read as X′ ∪ X″)")


def rbf_graph(x: torch.Tensor, sigma: float) -> torch.Tensor:
    d2 = (x[:, None, :] - x[None, :, :]).pow(2).sum(-1)
    return torch.exp(-d2 / sigma)


def graph_consistency(x1: torch.Tensor, x2: torch.Tensor, sigma: float) -> torch.Tensor:
    return torch.linalg.matrix_norm(rbf_graph(x1, sigma) @ x1 - rbf_graph(x2, sigma) @ x2, ord="fro")


@REGULARIZERS.register("cgml", CGMLParams, doc="graph consistency between two class-aligned batches (CGML)",
                       weight=0.002)
class CGMLRegularizer(Regularizer):
    name = "cgml"
    paired = True

    def __init__(self, weight: float, params, loss_module, embed_dim: int, trunk_dim: int):
        super().__init__(weight, params, loss_module, embed_dim, trunk_dim)
        self.pair_batches = params.batches  # what the samplers draw: see the module docstring

    def terms(self, ctx: BatchContext):
        a, b = ctx.pair()
        gc = graph_consistency(F.normalize(a, dim=1), F.normalize(b, dim=1), self.params.sigma)
        # the weighted term is logged under "cgml" (next to the metric loss "loss"); L_GC unweighted
        return {self.name: self.weight * gc, "L_GC": gc}
