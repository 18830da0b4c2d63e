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
    proxies is registered with the loss: `proxies=True`, `LossSpec`.)

    Under torchrun (training/distributed.py) a call sees the *global* batch: `global_loss` gathers
    the other ranks' embeddings (in rank order, without gradient) and computes the loss on all of
    them, this rank's embeddings carrying W × their gradient, so that DDP's average over the ranks
    is the one-process gradient, for the embeddings and for any parameter (proxies) alike.  In one
    process a call is `forward`, as before.
    """

    def __call__(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from ..distributed import is_distributed

        if is_distributed():
            return self.global_loss(embeddings, labels)
        return super().__call__(embeddings, labels)

    def global_loss(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from ..distributed import global_batch

        return nn.Module.__call__(self, *global_batch(embeddings, labels))

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

    def global_loss(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A pair/tuple loss under torchrun: pytorch-metric-learning's own wrappers.  The miner mines
        the gathered batch (its indices point into it) and the loss is computed on it; the wrapper
        returns W × the loss, since only this rank's embeddings carry a gradient (DDP's average then
        gives the one-process gradient).  The value returned is the loss itself (÷ W, for the log);
        the gradient is the wrapper's.  (A pair loss has no parameters that the ×W would inflate.)"""
        from pytorch_metric_learning.utils.distributed import DistributedLossWrapper, DistributedMinerWrapper

        from ..distributed import report_as, world_size

        miner = DistributedMinerWrapper(self.miner) if self.miner is not None else None
        tuples = miner(embeddings, labels) if miner is not None else None
        scaled = DistributedLossWrapper(self.loss)(embeddings, labels, tuples)
        return report_as(scaled, scaled.detach() / world_size())


class PMLProxyLoss(PMLLoss):
    """PML loss whose proxies live in `loss.<attr>`, laid out C × d or d × (C·K)."""

    def __init__(self, loss: nn.Module, attr: str, layout: str, per_class: int = 1, per_sample_mean: bool = False):
        super().__init__(loss)
        self.attr, self.layout, self.per_class = attr, layout, per_class
        # the loss is the plain mean of per-sample terms against the proxies (ArcFace, SoftTriple): under
        # torchrun each rank's mean over its B/W samples, averaged, is the mean over B, gradients too, so no
        # gather.  Proxy-Anchor (log-sum-exp over the batch per proxy, ÷ proxies with positives) and ProxyNCA
        # (÷ samples with non-zero positive mass) are not: they gather, as MetricLoss does.
        self.per_sample_mean = per_sample_mean

    def global_loss(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.per_sample_mean:
            return nn.Module.__call__(self, embeddings, labels)
        return MetricLoss.global_loss(self, embeddings, labels)

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

