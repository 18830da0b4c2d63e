"""What a regularizer is to the trainer.

A regularizer is built from its weight, its typed params, the base loss (read,
e.g. copied for the determinant's g_max) and the feature sizes.  Each step it
gets a `BatchContext` and returns its named terms: the entry under its own
name is the weighted term added to the training loss; any other entries are
unweighted diagnostics, logged only.  It never changes the model or the
trainer; what it owns, it declares:
  - `heads()`: flow heads the model is built with (the determinant's g_min);
  - `parameters()`: its own trainable parameters (lr × `lr_mult`; weight decay `weight_decay`,
    None: the run's);
  - `proxy_lr_scale`: the loss's proxies train at this × their usual rate while it is on;
  - `loss_parameters()`: parameters trained like the loss's proxies;
  - `module`: everything it owns, checkpointed for resume.
`paired = True` asks for two class-aligned batches per step (CGML);
`needs_proxies = True` needs a loss with class proxies (checked before a run).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class BatchContext:
    """One training step, as a regularizer sees it."""
    labels: torch.Tensor                    # class indices 0 … C-1
    embeddings: torch.Tensor                # the model's output (after an embedding flow head)
    neck: torch.Tensor                      # W φ (before an embedding flow head)
    trunk: torch.Tensor                     # φ (after a trunk flow head)
    backbone: torch.Tensor                  # the backbone's output (before a trunk flow head)
    loss: nn.Module                         # the base metric loss (augmentation terms go through it)
    neck_layer: nn.Module                   # W, for a flow placed before it
    generator: torch.Generator              # this step's randomness
    proxies: torch.Tensor | None = None     # the loss's class proxies (C × d, unit rows) if it has them
    halves: tuple[torch.Tensor, torch.Tensor] | None = None  # paired batch: embeddings of X′ and X″
    head_terms: dict = dataclasses.field(default_factory=dict)  # head name → (log|det|, "+1" term)

    def class_proxies(self) -> torch.Tensor:
        """The loss's proxies, for a regularizer that declares `needs_proxies` (checked when the run is
        configured, so a missing one is a programming error here)."""
        if self.proxies is None:
            raise RuntimeError("this regularizer needs a loss with class proxies")
        return self.proxies

    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The paired batch's two views, for a regularizer that declares `paired`."""
        if self.halves is None:
            raise RuntimeError("this regularizer needs a paired batch")
        return self.halves


class Regularizer:
    name: str = ""
    paired: bool = False
    needs_proxies: bool = False
    lr_mult: float = 10.0
    weight_decay: float | None = None
    proxy_lr_scale: float = 1.0
    # the base metric loss's factor in the total (NIR's official objective scales the proxy loss by
    # w_align instead of scaling its own term); the product over a run's regularizers is used
    base_loss_scale: float = 1.0

    def __init__(self, weight: float, params, loss_module: nn.Module, embed_dim: int, trunk_dim: int):
        self.weight = float(weight)
        self.params = params
        self.module: nn.Module = nn.Module()

    def heads(self) -> dict[str, nn.Module]:
        return {}

    def loss_parameters(self) -> list[nn.Parameter]:
        return []

    def parameters(self) -> list[nn.Parameter]:
        shared = {id(p) for p in self.loss_parameters()}
        return [p for p in self.module.parameters() if p.requires_grad and id(p) not in shared]

    def terms(self, ctx: BatchContext) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def export(self) -> dict:
        return {"weight": self.weight, "params": dataclasses.asdict(self.params)}
