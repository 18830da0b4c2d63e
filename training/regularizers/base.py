"""What a regularizer is to the trainer.

A regularizer owns its parameters (`module`, optimised with lr × `lr_mult`) and
its weight(s), and returns an already-weighted extra loss from `term(ctx)`.
`ctx` holds the batch: labels `y`, embeddings `emb` (the model's output),
the neck output `neck`, the loss module, the model, and for paired samplers
the two halves.  `paired = True` asks the trainer for two class-aligned
batches per step (CGML).  `install(model)` may add a head to the model
(the determinant regularizer's flow metric layer).
"""
from __future__ import annotations

import dataclasses
import typing

import torch
from torch import nn

from core.errors import UserError


class Regularizer:
    name: str = ""
    paired: bool = False
    needs_proxies: bool = False
    lr_mult: float = 10.0

    def __init__(self, weight: float, params, loss_module, embed_dim: int, trunk_dim: int):
        self.weight = float(weight)
        self.params = params
        self.module: nn.Module = nn.Module()
        if self.needs_proxies and not getattr(loss_module, "uses_proxies", False):
            raise UserError(f"regularizer {self.name!r} acts on class proxies; loss "
                            f"{type(loss_module).__name__} has none (use a proxy loss: proxy_anchor, "
                            f"proxy_nca, soft_triple, arcface)")

    def install(self, model) -> None:
        pass

    def term(self, ctx: dict) -> torch.Tensor:
        raise NotImplementedError

    def export(self) -> dict:
        return {"weight": self.weight, "params": dataclasses.asdict(self.params)}


def parse_reg_params(cls, name: str, items) -> object:
    """`name.key=value` items addressed to this regularizer → its typed params dataclass."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kw = {}
    for item in items:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise UserError(f"--reg-param wants regularizer.key=value, got {item!r}")
        key, value = item.split("=", 1)
        reg, k = key.split(".", 1)
        if reg != name:
            continue
        k = k.replace("-", "_")
        if k not in fields:
            raise UserError(f"regularizer {name!r} has no parameter {k!r}; it has {sorted(fields)}")
        t = hints[k]
        try:
            kw[k] = (value.lower() in ("1", "true", "yes")) if t is bool else t(value)
        except ValueError:
            raise UserError(f"regularizer parameter {key}={value!r} is not a {t.__name__}") from None
    return cls(**kw)
