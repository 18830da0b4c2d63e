"""Determinant regularization with dueling flow metric layers (paper 000).

Two normalizing flows g_min and g_max on the same features, both trained
with the metric loss; their outputs are L2-normalised embeddings.  Per sample
    R(x) = (1/d) · log |det ∂g(x)/∂x|          (or, with variant=plus_one, the
            paper's (1/d) Σ_t log(|∂y_t/∂x_t| + 1), see model/flows.py)
and the loss gets  + λ1 · mean R_min − λ2 · mean R_max  (λ1 = λ2 = weight,
default 0.05).  g_min is the model's metric layer (kept for retrieval); g_max
exists only during training and is not saved into the retrieval model.
Tangent-plane augmentation (ε = 0.4): for each unit embedding x and a random
same-class y in the batch, v = (I − xxᵀ)(y − x), x̃ = normalize(x + ε·v) joins
the metric loss with x's label.  The g_max branch gets its own copy of the
loss (its own proxies), so only the retrieval branch shapes the kept proxies.
Where this text and the paper differ, this text is followed: the paper's
augmentation mixes features before the flow; here it acts on the unit
embeddings, on the sphere's tangent plane, as specified.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import torch
from torch.nn import functional as F

from model.flows import FlowSpec
from model.network import FlowHead

from ..params import param
from .base import BatchContext, Regularizer
from .registry import REGULARIZERS


@dataclass
class DeterminantParams:
    flow: Literal["realnvp", "nice"] = param("realnvp", "flow kind: realnvp | nice")
    transforms: int = param(12, "coupling layers (the paper uses 12)")
    hidden: int = param(128, "coupling-network width (kept small: 2 CPU cores)")
    position: Literal["neck", "trunk"] = param("neck", "where the flows sit: neck (the paper's) | trunk")
    variant: Literal["logdet", "plus_one"] = param("logdet", "R: logdet | plus_one (the paper's eq. 7)")
    epsilon: float = param(0.4, "tangent-plane augmentation ε; 0 = off")
    lambda_max: float = param(-1.0, "λ2; < 0 means the same as λ1 (the weight)")


def tangent_augment(x: torch.Tensor, y: torch.Tensor, eps: float, gen: torch.Generator | None = None):
    """x̃ = normalize(x + ε (I − xxᵀ)(p − x)), p a random other same-class sample (itself if alone)."""
    n = len(x)
    same = (y[:, None] == y[None, :]) & ~torch.eye(n, dtype=torch.bool, device=x.device)
    scores = torch.rand(n, n, generator=gen, device=x.device) * same
    has = same.any(1)
    partner = torch.where(has, scores.argmax(1), torch.arange(n, device=x.device))
    p = x[partner]
    d = p - x
    v = d - (d * x).sum(1, keepdim=True) * x
    return F.normalize(x + eps * v, dim=1)


@REGULARIZERS.register("determinant", DeterminantParams,
                       doc="determinant regularization with dueling flow metric layers g_min / g_max", weight=0.05)
class DeterminantRegularizer(Regularizer):
    name = "determinant"
    lr_mult = 10.0  # flows at 1e-3 with the default base lr 1e-4 (paper: 1e-3 for flows and proxies)

    def __init__(self, weight, params: DeterminantParams, loss_module, embed_dim, trunk_dim):
        super().__init__(weight, params, loss_module, embed_dim, trunk_dim)
        d = embed_dim if params.position == "neck" else trunk_dim
        self.d = d
        plus_one = params.variant == "plus_one"
        self.g_min = FlowHead(FlowSpec(params.flow, d, params.transforms, (params.hidden, params.hidden)), plus_one)
        max_spec = FlowSpec(params.flow, d, params.transforms, (params.hidden, params.hidden), seed=1)
        self.g_max = FlowHead(max_spec, plus_one)
        self.max_loss = copy.deepcopy(loss_module)  # g_max's own proxies
        self.module = torch.nn.ModuleDict({"g_max": self.g_max, "max_loss": self.max_loss})
        self.lambda_max = params.lambda_max if params.lambda_max >= 0 else self.weight
        self.head = "embed_head" if params.position == "neck" else "trunk_head"

    def heads(self):
        # g_min is the model's metric layer (kept for retrieval, optimised with the model's heads)
        return {self.head: self.g_min}

    def loss_parameters(self):
        return list(self.max_loss.parameters())

    def _R(self, ladj: torch.Tensor, plus: torch.Tensor | None) -> torch.Tensor:
        return (plus if self.g_min.plus_one else ladj) / self.d

    def terms(self, ctx: BatchContext):
        y = ctx.labels
        r_min = self._R(*ctx.head_terms[self.head]).mean()
        emb_max, *max_terms = self.g_max.with_terms(ctx.neck if self.head == "embed_head" else ctx.backbone)
        if self.head == "trunk_head":
            emb_max = ctx.neck_layer(emb_max)
        r_max = self._R(*max_terms).mean()
        total = self.weight * r_min - self.lambda_max * r_max + self.max_loss(emb_max, y)
        if self.params.epsilon > 0:
            x = F.normalize(ctx.embeddings, dim=1)
            total = total + ctx.loss(tangent_augment(x, y, self.params.epsilon, ctx.generator), y)
        return {self.name: total, "R_min": r_min, "R_max": r_max}
