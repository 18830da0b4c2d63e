"""What every metric loss provides to the trainer and to the regularizers."""
from __future__ import annotations

import torch
from torch import nn

from core.errors import UserError


class MetricLoss(nn.Module):
    """`forward(embeddings, labels) -> scalar`, labels in 0..C-1.

    Proxy losses expose `proxies` (the parameter the optimizer must see, with its
    own learning rate) and `class_proxies()` (one L2-normalised proxy per class,
    C × d, for proxy regularizers).  Pair losses have neither.  (Which losses have
    proxies is registered with the loss: `LOSSES` meta `proxies`.)
    """

    def proxy_parameters(self) -> list[nn.Parameter]:
        return []

    def class_proxies(self) -> torch.Tensor:
        raise UserError(f"loss {type(self).__name__} has no class proxies")


class PMLLoss(MetricLoss):
    """A pytorch-metric-learning loss, optionally with a miner."""

    def __init__(self, loss: nn.Module, miner: nn.Module | None = None):
        super().__init__()
        self.loss = loss
        self.miner = miner

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        tuples = self.miner(embeddings, labels) if self.miner is not None else None
        return self.loss(embeddings, labels, tuples)


class PMLProxyLoss(PMLLoss):
    """PML loss whose proxies live in `loss.<attr>`, laid out C × d or d × (C·K)."""

    def __init__(self, loss: nn.Module, attr: str, layout: str, per_class: int = 1):
        super().__init__(loss)
        self.attr, self.layout, self.per_class = attr, layout, per_class

    def proxy_parameters(self):
        return [getattr(self.loss, self.attr)]

    def class_proxies(self) -> torch.Tensor:
        p = getattr(self.loss, self.attr)
        if self.layout == "dxC":
            p = p.t()
        if self.per_class > 1:  # SoftTriple: C·K centres, class c owns rows c·K … c·K+K-1
            # first centre of each class (documented choice for NIR's condition)
            p = p.reshape(-1, self.per_class, p.shape[1])[:, 0]
        return nn.functional.normalize(p, dim=1)

