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

import torch
from torch import nn

from core.config import parse_typed_items
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
    return parse_typed_items(cls, items, f"regularizer {name!r}", prefix=name)
