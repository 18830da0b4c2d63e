"""Binomial deviance loss (Yi et al. 2014), as used by CGML (paper 002, eq. 7).

    L = Σ_{i≠j} w_ij · log(1 + exp(−(2s_ij − 1) · α · (D_ij − β) · η_ij))

D_ij is the cosine similarity, s_ij = 1 for a same-class pair, η_ij = 1 for
positives and η_ij = C (= 25) for negatives, α = 2, β = 0.5.  Eq. 7 writes a
plain sum; like Yi et al. we weight positives by 1/#positives and negatives by
1/#negatives (w_ij), so the loss does not scale with the batch size and the
many negatives do not drown the few positives.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from core.params import param

from .base import MetricLoss
from .registry import LOSSES


@dataclass
class BinomialParams:
    alpha: float = param(2.0, "scale α", bounds="(0, inf)", search="1..4")
    beta: float = param(0.5, "similarity offset β", search="0.3..0.7")
    neg_cost: float = param(25.0, "cost η (C) of a negative pair", bounds="[0, inf)", search="5..50 log")


class BinomialDevianceLoss(MetricLoss):
    def __init__(self, alpha=2.0, beta=0.5, neg_cost=25.0):
        super().__init__()
        self.alpha, self.beta, self.neg_cost = alpha, beta, neg_cost

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = F.normalize(embeddings, dim=1)
        D = x @ x.t()
        same = labels[:, None] == labels[None, :]
        off = ~torch.eye(len(labels), dtype=torch.bool, device=x.device)
        pos, neg = same & off, ~same
        sign = torch.where(same, 1.0, -1.0)
        eta = torch.where(same, 1.0, self.neg_cost)
        # softplus(z) = log(1 + e^z), computed stably
        cost = F.softplus(-sign * self.alpha * (D - self.beta) * eta)
        loss = D.new_zeros(())
        if pos.any():
            loss = loss + cost[pos].mean()
        if neg.any():
            loss = loss + cost[neg].mean()
        return loss


@LOSSES.register("binomial", BinomialParams, doc="binomial deviance (Yi et al. 2014), as used by CGML")
def binomial(C, d, p: BinomialParams):
    return BinomialDevianceLoss(p.alpha, p.beta, p.neg_cost)
