"""torchvision ResNet-18/50 and GoogLeNet.  Weights never download at run time:
they come from a file the user names, or from the torch hub cache
(`$TORCH_HOME/hub/checkpoints/`) where torchvision itself would have put them.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torchvision
from torch import nn

from core.errors import UserError

from .base import IMAGENET_MEAN, IMAGENET_STD, Backbone, Pooled, load_complete, load_state_file
from .registry import BACKBONES

_SPECS = {
    # name: (constructor, weights enum, feature dim)
    "resnet18": (torchvision.models.resnet18, torchvision.models.ResNet18_Weights.IMAGENET1K_V1, 512),
    "resnet50": (torchvision.models.resnet50, torchvision.models.ResNet50_Weights.IMAGENET1K_V1, 2048),
    "googlenet": (torchvision.models.googlenet, torchvision.models.GoogLeNet_Weights.IMAGENET1K_V1, 1024),
}


def cached_weights_path(name: str) -> Path:
    """Where torchvision caches this model's ImageNet weights."""
    fname = os.path.basename(_SPECS[name][1].url)
    return Path(torch.hub.get_dir()) / "checkpoints" / fname


def _resolve(name: str, weights: str) -> Path | None:
    if weights == "none":
        return None
    if weights == "imagenet":
        p = cached_weights_path(name)
        if not p.is_file():
            raise UserError(
                f"no ImageNet weights for {name} on this machine (no downloads at run time). "
                f"Put the file {p.name} at {p} (or set TORCH_HOME), pass --weights PATH, "
                f"or use --weights none for a randomly initialised {name}."
            )
        return p
    return Path(weights)


def _build(name: str, weights: str) -> Backbone:
    ctor, _, dim = _SPECS[name]
    path = _resolve(name, weights)
    if name == "googlenet":
        # The ImageNet checkpoint includes the auxiliary heads and expects
        # transform_input=True; build that layout, load, then drop the heads.
        net = ctor(weights=None, aux_logits=path is not None, transform_input=path is not None,
                   init_weights=path is None)
    else:
        net = ctor(weights=None)
    if path is not None:
        load_complete(net, load_state_file(path), str(path))
    if name == "googlenet":
        net.aux_logits = False
        net.aux1 = None
        net.aux2 = None
    net.fc = nn.Identity()
    return Backbone(name, net, dim, IMAGENET_MEAN, IMAGENET_STD, weights,
                    stages_fn=googlenet_stages if name == "googlenet" else resnet_stages, input_size=224)


def _pool(net):
    return lambda x: torch.flatten(net.avgpool(x), 1)


RESNET_STAGES = ("stem", "layer1", "layer2", "layer3", "layer4")


def resnet_stages(net) -> list:
    """stem (conv1, bn, relu, max-pool), layer1 … layer4 (the last with global pooling)."""
    return [("stem", nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool)),
            ("layer1", net.layer1), ("layer2", net.layer2), ("layer3", net.layer3),
            ("layer4", Pooled(net.layer4, _pool(net)))]


class _GoogLeNetStem(nn.Module):
    """Holds only the stem's layers (not the whole net: a stage's parameters must be its own, or the
    optimizer would see every weight in the stem's group)."""

    _transform: Callable[[torch.Tensor], torch.Tensor]  # set in __init__, past nn.Module's __setattr__

    def __init__(self, net):
        super().__init__()
        self.convs = nn.Sequential(net.conv1, net.maxpool1, net.conv2, net.conv3, net.maxpool2)
        object.__setattr__(self, "_transform", net._transform_input)  # a bound method, not a submodule

    def forward(self, x):
        return self.convs(self._transform(x))


def googlenet_stages(net) -> list:
    """stem, then the inception groups 3 (a, b), 4 (a–e) and 5 (a, b, with global pooling);
    dropout is left out: it is the identity in evaluation and these are trunk features."""
    return [("stem", _GoogLeNetStem(net)),
            ("inception3", nn.Sequential(net.inception3a, net.inception3b, net.maxpool3)),
            ("inception4", nn.Sequential(net.inception4a, net.inception4b, net.inception4c, net.inception4d,
                                         net.inception4e, net.maxpool4)),
            ("inception5", Pooled(nn.Sequential(net.inception5a, net.inception5b), _pool(net)))]


@BACKBONES.register(
    "resnet18",
    doc="torchvision ResNet-18; ImageNet weights from --weights PATH or the torch cache; 512-d",
    stages=RESNET_STAGES, input_size=224,
)
def resnet18(weights: str | None = None) -> Backbone:
    weights = weights or "imagenet"
    return _build("resnet18", weights)


@BACKBONES.register(
    "resnet50",
    doc="torchvision ResNet-50; ImageNet weights from --weights PATH or the torch cache; 2048-d",
    stages=RESNET_STAGES, input_size=224,
)
def resnet50(weights: str | None = None) -> Backbone:
    weights = weights or "imagenet"
    return _build("resnet50", weights)


@BACKBONES.register(
    "googlenet",
    doc="torchvision GoogLeNet (Inception v1); ImageNet weights from --weights PATH or the torch cache; 1024-d",
    stages=("stem", "inception3", "inception4", "inception5"), input_size=224,
)
def googlenet(weights: str | None = None) -> Backbone:
    weights = weights or "imagenet"
    return _build("googlenet", weights)
