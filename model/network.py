"""Backbone + linear embedding neck W, so the learned metric on trunk features is M = WᵀW.

  trunk feature φ(x) ∈ R^d  (d = backbone.dim)
  embedding      e(x) = W φ(x) ∈ R^k  (k = embed_dim, default 128)
  eᵢᵀeⱼ = φᵢᵀ (WᵀW) φⱼ = φᵢᵀ M φⱼ

The index (posterior refinement) works on φ and M, training on e.

Optional flow "metric layers" (determinant regularizer, paper 000):
  trunk position: φ = normalize(g(a(backbone(x)))) — the flow is part of the trunk,
                  so M = WᵀW still describes the embeddings' inner products exactly;
  neck position:  e = normalize(g(a(W φ)))         — the paper's placement; M = WᵀW
                  then describes the linear part *before* the flow only, and the
                  index's refinements act on that linear metric.
a is the flow head's elementwise activation (its spec's `activation`; identity for
"none"): paper 000 puts "an activation layer" between the embedding layer and the flows.
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


# the activations a flow head may apply before its flow; ELU is smooth and injective (a bijection onto
# (−1, ∞)), so a(W φ) keeps every feature distinction and passes a gradient for every input
ACTIVATIONS = ("none", "elu", "relu", "leaky_relu")


def flow_activation(name: str) -> nn.Module:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown flow-head activation {name!r}; choose from {ACTIVATIONS}")
    return {"none": nn.Identity, "elu": nn.ELU, "relu": nn.ReLU, "leaky_relu": nn.LeakyReLU}[name]()


class FlowHead(nn.Module):
    """normalize(g(a(x))) for an elementwise activation a (spec.activation) and a normalizing flow g.
    `with_terms` also returns g's per-sample log|det ∂g/∂u| at u = a(x) and, when `plus_one`, paper
    000's "+1" term, so a regularizer gets them from the same forward pass.  Both are Jacobians of g
    with respect to its input u (paper 000's R is a property of the metric layers, not of a).
    The activation has no parameters: a spec without it (older checkpoints) loads as "none"."""

    def __init__(self, spec, plus_one: bool = False):
        super().__init__()
        from .flows import build_flow

        self.spec = spec
        self.activation = flow_activation(getattr(spec, "activation", "none"))
        self.flow = build_flow(spec)
        self.plus_one = plus_one

    def flow_input(self, x: torch.Tensor) -> torch.Tensor:
        """u = a(x): the space the flow takes its input in (where paper 000 augments samples)."""
        return self.activation(x)

    def flow_terms(self, u: torch.Tensor):
        """(normalize(g(u)), log|det| per sample, "+1" term per sample or None) for flow inputs u."""
        from .flows import flow_forward

        y, ladj, plus = flow_forward(self.flow, u, plus_one=self.plus_one and self.training)
        return nn.functional.normalize(y, dim=-1), ladj, plus

    def with_terms(self, x: torch.Tensor):
        """(normalize(g(a(x))), log|det| per sample, "+1" term per sample or None)."""
        return self.flow_terms(self.flow_input(x))

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
