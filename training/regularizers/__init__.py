"""Regularizer registry (filled by the regularizer issue); the trainer calls build_regularizers."""
from __future__ import annotations

from core.errors import UserError

REGULARIZERS: dict = {}


def build_regularizers(cfg, run) -> list:
    if cfg.regularizer:
        raise UserError(f"unknown regularizer(s) {list(cfg.regularizer)}; available: {sorted(REGULARIZERS)}")
    return []
