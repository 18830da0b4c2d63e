"""Skewed-mean repulsion of class proxies (paper 003).

Proxies p_1…p_C (normalised), cosine similarities s_ij.
R1, log-sum-exp per centre (the "skewed mean" of its similarities):
    R1 = (1/C) Σ_i (1/γ) log( (1/(C−1)) Σ_{j≠i} exp(γ (s_ij − δ)) )
  Averaging rather than summing inside the log changes R1 only by the constant log(C−1)/γ,
  which leaves gradients unchanged and makes the limits clean: γ → +∞ gives the max, γ → −∞ the min, γ → 0 the mean.
R2, power mean of order −λ of the distances d_ij = ‖p_i − p_j‖ (positive, as
  power means need):  M_{−λ}(d) = (mean d_ij^{−λ})^{−1/λ}; λ = 1 is the
  UniformFace energy.  We penalise relu(δ₂ − M_{−λ}(d)), δ₂ = √2 by default
  (the distance of orthogonal unit vectors): push the softly-closest proxies
  apart until they are about orthogonal, then stop.
For many classes a random subset of proxies is used each step (the paper
notes this saves the C² work).
Diagnostic `max_proxy_cos`: the largest cosine between two different proxies,
over all of them (not the step's subset): the pair R1 pushes hardest, so a log
shows whether the term moves the proxies at all.  Per step here (TensorBoard);
the epoch log (train_max_proxy_cos) holds its value at the end of the epoch,
which the trainer logs for every proxy-loss run, with or without this term.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch.nn import functional as F

from core.params import param

from .base import BatchContext, Regularizer
from .registry import REGULARIZERS


@dataclass
class SkewedMeanParams:
    form: Literal["r1", "r2"] = param("r1", "r1: log-sum-exp of similarities | r2: power mean of distances")
    gamma: float = param(10.0, "R1 skew γ", bounds="(0, inf)")
    delta: float = param(0.0, "R1 margin δ3 on similarities")
    lam: float = param(1.0, "R2 order −λ")
    target: float = param(math.sqrt(2.0), "R2 target distance δ₂")
    max_proxies: int = param(512, "proxies sampled per step when there are more classes", bounds="[2, inf)")


DIAG_PROXIES = 4096  # per-step diagnostic over at most this many proxies (beyond: a fixed, evenly spaced subset)


@torch.no_grad()
def max_proxy_cosine(P: torch.Tensor, limit: int | None = None, chunk: int = 2048) -> torch.Tensor:
    """The largest cosine between two different rows of P (normalised here), exactly, in row chunks
    so C × C is never held at once.  `limit`: only that many evenly spaced rows when C is larger (the
    same rows every call).  NaN with fewer than two rows."""
    P = F.normalize(P.detach().float(), dim=1)
    if limit is not None and len(P) > limit:
        P = P[torch.linspace(0, len(P) - 1, limit, device=P.device).round().long()]
    C = len(P)
    if C < 2:
        return torch.tensor(float("nan"))
    best = []
    for i in range(0, C, chunk):
        S = P[i: i + chunk] @ P.t()
        rows = torch.arange(len(S), device=P.device)
        S[rows, rows + i] = float("-inf")  # a proxy with itself
        best.append(S.max())
    return torch.stack(best).max()


def lse_mean(a: torch.Tensor, gamma: float, dim: int = -1, mask: torch.Tensor | None = None) -> torch.Tensor:
    """(1/γ) log mean exp(γ a) over `dim` (entries where mask is False are left out)."""
    z = gamma * a
    if mask is not None:
        z = z.masked_fill(~mask, float("-inf"))
        n = mask.sum(dim).clamp(min=1)
    else:
        n = torch.full(a.shape[:dim] + a.shape[dim + 1:] if dim != -1 else a.shape[:-1], a.shape[dim],
                       device=a.device)
    return (torch.logsumexp(z, dim) - torch.log(n.to(a.dtype))) / gamma


def power_mean(d: torch.Tensor, p: float) -> torch.Tensor:
    """(mean d^p)^(1/p) of positive entries; p = 0 is the geometric mean."""
    if p == 0:
        return torch.exp(torch.log(d).mean())
    # log-space for stability at large |p|
    return torch.exp((torch.logsumexp(p * torch.log(d), 0) - math.log(d.numel())) / p)


@REGULARIZERS.register("skewed_mean", SkewedMeanParams, doc="skewed-mean repulsion of the class proxies",
                       weight=0.1)
class SkewedMeanRegularizer(Regularizer):
    name = "skewed_mean"
    needs_proxies = True

    def _proxies(self, P: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        if len(P) > self.params.max_proxies:
            idx = torch.randperm(len(P), generator=gen, device=P.device)[: self.params.max_proxies]
            P = P[idx]
        return P

    def value(self, P: torch.Tensor) -> torch.Tensor:
        P = F.normalize(P, dim=1)
        C = len(P)
        off = ~torch.eye(C, dtype=torch.bool, device=P.device)
        if self.params.form == "r1":
            S = P @ P.t()
            return lse_mean(S - self.params.delta, self.params.gamma, dim=1, mask=off).mean()
        iu = torch.triu_indices(C, C, 1, device=P.device)
        d = (P[iu[0]] - P[iu[1]]).norm(dim=1).clamp(min=1e-6)
        return F.relu(self.params.target - power_mean(d, -self.params.lam))

    def terms(self, ctx: BatchContext):
        proxies = ctx.class_proxies()
        v = self.value(self._proxies(proxies, ctx.generator))
        return {self.name: self.weight * v, f"skew_{self.params.form}": v,
                "max_proxy_cos": max_proxy_cosine(proxies, DIAG_PROXIES)}
