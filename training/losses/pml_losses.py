"""The standard losses, all from pytorch-metric-learning (not rewritten here).

Defaults follow each loss's paper / the PML docs; ProxyAnchor uses the
Proxy-Anchor recipe α = 32, δ = 0.1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pytorch_metric_learning import distances, losses, miners

from core.params import param

from .base import PMLLoss, PMLProxyLoss
from .registry import LOSSES


@dataclass
class ProxyAnchorParams:
    alpha: float = param(32.0, "scale α", bounds="(0, inf)", search="8..64 log")
    margin: float = param(0.1, "margin δ", search="0..0.3")


@LOSSES.register("proxy_anchor", ProxyAnchorParams, doc="Proxy-Anchor (Kim et al. 2020), one proxy per class",
                 proxies=True)
def proxy_anchor(C, d, p: ProxyAnchorParams):
    return PMLProxyLoss(losses.ProxyAnchorLoss(C, d, margin=p.margin, alpha=p.alpha), "proxies", "Cxd")


@dataclass
class ProxyNCAParams:
    # NCA with temperature 1/3 on normalized embeddings trains; 1 barely does
    softmax_scale: float = param(3.0, "inverse softmax temperature", bounds="(0, inf)", search="1..16 log")


@LOSSES.register("proxy_nca", ProxyNCAParams, doc="ProxyNCA (Movshovitz-Attias et al. 2017), one proxy per class",
                 proxies=True)
def proxy_nca(C, d, p: ProxyNCAParams):
    return PMLProxyLoss(losses.ProxyNCALoss(C, d, softmax_scale=p.softmax_scale), "proxies", "Cxd")


@dataclass
class TripletParams:
    margin: float = param(0.1, "triplet margin", bounds="[0, inf)", search="0.01..0.5 log")
    miner: Literal["semihard", "batchhard"] = param("semihard", "triplet miner: semihard | batchhard")


@LOSSES.register("triplet", TripletParams, doc="triplet margin loss with a semi-hard or batch-hard miner")
def triplet(C, d, p: TripletParams):
    if p.miner == "semihard":
        miner = miners.TripletMarginMiner(margin=p.margin, type_of_triplets="semihard")
    else:
        miner = miners.BatchHardMiner()
    return PMLLoss(losses.TripletMarginLoss(margin=p.margin), miner)


@dataclass
class NPairParams:
    pass


@LOSSES.register("npair", NPairParams, doc="N-pair loss (Sohn 2016) on inner products")
def npair(C, d, p: NPairParams):
    # PML pairs the first two samples of each class
    return PMLLoss(losses.NPairsLoss(distance=distances.DotProductSimilarity()))


@dataclass
class MultiSimilarityParams:
    alpha: float = param(2.0, "positive scale α", bounds="(0, inf)", search="1..4")
    beta: float = param(50.0, "negative scale β", bounds="(0, inf)", search="20..80")
    base: float = param(0.5, "similarity offset λ", search="0.3..0.7")
    epsilon: float = param(0.1, "miner margin ε", bounds="[0, inf)")


@LOSSES.register("multi_similarity", MultiSimilarityParams, doc="Multi-Similarity loss and miner (Wang et al. 2019)")
def multi_similarity(C, d, p: MultiSimilarityParams):
    return PMLLoss(losses.MultiSimilarityLoss(alpha=p.alpha, beta=p.beta, base=p.base),
                   miners.MultiSimilarityMiner(epsilon=p.epsilon))


@dataclass
class ArcFaceParams:
    margin: float = param(28.6, "angular margin in degrees (PML default)", bounds="[0, 180)", search="10..45")
    scale: float = param(64.0, "logit scale", bounds="(0, inf)", search="16..64 log")


@LOSSES.register("arcface", ArcFaceParams, doc="ArcFace (Deng et al. 2019), one class weight (proxy) per class",
                 proxies=True)
def arcface(C, d, p: ArcFaceParams):
    return PMLProxyLoss(losses.ArcFaceLoss(C, d, margin=p.margin, scale=p.scale), "W", "dxC",
                         per_sample_mean=True)


@dataclass
class SoftTripleParams:
    centers_per_class: int = param(10, "centres K per class", bounds="[1, inf)")
    la: float = param(20.0, "scale λ", bounds="(0, inf)", search="10..40 log")
    gamma: float = param(0.1, "softmax temperature γ over a class's centres", bounds="(0, inf)")
    margin: float = param(0.01, "margin δ")


@LOSSES.register("soft_triple", SoftTripleParams, doc="SoftTriple (Qian et al. 2019), K centres per class",
                 proxies=True)
def soft_triple(C, d, p: SoftTripleParams):
    loss = losses.SoftTripleLoss(C, d, centers_per_class=p.centers_per_class, la=p.la,
                                 gamma=p.gamma, margin=p.margin)
    return PMLProxyLoss(loss, "fc", "dxC", per_class=p.centers_per_class, per_sample_mean=True)


@dataclass
class ContrastiveParams:
    pos_margin: float = param(0.0, "distance below which positives cost nothing")
    neg_margin: float = param(0.5, "distance above which negatives cost nothing", search="0.2..1")


@LOSSES.register("contrastive", ContrastiveParams, doc="contrastive loss (Hadsell et al. 2006) on all pairs")
def contrastive(C, d, p: ContrastiveParams):
    return PMLLoss(losses.ContrastiveLoss(pos_margin=p.pos_margin, neg_margin=p.neg_margin))
