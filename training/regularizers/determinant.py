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

import torch
from torch.nn import functional as F

from model.network import FlowHead
from model.flows import FlowSpec, flow_forward

from .base import Regularizer


@dataclass
class DeterminantParams:
    flow: str = "realnvp"        # realnvp | nice
    transforms: int = 12         # the paper uses 12 coupling layers
    hidden: int = 128          # coupling-network width (kept small: 2 CPU cores)
    position: str = "neck"       # neck (the paper's) | trunk
    variant: str = "logdet"      # logdet | plus_one
    epsilon: float = 0.4         # tangent-plane augmentation; 0 = off
    lambda_max: float = -1.0     # λ2; < 0 means "same as λ1 (the weight)"


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


class DeterminantRegularizer(Regularizer):
    name = "determinant"
    lr_mult = 10.0  # flows at 1e-3 with the default base lr 1e-4 (paper: 1e-3 for flows and proxies)

    def __init__(self, weight, params: DeterminantParams, loss_module, embed_dim, trunk_dim):
        super().__init__(weight, params, loss_module, embed_dim, trunk_dim)
        if params.flow not in ("realnvp", "nice"):
            raise ValueError("determinant flow must be realnvp or nice")
        if params.position not in ("neck", "trunk"):
            raise ValueError("determinant position must be neck or trunk")
        d = embed_dim if params.position == "neck" else trunk_dim
        self.d = d
        spec = FlowSpec(params.flow, d, params.transforms, (params.hidden, params.hidden))
        self.g_min = FlowHead(spec)
        self.g_min.plus_one = params.variant == "plus_one"
        max_spec = FlowSpec(params.flow, d, params.transforms, (params.hidden, params.hidden), seed=1)
        self.g_max = FlowHead(max_spec)
        self.g_max.plus_one = self.g_min.plus_one
        self.max_loss = copy.deepcopy(loss_module)  # g_max's own proxies
        self.module = torch.nn.ModuleDict({"g_max": self.g_max, "max_loss": self.max_loss})
        self.lambda_max = params.lambda_max if params.lambda_max >= 0 else self.weight

    def install(self, model) -> None:
        # g_min becomes the model's metric layer (and is optimised with the model's parameters)
        if self.params.position == "neck":
            model.embed_head = self.g_min
        else:
            model.trunk_head = self.g_min

    def _R(self, head: FlowHead) -> torch.Tensor:
        v = head.last_plus if self.g_min.plus_one else head.last_ladj
        return v / self.d

    def term(self, ctx):
        y, emb, loss = ctx["y"], ctx["emb"], ctx["loss"]
        r_min = self._R(self.g_min).mean()
        flow_in = ctx["neck"] if self.params.position == "neck" else ctx["backbone"]
        emb_max = self.g_max(flow_in)
        if self.params.position == "trunk":
            emb_max = ctx["model"].neck(emb_max)
        r_max = self._R(self.g_max).mean()
        total = self.weight * r_min - self.lambda_max * r_max + self.max_loss(emb_max, y)
        if self.params.epsilon > 0:
            x = F.normalize(emb, dim=1)
            total = total + loss(tangent_augment(x, y, self.params.epsilon), y)
        ctx["parts"]["R_min"] = float(r_min.detach())
        ctx["parts"]["R_max"] = float(r_max.detach())
        return total
