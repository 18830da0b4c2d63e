"""Backbone + linear embedding neck W, so the learned metric on trunk features is M = WᵀW.

  trunk feature φ(x) ∈ R^d  (d = backbone.dim)
  embedding      e(x) = W φ(x) ∈ R^k  (k = embed_dim, default 128)
  eᵢᵀeⱼ = φᵢᵀ (WᵀW) φⱼ = φᵢᵀ M φⱼ

The index (posterior refinement) works on φ and M, training on e.

Optional flow "metric layers" (determinant regularizer, paper 000):
  trunk position: φ = normalize(g(backbone(x)))  — the flow is part of the trunk,
                  so M = WᵀW still describes the embeddings' inner products exactly;
  neck position:  e = normalize(g(W φ))          — the paper's placement; M = WᵀW
                  then describes the linear part *before* the flow only, and the
                  index's refinements act on that linear metric.
"""
from __future__ import annotations

import numpy as np
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


class FlowHead(nn.Module):
    """normalize(g(x)) for a normalizing flow g.  `with_terms` also returns g's per-sample
    log|det ∂g/∂x| and, when `plus_one`, paper 000's "+1" term, so a regularizer gets them
    from the same forward pass."""

    def __init__(self, spec, plus_one: bool = False):
        super().__init__()
        from .flows import build_flow

        self.spec = spec
        self.flow = build_flow(spec)
        self.plus_one = plus_one

    def with_terms(self, x: torch.Tensor):
        """(normalize(g(x)), log|det| per sample, "+1" term per sample or None)."""
        from .flows import flow_forward

        y, ladj, plus = flow_forward(self.flow, x, plus_one=self.plus_one and self.training)
        return nn.functional.normalize(y, dim=-1), ladj, plus

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.with_terms(x)[0]


class EmbeddingModel(nn.Module):
    def __init__(self, backbone: Backbone, embed_dim: int = 128, trunk_head: nn.Module | None = None,
                 embed_head: nn.Module | None = None):
        super().__init__()
        self.backbone = backbone
        self.neck = EmbeddingNeck(backbone.dim, embed_dim)
        self.trunk_head = trunk_head
        self.embed_head = embed_head

    @property
    def trunk_dim(self) -> int:
        return self.backbone.dim

    @property
    def embed_dim(self) -> int:
        return self.neck.linear.out_features

    def trunk_features(self, images: torch.Tensor) -> torch.Tensor:
        return self.head_trunk(self.backbone(images))

    def head_trunk(self, backbone_features: torch.Tensor) -> torch.Tensor:
        """Backbone output → trunk feature φ (through the trunk flow head, if any)."""
        return backbone_features if self.trunk_head is None else self.trunk_head(backbone_features)

    def embed_features(self, features: torch.Tensor) -> torch.Tensor:
        """Embeddings from trunk features φ."""
        z = self.neck(features)
        return z if self.embed_head is None else self.embed_head(z)

    @torch.inference_mode()
    def _chunked(self, fn, x, out_dim: int, chunk: int = 4096):
        was_np = isinstance(x, np.ndarray)
        t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)) if was_np else x
        self.eval()
        dev = self.neck.W.device  # inputs may live on the CPU (cached features); results go back there
        out = (torch.cat([fn(t[i: i + chunk].to(dev)).float().to(t.device) for i in range(0, len(t), chunk)])
               if len(t) else t.new_zeros(0, out_dim))
        return out.numpy() if was_np else out

    def trunk_of_backbone(self, backbone_features):
        """Backbone outputs (array or tensor) → trunk features φ, in chunks (eval mode)."""
        if self.trunk_head is None:
            return backbone_features
        return self._chunked(self.head_trunk, backbone_features, self.trunk_dim)

    def embed_of_backbone(self, backbone_features):
        """Backbone outputs (array or tensor) → embeddings, in chunks (eval mode)."""
        return self._chunked(lambda f: self.embed_features(self.head_trunk(f)), backbone_features, self.embed_dim)

    def heads_spec(self) -> dict:
        return {name: getattr(self, name).spec.to_dict()
                for name in ("trunk_head", "embed_head") if getattr(self, name) is not None}

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
