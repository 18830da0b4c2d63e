"""Normalizing-flow layers (zuko), built from a plain spec so checkpoints can rebuild them.

Kinds: `realnvp` (affine coupling, alternating checkered masks), `nice` (additive coupling,
log|det J| = 0), `glow` (the NIR official code's FrEIA GLOWCouplingBlock stack: a fixed random
permutation per block, numpy seed `seed + k`, then two affine couplings on the contiguous
halves; may take a context) and `glow_checkered` (one affine coupling per block on checkered
halves, near-identity start).  `clamp` > 0 soft-clamps every affine log-scale as FrEIA's "ATAN"
clamp does, s = clamp · 0.636 · atan(a); clamp = 0 keeps zuko's bound, s = a / (1 + |a| / ln 1000).
`flow_forward` also returns paper 000's per-layer "+1" term (docs/fidelity.md).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import partial

import numpy as np
import torch
import zuko
from torch.distributions import constraints
from zuko.flows import GeneralCouplingTransform
from zuko.lazy import Flow, UnconditionalDistribution, UnconditionalTransform
from zuko.transforms import (
    AdditiveTransform,
    CouplingTransform,
    PermutationTransform,
    Transform,
)

KINDS = ("realnvp", "nice", "glow", "glow_checkered")


@dataclass
class FlowSpec:
    kind: str = "realnvp"
    features: int = 128
    transforms: int = 12
    hidden: tuple[int, ...] = (256, 256)
    context: int = 0
    seed: int = 0  # for glow's permutations
    # soft clamp of affine log-scales (FrEIA's ATAN form; the NIR code uses 2); 0: zuko's own bound
    clamp: float = 0.0
    # elementwise activation a FlowHead applies before the flow (paper 000's "activation layer for the
    # connection to the deep metric layers"); "none" for specs written before it was recorded
    activation: str = "none"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["hidden"] = list(self.hidden)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> FlowSpec:
        d = dict(d)
        d["hidden"] = tuple(d.get("hidden", (256, 256)))
        return cls(**d)


def _checkered(features: int, i: int) -> torch.Tensor:
    return torch.arange(features) % 2 == i % 2


class SoftClampAffineTransform(Transform):
    """f(x) = exp(s)·x + t with s = clamp · 0.636 · atan(a): FrEIA's "ATAN" soft clamp (0.636 is
    FrEIA's literal for 2/π), which zuko's affine transform does not offer (it bounds s by
    a / (1 + |a| / ln 1000)); everything else about the coupling is zuko's."""

    domain = constraints.real
    codomain = constraints.real
    bijective = True
    sign = +1

    def __init__(self, shift: torch.Tensor, scale: torch.Tensor, clamp: float = 2.0, **kwargs):
        super().__init__(**kwargs)
        self.shift = shift
        self.log_scale = clamp * 0.636 * torch.atan(scale)

    def _call(self, x):
        return x * self.log_scale.exp() + self.shift

    def _inverse(self, y):
        return (y - self.shift) * torch.exp(-self.log_scale)

    def log_abs_det_jacobian(self, x, y):
        return self.log_scale.expand(x.shape)


def _halves(features: int) -> torch.Tensor:
    """True on the first half: FrEIA splits at round(0.5 · features)."""
    return torch.arange(features) < round(0.5 * features)


def build_flow(spec: FlowSpec) -> Flow:
    if spec.kind not in KINDS:
        raise ValueError(f"unknown flow kind {spec.kind!r}; choose from {KINDS}")
    d, c, h = spec.features, spec.context, tuple(spec.hidden)
    base = UnconditionalDistribution(zuko.distributions.DiagNormal, torch.zeros(d), torch.ones(d), buffer=True)
    affine = {"univariate": partial(SoftClampAffineTransform, clamp=spec.clamp)} if spec.clamp > 0 else {}
    layers = []
    g = torch.Generator().manual_seed(spec.seed)
    for i in range(spec.transforms):
        if spec.kind == "nice":
            layers.append(GeneralCouplingTransform(d, c, mask=_checkered(d, i), univariate=AdditiveTransform,
                                                   shapes=((),), hidden_features=h))
        elif spec.kind == "glow":
            # FrEIA's PermuteRandom(seed=k) draws np.random.seed(k); np.random.permutation(d)
            perm = torch.from_numpy(np.random.RandomState(spec.seed + i).permutation(d))
            layers.append(UnconditionalTransform(PermutationTransform, perm, buffer=True))
            first = _halves(d)  # a mask is True on the conditioning half
            layers.append(GeneralCouplingTransform(d, c, mask=~first, hidden_features=h, **affine))
            layers.append(GeneralCouplingTransform(d, c, mask=first, hidden_features=h, **affine))
        else:
            layers.append(GeneralCouplingTransform(d, c, mask=_checkered(d, i), hidden_features=h, **affine))
        if spec.kind == "glow_checkered" and i < spec.transforms - 1:
            layers.append(UnconditionalTransform(PermutationTransform, torch.randperm(d, generator=g), buffer=True))
    flow = Flow(layers, base)
    if spec.kind == "glow":  # FrEIA's subnets keep PyTorch's default initialisation (the NIR code's fc_init='none'),
        return flow          # which zuko's Linear draws alike: weight and bias U(±1/√fan_in)
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
    """(y, log|det ∂y/∂x| per sample, per-layer "+1" term per sample or None).

    The "+1" term is paper 000's eq. 7, Σ_t log(|∂y_t/∂x_t| + 1), taken per coupling layer and
    summed over the layers: one layer's Jacobian is triangular with diagonal exp(s_t) on the
    transformed dimensions and 1 on the pass-through ones, so its term is
    Σ_transformed log(exp(s_t) + 1) + n_passthrough · log 2.  A stack's Jacobian is not
    triangular, so this is exact for one layer and a per-layer surrogate for the stack."""
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
            if plus is not None:
                plus = plus + torch.nn.functional.softplus(elem).sum(-1) + y_a.shape[-1] * math.log(2.0)
            if parity is None:
                y = t.merge(y_a, z_b, y.shape)
            else:
                y = torch.stack((y_a, z_b) if parity == 0 else (z_b, y_a), dim=-1).flatten(-2)
        else:
            y, ladj_t = t.call_and_ladj(y)
            ladj = ladj + ladj_t
            if plus is not None:
                plus = plus + y.shape[-1] * math.log(2.0)  # a permutation: |diag| contributes 0 or 1; use 1
    return y, ladj, plus

