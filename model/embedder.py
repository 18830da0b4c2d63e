"""Backbone + linear embedding neck W, so the learned metric on trunk features is M = WᵀW.

  trunk feature φ(x) ∈ R^d  (d = backbone.dim)
  embedding      e(x) = W φ(x) ∈ R^k  (k = embed_dim, default 128)
  eᵢᵀeⱼ = φᵢᵀ (WᵀW) φⱼ = φᵢᵀ M φⱼ

The index (posterior refinement) works on φ and M, training on e.
"""
from __future__ import annotations

import torch
from torch import nn

from .backbones import Backbone


class EmbeddingNeck(nn.Module):
    """The linear map W (no bias: a bias would break e = Wφ ⇔ M = WᵀW)."""

    def __init__(self, in_dim: int, embed_dim: int = 128):
        super().__init__()
        self.linear = nn.Linear(in_dim, embed_dim, bias=False)
        nn.init.orthogonal_(self.linear.weight)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return self.linear(f)

    @property
    def W(self) -> torch.Tensor:
        return self.linear.weight


class EmbeddingModel(nn.Module):
    def __init__(self, backbone: Backbone, embed_dim: int = 128):
        super().__init__()
        self.backbone = backbone
        self.neck = EmbeddingNeck(backbone.dim, embed_dim)

    @property
    def trunk_dim(self) -> int:
        return self.backbone.dim

    @property
    def embed_dim(self) -> int:
        return self.neck.linear.out_features

    def trunk_features(self, images: torch.Tensor) -> torch.Tensor:
        return self.backbone(images)

    def embed_features(self, features: torch.Tensor) -> torch.Tensor:
        """Embeddings from (cached) trunk features."""
        return self.neck(features)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.embed_features(self.trunk_features(images))

    @property
    def W(self) -> torch.Tensor:
        """(embed_dim × trunk_dim)."""
        return self.neck.W.detach()

    @property
    def M(self) -> torch.Tensor:
        """The learned metric matrix on trunk features, WᵀW (trunk_dim × trunk_dim)."""
        W = self.W.double()
        return (W.t() @ W).float()
