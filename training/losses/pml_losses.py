"""The standard losses, all from pytorch-metric-learning (not rewritten here).

Defaults follow each loss's paper / the PML docs; ProxyAnchor uses the
Proxy-Anchor recipe α = 32, δ = 0.1.
"""
from __future__ import annotations

from dataclasses import dataclass

from pytorch_metric_learning import distances, losses, miners

from core.errors import UserError

from .base import PMLLoss, PMLProxyLoss
from .registry import register


@dataclass
class ProxyAnchorParams:
    alpha: float = 32.0
    margin: float = 0.1


@register("proxy_anchor", ProxyAnchorParams, uses_proxies=True)
def proxy_anchor(C, d, p: ProxyAnchorParams):
    return PMLProxyLoss(losses.ProxyAnchorLoss(C, d, margin=p.margin, alpha=p.alpha), "proxies", "Cxd")


@dataclass
class ProxyNCAParams:
    softmax_scale: float = 3.0  # NCA with temperature 1/3 on normalized embeddings trains; 1 barely does


@register("proxy_nca", ProxyNCAParams, uses_proxies=True)
def proxy_nca(C, d, p: ProxyNCAParams):
    return PMLProxyLoss(losses.ProxyNCALoss(C, d, softmax_scale=p.softmax_scale), "proxies", "Cxd")


@dataclass
class TripletParams:
    margin: float = 0.1
    miner: str = "semihard"  # semihard | batchhard


@register("triplet", TripletParams)
def triplet(C, d, p: TripletParams):
    if p.miner == "semihard":
        miner = miners.TripletMarginMiner(margin=p.margin, type_of_triplets="semihard")
    elif p.miner == "batchhard":
        miner = miners.BatchHardMiner()
    else:
        raise UserError(f"triplet miner must be semihard or batchhard, got {p.miner!r}")
    return PMLLoss(losses.TripletMarginLoss(margin=p.margin), miner)


@dataclass
class NPairParams:
    pass


@register("npair", NPairParams)
def npair(C, d, p: NPairParams):
    # N-pair on inner products (Sohn 2016); PML pairs the first two samples of each class
    return PMLLoss(losses.NPairsLoss(distance=distances.DotProductSimilarity()))


@dataclass
class MultiSimilarityParams:
    alpha: float = 2.0
    beta: float = 50.0
    base: float = 0.5
    epsilon: float = 0.1


@register("multi_similarity", MultiSimilarityParams)
def multi_similarity(C, d, p: MultiSimilarityParams):
    return PMLLoss(losses.MultiSimilarityLoss(alpha=p.alpha, beta=p.beta, base=p.base),
                   miners.MultiSimilarityMiner(epsilon=p.epsilon))


@dataclass
class ArcFaceParams:
    margin: float = 28.6  # degrees, PML default
    scale: float = 64.0


@register("arcface", ArcFaceParams, uses_proxies=True)
def arcface(C, d, p: ArcFaceParams):
    return PMLProxyLoss(losses.ArcFaceLoss(C, d, margin=p.margin, scale=p.scale), "W", "dxC")


@dataclass
class SoftTripleParams:
    centers_per_class: int = 10
    la: float = 20.0
    gamma: float = 0.1
    margin: float = 0.01


@register("soft_triple", SoftTripleParams, uses_proxies=True)
def soft_triple(C, d, p: SoftTripleParams):
    loss = losses.SoftTripleLoss(C, d, centers_per_class=p.centers_per_class, la=p.la,
                                 gamma=p.gamma, margin=p.margin)
    return PMLProxyLoss(loss, "fc", "dxC", per_class=p.centers_per_class)


@dataclass
class ContrastiveParams:
    pos_margin: float = 0.0
    neg_margin: float = 0.5


@register("contrastive", ContrastiveParams)
def contrastive(C, d, p: ContrastiveParams):
    return PMLLoss(losses.ContrastiveLoss(pos_margin=p.pos_margin, neg_margin=p.neg_margin))
