"""A small CNN for training from scratch (and as the random-init floor)."""
from __future__ import annotations

from torch import nn

from core.errors import UserError

from .base import Backbone, Pooled, load_complete, load_state_file
from .registry import BACKBONES


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


class SmallCNN(nn.Module):
    def __init__(self, widths=(16, 32, 64, 128)):  # small enough to train from scratch on 2 CPU cores
        super().__init__()
        layers, cin = [], 3
        for w in widths:
            layers.append(_block(cin, w))
            cin = w
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.out_dim = cin

    def forward(self, x):
        return self.pool(self.features(x)).flatten(1)


@BACKBONES.register("small_cnn", doc="a small 4-block CNN, random init, for training from scratch; 128-d",
                    stages=("block0", "block1", "block2", "block3"), default_weights="none")
def small_cnn(weights: str | None = None) -> Backbone:
    weights = weights or "none"
    if weights == "imagenet":
        raise UserError("small_cnn has no pretrained weights; use --weights none or a file")
    net = SmallCNN()
    if weights != "none":
        load_complete(net, load_state_file(weights), weights)
    return Backbone("small_cnn", net, net.out_dim, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), weights, stages_fn=stages)


def stages(net: SmallCNN) -> list:
    """Its conv blocks; the last one with global pooling."""
    blocks = list(net.features)
    def pool(x):
        return net.pool(x).flatten(1)
    return ([(f"block{i}", b) for i, b in enumerate(blocks[:-1])]
            + [(f"block{len(blocks) - 1}", Pooled(blocks[-1], pool))])
