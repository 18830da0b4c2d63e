"""What every backbone provides: a trunk feature of size `dim` and its preprocessing."""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from core.errors import UserError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class Backbone(nn.Module):
    """Wraps a trunk network; `forward(images) -> (B, dim)` trunk features.

    `stages_fn(trunk)` lists the trunk's stages in order as (name, module) pairs, the
    last one ending in the global pooling, so that running them in turn is the
    forward pass.  Partial fine-tuning freezes a prefix of them.  They are looked up
    from the trunk on demand, so the state-dict keys (and checkpoints) stay the trunk's.

    Preprocessing: `mean`, `std`; `interpolation` and `crop_pct` (the centre crop's share of the
    resized side) of its resize; `input_size`, the size it was trained at (0: none).
    `prefix_dtype`: the dtype a tail's cached prefix maps are stored in.
    """

    def __init__(self, name: str, trunk: nn.Module, dim: int, mean, std, weights: str,
                 stages_fn: Callable[[Any], list] | None = None, *, input_size: int = 0,
                 interpolation: str = "bilinear", crop_pct: float = 224 / 256,
                 prefix_dtype: torch.dtype = torch.float16):
        super().__init__()
        self.name = name
        self.trunk = trunk
        self.dim = int(dim)
        self.mean = tuple(float(m) for m in mean)
        self.std = tuple(float(s) for s in std)
        self.weights = weights  # "imagenet", "hub", "none" or a file path: where the weights came from
        self._stages_fn = stages_fn
        self.input_size = int(input_size)
        self.interpolation = interpolation
        self.crop_pct = float(crop_pct)
        self.prefix_dtype = prefix_dtype

    def preprocessing(self) -> dict:
        """What a checkpoint records to rebuild this backbone's input pipeline."""
        return {"mean": list(self.mean), "std": list(self.std), "interpolation": self.interpolation,
                "crop_pct": self.crop_pct, "input_size": self.input_size}

    def set_preprocessing(self, d: dict) -> None:
        self.mean = tuple(float(m) for m in d.get("mean", self.mean))
        self.std = tuple(float(s) for s in d.get("std", self.std))
        self.interpolation = str(d.get("interpolation", self.interpolation))
        self.crop_pct = float(d.get("crop_pct", self.crop_pct))
        self.input_size = int(d.get("input_size", self.input_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.trunk(x)

    def stages(self) -> list[tuple[str, nn.Module]]:
        if self._stages_fn is None:
            return [("trunk", self.trunk)]
        return self._stages_fn(self.trunk)

    def run_stages(self, x: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Stages start … stop−1 on x: (0, n) is a prefix's output, (n, None) the rest of the trunk."""
        for _, m in self.stages()[start:stop]:
            x = m(x)
        return x

    def fingerprint(self, prefix: int | None = None) -> str:
        """Hash of the exact parameter (and buffer) values: part of every feature-cache key.
        With `prefix`, only those of the first `prefix` stages: a cached prefix stays valid
        while the stages after it train."""
        h = hashlib.sha256(self.name.encode())
        items: Iterable[tuple[str, Any]]
        if prefix is None:
            items = self.trunk.state_dict().items()
        else:
            h.update(f"prefix:{prefix}".encode())
            items = [(f"{i}.{k}", v) for i, (_, m) in enumerate(self.stages()[:prefix])
                     for k, v in m.state_dict().items()]
        for k, v in items:
            h.update(k.encode())
            h.update(v.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


class Part(nn.Module):
    """A stage made of some of the trunk's modules and parameters (`owned`, registered here so the
    stage's parameters and state are its own) and a function `fn` that runs them as the trunk does."""

    _fn: Callable[[torch.Tensor], torch.Tensor]

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor], **owned):
        super().__init__()
        for k, v in owned.items():
            if v is not None:
                setattr(self, k, v)
        object.__setattr__(self, "_fn", fn)  # a closure over the trunk, not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fn(x)


class Pooled(nn.Module):
    """A stage followed by global pooling to (B, C): the trunk's last stage."""

    def __init__(self, stage: nn.Module, pool: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.stage = stage
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.stage(x))


def load_state_file(path: str | os.PathLike) -> dict:
    """Load a weights file safely (tensors only, never arbitrary pickles)."""
    from ..safe_load import load_tensors

    sd = load_tensors(path, "weights file")
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise UserError(f"{path} does not hold a state dict")
    return sd


def load_complete(module: nn.Module, sd: dict, source: str) -> None:
    """Load a state dict and refuse a partial load: every key and shape must match."""
    own = module.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shapes = [k for k in own if k in sd and tuple(own[k].shape) != tuple(sd[k].shape)]
    if missing or unexpected or shapes:
        raise UserError(
            f"weights in {source} do not fit this network: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected "
            f"(e.g. {unexpected[:3]}), {len(shapes)} with other shapes (e.g. {shapes[:3]})"
        )
    module.load_state_dict(sd, strict=True)
