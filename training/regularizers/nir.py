"""Non-isotropy regularization, NIR (paper 001).

A conditional normalizing flow T maps an embedding x to a residual
z = T(x | c), where the condition c is the L2-normalised proxy of x's class
(for SoftTriple, the class's *first* centre; see losses/base.py).  T is
GLOW-style: affine coupling blocks with fixed random permutations between
them (5 blocks with MLP sub-networks, as the official code).
    L_NIR = mean_batch(½‖z‖² − log|det ∂z/∂x|)        (NLL under N(0, I) up to a constant)
variant "exp": mean_batch(exp(nll_i / d)) — the official code averages
exp(per-sample NLL); we divide the NLL by d inside the exponent, since exp of a
d = 128 NLL overflows float32.  The proxies are not detached: gradients reach
them through the condition.  Embeddings are L2-normalised first, as every
proxy loss here compares directions.  Unit embeddings lie on a sphere, where a
density can be made arbitrarily peaked (the NLL is unbounded below); with
`input=raw` the flow models the un-normalised neck output instead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch.nn import functional as F

from model.flows import FlowSpec, build_flow, flow_forward

from ..params import param
from .base import BatchContext, Regularizer
from .registry import REGULARIZERS


@dataclass
class NIRParams:
    blocks: int = param(5, "affine coupling blocks of the conditional flow")
    hidden: int = param(128, "coupling-network width")
    variant: Literal["nll", "exp"] = param("nll", "nll: mean NLL | exp: mean exp(NLL / d)")
    input: Literal["unit", "raw"] = param("unit", "unit: L2-normalised embeddings | raw: the neck output as is")


@REGULARIZERS.register("nir", NIRParams, doc="non-isotropy: NLL of embeddings under a proxy-conditioned flow (NIR)",
                       weight=0.1)
class NIRRegularizer(Regularizer):
    name = "nir"
    needs_proxies = True
    lr_mult = 50.0  # the official code trains the flow at 50× the base learning rate

    def __init__(self, weight, params: NIRParams, loss_module, embed_dim, trunk_dim):
        super().__init__(weight, params, loss_module, embed_dim, trunk_dim)
        self.d = embed_dim
        self.flow = build_flow(FlowSpec("glow", embed_dim, params.blocks, (params.hidden, params.hidden),
                                        context=embed_dim))
        self.module = self.flow

    def residual(self, x: torch.Tensor, c: torch.Tensor):
        z, ladj, _ = flow_forward(self.flow, x, c)
        return z, ladj

    def nll(self, emb, y, proxies: torch.Tensor) -> torch.Tensor:
        x = F.normalize(emb, dim=1) if self.params.input == "unit" else emb
        z, ladj = self.residual(x, proxies[y])
        return 0.5 * (z ** 2).sum(1) - ladj

    def terms(self, ctx: BatchContext):
        nll = self.nll(ctx.embeddings, ctx.labels, ctx.proxies)
        value = nll.mean() if self.params.variant == "nll" else torch.exp(nll / self.d).mean()
        return {self.name: self.weight * value, "nir_nll": nll.mean()}
