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

import torch
from torch.nn import functional as F

from model.flows import FlowSpec, build_flow, flow_forward

from .base import Regularizer


@dataclass
class NIRParams:
    blocks: int = 5
    hidden: int = 128
    variant: str = "nll"     # nll | exp
    input: str = "unit"      # unit: L2-normalised embeddings | raw: the neck output as is


class NIRRegularizer(Regularizer):
    name = "nir"
    needs_proxies = True
    lr_mult = 50.0  # the official code trains the flow at 50× the base learning rate

    def __init__(self, weight, params: NIRParams, loss_module, embed_dim, trunk_dim):
        super().__init__(weight, params, loss_module, embed_dim, trunk_dim)
        if params.variant not in ("nll", "exp"):
            raise ValueError("nir variant must be nll or exp")
        if params.input not in ("unit", "raw"):
            raise ValueError("nir input must be unit or raw")
        self.d = embed_dim
        self.flow = build_flow(FlowSpec("glow", embed_dim, params.blocks, (params.hidden, params.hidden),
                                        context=embed_dim))
        self.module = self.flow

    def residual(self, x: torch.Tensor, c: torch.Tensor):
        z, ladj, _ = flow_forward(self.flow, x, c)
        return z, ladj

    def nll(self, emb, y, loss_module) -> torch.Tensor:
        x = F.normalize(emb, dim=1) if self.params.input == "unit" else emb
        c = loss_module.class_proxies()[y]
        z, ladj = self.residual(x, c)
        return 0.5 * (z ** 2).sum(1) - ladj

    def term(self, ctx):
        nll = self.nll(ctx["emb"], ctx["y"], ctx["loss"])
        value = nll.mean() if self.params.variant == "nll" else torch.exp(nll / self.d).mean()
        ctx["parts"]["nir_nll"] = float(nll.mean().detach())
        return self.weight * value
