"""Regularizer registry.  A new regularizer: one module, one line in REGULARIZERS."""
from __future__ import annotations

from core.errors import UserError

from .base import Regularizer, parse_reg_params
from .cgml import CGMLParams, CGMLRegularizer
from .determinant import DeterminantParams, DeterminantRegularizer
from .nir import NIRParams, NIRRegularizer
from .skewed_mean import SkewedMeanParams, SkewedMeanRegularizer

REGULARIZERS = {
    "determinant": (DeterminantRegularizer, DeterminantParams, 0.05),
    "nir": (NIRRegularizer, NIRParams, 0.1),
    "cgml": (CGMLRegularizer, CGMLParams, 0.002),
    "skewed_mean": (SkewedMeanRegularizer, SkewedMeanParams, 0.1),
}


def build_regularizers(cfg, run) -> list[Regularizer]:
    names = list(cfg.regularizer)
    if len(set(names)) != len(names):
        raise UserError(f"regularizer listed twice: {names}")
    if cfg.reg_weight and len(cfg.reg_weight) != len(names):
        raise UserError(f"--reg-weight has {len(cfg.reg_weight)} values for {len(names)} regularizer(s)")
    regs = []
    for i, name in enumerate(names):
        if name not in REGULARIZERS:
            raise UserError(f"unknown regularizer {name!r}; choose from {sorted(REGULARIZERS)}")
        cls, pcls, default_w = REGULARIZERS[name]
        params = parse_reg_params(pcls, name, cfg.reg_param)
        weight = cfg.reg_weight[i] if cfg.reg_weight else default_w
        try:
            reg = cls(weight, params, run.loss, cfg.embed_dim, run.backbone.dim)
        except ValueError as e:
            raise UserError(str(e)) from None
        reg.install(run.model)
        regs.append(reg)
    known = set(names)
    for item in cfg.reg_param:
        if item.split(".", 1)[0] not in known:
            raise UserError(f"--reg-param {item!r} names a regularizer that is not in --regularizer")
    return regs


__all__ = ["REGULARIZERS", "Regularizer", "build_regularizers"]
