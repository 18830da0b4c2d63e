"""Determinant regularization with dueling flow metric layers (paper 000).

backbone → W (the neck) → activation a → two normalizing flows g_min and g_max on u = a(Wφ) → L2
normalisation; g_min is the model's metric layer, g_max exists only during training.  The term is
λ1·R_{g_min}(Z) − λ2·R_{g_max}(Z) (eq. 11), Z the batch's flow inputs and their augmented samples
(`augment=feature`: u + ε(u_j − u) toward the nearest same-class sample, ε = 0.4), R the paper's
"+1" form (eq. 7, per coupling layer: model/flows.py) or `variant=logdet`.  `gmax_loss` (none,
the paper's; detached; attached) and `augment=tangent` are variants.  docs/fidelity.md maps each
part to the paper and says where ours differs; docs/regularizers.md has the measurements.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal, cast

import torch
from torch.nn import functional as F

from core.params import param
from model.flows import FlowSpec
from model.network import FlowHead

from .base import BatchContext, Regularizer
from .registry import REGULARIZERS


@dataclass
class DeterminantParams:
    flow: Literal["realnvp", "nice"] = param("realnvp", "flow kind: realnvp (the paper's) | nice")
    transforms: int = param(12, "coupling layers (the paper uses 12)", bounds="[1, inf)")
    hidden: int = param(128, "coupling-network width (kept small: 2 CPU cores)", bounds="[1, inf)")
    position: Literal["neck", "trunk"] = param("neck", "where the flows sit: neck (the paper's) | trunk")
    variant: Literal["plus_one", "logdet"] = param(
        "plus_one", "R: plus_one (the paper's eq. 7/10, (1/d) Σ log(|∂y_t/∂x_t| + 1) per coupling layer) "
        "| logdet ((1/d) log|det ∂g/∂x|)")
    augment: Literal["feature", "tangent"] = param(
        "feature", "feature (the paper's eq. 11): u_i + ε(u_j − u_i) toward the nearest same-class u_j in "
        "the flows' input space, in R only, never in the metric loss | tangent: unit embeddings moved on "
        "the sphere's tangent plane toward a random same-class sample, in the metric loss, R on real only")
    epsilon: float = param(0.4, "augmentation ε (the paper's best: 0.4); 0 = no augmentation", bounds="[0, inf)")
    activation: Literal["elu", "relu", "leaky_relu", "none"] = param(
        "elu", "activation before the flows (the paper's unnamed activation layer; elu: smooth and "
        "injective) | relu | leaky_relu | none (flows directly on W φ, or on the backbone output at trunk)")
    lambda_max: float = param(-1.0, "λ2; < 0 means the same as λ1 (the weight; the paper's λ1 = λ2)")
    gmax_loss: Literal["none", "detached", "attached"] = param(
        "none", "g_max's metric loss: none (the paper's eq. 11: one metric loss, on g_min's output; g_max trains "
        "by −λ2 R only) | detached (g_max's own copy of the loss and proxies on g_max(u.detach()): trains g_max, "
        "never the neck or trunk) | attached (that copy on g_max(u): a second metric loss that trains the neck "
        "and trunk too, even at weight 0)")


def nearest_same_class(u: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of each sample's nearest other same-class sample by Euclidean distance, itself where it
    has none; whether it has one).  A selection, so no gradient."""
    with torch.no_grad():
        n = len(u)
        same = (y[:, None] == y[None, :]) & ~torch.eye(n, dtype=torch.bool, device=u.device)
        dist = torch.cdist(u, u).masked_fill(~same, float("inf"))
        has = same.any(1)
        return torch.where(has, dist.argmin(1), torch.arange(n, device=u.device)), has


def feature_augment(u: torch.Tensor, y: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(u_i + ε (u_j − u_i) for every i, u_j its nearest same-class sample; the mask of the i that have
    one).  Rows outside the mask equal u_i and are to be left out: fixed shapes, no host sync."""
    j, has = nearest_same_class(u, y)
    return u + eps * (u[j] - u), has


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


@REGULARIZERS.register(
    "determinant", DeterminantParams, weight=0.05,
    doc="determinant regularization with dueling flow metric layers g_min / g_max (the paper's defaults: "
        "variant=plus_one, augment=feature with epsilon=0.4, activation=elu, gmax_loss=none; other variants: "
        "variant=logdet, augment=tangent, activation=relu|leaky_relu|none, gmax_loss=detached|attached)")
class DeterminantRegularizer(Regularizer):
    name = "determinant"
    lr_mult = 10.0  # flows at 1e-3 with the default base lr 1e-4 (paper: 1e-3 for flows and proxies)

    def __init__(self, weight, params: DeterminantParams, loss_module, embed_dim, trunk_dim):
        super().__init__(weight, params, loss_module, embed_dim, trunk_dim)
        d = embed_dim if params.position == "neck" else trunk_dim
        self.d = d
        plus_one = params.variant == "plus_one"
        hidden = (params.hidden, params.hidden)
        self.g_min = FlowHead(FlowSpec(params.flow, d, params.transforms, hidden, activation=params.activation),
                              plus_one)
        max_spec = FlowSpec(params.flow, d, params.transforms, hidden, seed=1, activation=params.activation)
        self.g_max = FlowHead(max_spec, plus_one)
        # g_max's own copy of the loss (its own proxies), in the detached and attached variants only
        self.max_loss = copy.deepcopy(loss_module) if params.gmax_loss != "none" else None
        parts = {"g_max": self.g_max} | ({"max_loss": self.max_loss} if self.max_loss is not None else {})
        self.module = torch.nn.ModuleDict(parts)
        self.lambda_max = params.lambda_max if params.lambda_max >= 0 else self.weight
        self.head = "embed_head" if params.position == "neck" else "trunk_head"

    def heads(self):
        # g_min is the model's metric layer (kept for retrieval, optimised with the model's heads)
        return {self.head: self.g_min}

    def loss_parameters(self):
        return [] if self.max_loss is None else list(self.max_loss.parameters())

    def _R(self, ladj: torch.Tensor, plus: torch.Tensor | None) -> torch.Tensor:
        """R per sample."""
        return (plus if self.g_min.plus_one else ladj) / self.d

    def _max_embedding(self, emb_max: torch.Tensor, u: torch.Tensor, ctx: BatchContext) -> torch.Tensor:
        """What g_max's own loss sees: g_max's output on the real samples (attached), or g_max re-run on
        u.detach() with the neck's W detached at the trunk position (detached: no gradient to neck or trunk)."""
        if self.params.gmax_loss == "detached":
            emb_max = self.g_max.flow_terms(u.detach())[0]
            if self.head == "trunk_head":
                W = cast(torch.Tensor, ctx.neck_layer.W)
                emb_max = F.linear(emb_max, W.detach())
            return emb_max
        return ctx.neck_layer(emb_max) if self.head == "trunk_head" else emb_max

    def terms(self, ctx: BatchContext):
        y, p = ctx.labels, self.params
        r_min_real = self._R(*ctx.head_terms[self.head])  # g_min on the real samples: the step's own pass
        u = self.g_min.flow_input(ctx.neck if self.head == "embed_head" else ctx.backbone)
        n = len(u)
        if p.augment == "feature" and p.epsilon > 0:
            aug, has = feature_augment(u, y, p.epsilon)
            r_min_aug = self._R(*self.g_min.flow_terms(aug)[1:])
            emb_max, *max_terms = self.g_max.flow_terms(torch.cat([u, aug]))  # one pass over real and augmented
            r_max_all = self._R(*max_terms)
            r_max_real, r_max_aug = r_max_all[:n], r_max_all[n:]
            emb_max = emb_max[:n]  # the metric loss sees the real samples only
            w = has.to(u.dtype)
            size = n + w.sum()
            r_min = (r_min_real.sum() + (w * r_min_aug).sum()) / size
            r_max = (r_max_real.sum() + (w * r_max_aug).sum()) / size
        else:
            emb_max, *max_terms = self.g_max.flow_terms(u)
            r_max_real = self._R(*max_terms)
            r_min, r_max = r_min_real.mean(), r_max_real.mean()
        total = self.weight * r_min - self.lambda_max * r_max
        if self.max_loss is not None:  # gmax_loss=detached|attached
            total = total + self.max_loss(self._max_embedding(emb_max, u, ctx), y)
        if p.augment == "tangent" and p.epsilon > 0:
            x = F.normalize(ctx.embeddings, dim=1)
            total = total + ctx.loss(tangent_augment(x, y, p.epsilon, ctx.generator), y)
        return {self.name: total, "R_min": r_min, "R_max": r_max,
                "R_min_real": r_min_real.mean(), "R_max_real": r_max_real.mean()}
