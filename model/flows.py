"""Normalizing-flow layers (zuko), built from a plain spec so checkpoints can rebuild them.

Kinds
  realnvp  affine coupling (RealNVP), alternating checkered masks
  nice     additive coupling (NICE): log|det J| = 0 by construction
  glow     affine coupling blocks with a fixed random permutation between blocks
           (GLOW-style, as in the NIR paper's official code); may take a context

`flow_forward` runs the layers one by one so that, besides y and
log|det ∂y/∂x|, it can also return the per-dimension "+1" term of paper 000
(eq. 7): for one coupling layer the Jacobian is triangular with diagonal
exp(s_t) on transformed dimensions and 1 on pass-through ones, so
Σ_t log(|∂y_t/∂x_t| + 1) = Σ_transformed log(exp(s_t) + 1) + n_passthrough·log 2.
A stack's Jacobian is a product of such triangular factors under different
masks, which is not triangular; we therefore apply the "+1" rule to each
layer's diagonal and sum over layers (exact for one layer, a per-layer
surrogate for the stack).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import zuko
from zuko.flows import GeneralCouplingTransform
from zuko.lazy import Flow, UnconditionalDistribution, UnconditionalTransform
from zuko.transforms import AdditiveTransform, CouplingTransform, PermutationTransform

KINDS = ("realnvp", "nice", "glow")


@dataclass
class FlowSpec:
    kind: str = "realnvp"
    features: int = 128
    transforms: int = 12
    hidden: tuple[int, ...] = (256, 256)
    context: int = 0
    seed: int = 0  # for glow's permutations
    # elementwise activation a FlowHead applies before the flow (paper 000's "activation layer for the
    # connection to the deep metric layers"); "none" for specs written before it was recorded
    activation: str = "none"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hidden"] = list(self.hidden)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "FlowSpec":
        d = dict(d)
        d["hidden"] = tuple(d.get("hidden", (256, 256)))
        return cls(**d)


def _checkered(features: int, i: int) -> torch.Tensor:
    return torch.arange(features) % 2 == i % 2


def build_flow(spec: FlowSpec) -> Flow:
    if spec.kind not in KINDS:
        raise ValueError(f"unknown flow kind {spec.kind!r}; choose from {KINDS}")
    d, c, h = spec.features, spec.context, tuple(spec.hidden)
    base = UnconditionalDistribution(zuko.distributions.DiagNormal, torch.zeros(d), torch.ones(d), buffer=True)
    layers = []
    g = torch.Generator().manual_seed(spec.seed)
    for i in range(spec.transforms):
        if spec.kind == "nice":
            layers.append(GeneralCouplingTransform(d, c, mask=_checkered(d, i), univariate=AdditiveTransform,
                                                   shapes=((),), hidden_features=h))
        else:
            layers.append(GeneralCouplingTransform(d, c, mask=_checkered(d, i), hidden_features=h))
        if spec.kind == "glow" and i < spec.transforms - 1:
            layers.append(UnconditionalTransform(PermutationTransform, torch.randperm(d, generator=g), buffer=True))
    flow = Flow(layers, base)
    # start close to the identity: zero the last layer of every coupling network
    for layer in layers:
        if isinstance(layer, GeneralCouplingTransform):
            last = [m for m in layer.hyper.modules() if isinstance(getattr(m, "weight", None), torch.Tensor)][-1]
            torch.nn.init.zeros_(last.weight)
            torch.nn.init.zeros_(last.bias)
    return flow


def _checkered_parity(lazy) -> int | None:
    """0 or 1 when a coupling module's mask is the checkered one (dims of that parity pass through)
    and the feature count is even, else None.  Cached on the module: its mask never changes."""
    if not hasattr(lazy, "_dml_parity"):
        mask = getattr(lazy, "mask", None)
        parity = None
        if mask is not None and mask.dim() == 1 and len(mask) % 2 == 0:
            for p in (0, 1):
                if torch.equal(mask.cpu(), torch.arange(len(mask)) % 2 == p):
                    parity = p
        lazy._dml_parity = parity
    return lazy._dml_parity


def flow_forward(flow: Flow, x: torch.Tensor, context: torch.Tensor | None = None, plus_one: bool = False):
    """(y, log|det ∂y/∂x| per sample, per-layer "+1" term per sample or None)."""
    transform = flow(context).transform if context is not None else flow().transform
    parts = transform.transforms if hasattr(transform, "transforms") else [transform]
    lazies = getattr(flow.transform, "transforms", [flow.transform])
    ladj = x.new_zeros(x.shape[:-1])
    plus = x.new_zeros(x.shape[:-1]) if plus_one else None
    y = x
    for t, lazy in zip(parts, lazies, strict=True):
        if isinstance(t, CouplingTransform):
            # a checkered split is two strided views and its merge one interleave: the same values as
            # zuko's gather and scatter, at a fraction of the ops (the determinant's two 12-layer flows)
            parity = _checkered_parity(lazy)
            if parity is None:
                y_a, y_b = t.split(y)
            else:
                y_a, y_b = y[..., parity::2], y[..., 1 - parity::2]
            inner = t.meta(y_a)
            z_b = inner(y_b)
            base = getattr(inner, "base", inner)
            elem = base.log_abs_det_jacobian(y_b, z_b)  # per transformed dimension
            ladj = ladj + elem.sum(-1)
            if plus_one:
                plus = plus + torch.nn.functional.softplus(elem).sum(-1) + y_a.shape[-1] * math.log(2.0)
            if parity is None:
                y = t.merge(y_a, z_b, y.shape)
            else:
                y = torch.stack((y_a, z_b) if parity == 0 else (z_b, y_a), dim=-1).flatten(-2)
        else:
            y, l = t.call_and_ladj(y)
            ladj = ladj + l
            if plus_one:
                plus = plus + y.shape[-1] * math.log(2.0)  # a permutation: |diag| contributes 0 or 1; use 1
    return y, ladj, plus

