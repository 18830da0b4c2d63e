"""Graph consistency, CGML (paper 002).

Each step takes two class-aligned batches X′ and X″: the same C classes in the
same order, n instances per class in each, drawn independently (the trainer's
paired sampler).  Within each batch an RBF graph S_ij = exp(−‖x_i − x_j‖²/σ)
over the L2-normalised embeddings, and
    L_GC = ‖S′X′ − S″X″‖_F,
total = L_m(X′) + L_m(X″) + λ·L_GC (the trainer adds the two metric losses).

Batch size: X′ and X″ *together* hold --batch-size images (each has
batch_size/2, i.e. batch_size/(2m) classes × m), so a CGML step embeds as many
images as a plain step.  The paper uses two full batches; pass a doubled
--batch-size for that (and twice the per-step cost).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from ..params import param
from .base import BatchContext, Regularizer
from .registry import REGULARIZERS


@dataclass
class CGMLParams:
    sigma: float = param(1.0, "RBF graph bandwidth σ")


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

    def terms(self, ctx: BatchContext):
        a, b = ctx.halves
        gc = graph_consistency(F.normalize(a, dim=1), F.normalize(b, dim=1), self.params.sigma)
        return {self.name: self.weight * gc, "L_GC": gc}
