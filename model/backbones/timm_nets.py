"""Any timm model as a trunk: `timm:NAME` (NAME as timm names it, optionally with a pretrained tag,
e.g. timm:vit_small_patch14_dinov2.lvd142m).  The architecture and the preprocessing (mean, std,
input size, interpolation, crop) come from timm's pretrained configuration; the weights from
`--weights PATH`, from `--weights hub` (the local Hugging Face cache where timm would have put them,
read offline: nothing downloads) or none.  Stages: a ViT's patch embedding, its blocks (the last
with the final norm and pooling), a ConvNeXt's or ResNet's stem and stages; any other model is one
stage.  docs/training.md#timm-trunks.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.errors import UserError

from .base import Backbone, Part, load_complete, load_state_file
from .registry import BACKBONES

HUB_FILES = ("model.safetensors", "pytorch_model.bin")  # what timm reads from a Hugging Face repo, in order


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub resolves it ($HF_HUB_CACHE, else $HF_HOME/hub)."""
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return Path(env).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_repo_folder(repo_id: str) -> Path:
    return hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))


def _cached_file(repo_id: str, filename: str, revision: str | None) -> Path | None:
    """The cached file's path, read from the cache's refs and snapshots (no network)."""
    repo = hub_repo_folder(repo_id)
    ref = revision or "main"
    commit = ref
    if (repo / "refs" / ref).is_file():
        commit = (repo / "refs" / ref).read_text().strip()
    p = repo / "snapshots" / commit / filename
    return p if p.is_file() else None


def hub_weights_path(cfg: dict, name: str) -> Path:
    """The weights file timm would load for pretrained configuration `cfg`, from the local cache only;
    refused in one line, naming the file and where it goes, when it is not there."""
    hub_id = cfg.get("hf_hub_id")
    if not hub_id:
        raise UserError(f"timm:{name} has no Hugging Face weights in timm's configuration; pass --weights PATH "
                        "or --weights none")
    repo_id, _, revision = str(hub_id).partition("@")
    files = (cfg["hf_hub_filename"],) if cfg.get("hf_hub_filename") else HUB_FILES
    for f in files:
        p = _cached_file(repo_id, f, revision or None)
        if p is not None:
            return p
    where = hub_repo_folder(repo_id) / "snapshots" / "<revision>" / files[0]
    raise UserError(f"no weights for timm:{name} in the local Hugging Face cache (nothing downloads at run time): "
                    f"put {files[0]} of https://huggingface.co/{repo_id} at {where} (with refs/main naming "
                    f"<revision>; huggingface-cli download {repo_id} does this), set HF_HUB_CACHE, or pass "
                    "--weights PATH or --weights none")


def _create(name: str):
    """The timm model, random init; a ViT accepts any input size (its position embedding is resampled
    to the input's grid, and kept at its pretrained size in the state dict; a side that is no multiple
    of the patch size is zero-padded to one)."""
    import timm

    if not timm.is_model(name.partition(".")[0]):
        raise UserError(f"timm has no model {name!r} (timm.list_models() lists them; "
                        "e.g. timm:vit_small_patch14_dinov2)")
    try:
        return timm.create_model(name, pretrained=False, dynamic_img_size=True, dynamic_img_pad=True)
    except TypeError:  # not a ViT: fully convolutional, any size already
        return timm.create_model(name, pretrained=False)


def _classifier_keys(sd: dict, cfg: dict) -> list[str]:
    heads = cfg.get("classifier") or ()
    heads = (heads,) if isinstance(heads, str) else tuple(heads)
    return [k for k in sd if any(k.startswith(h + ".") for h in heads)]


def _fits(net: nn.Module, sd: dict) -> bool:
    own = net.state_dict()
    return set(own) == set(sd) and all(tuple(own[k].shape) == tuple(sd[k].shape) for k in own)


def _load(net: nn.Module, sd: dict, cfg: dict, source: str) -> None:
    """Load a state dict into the headless net: timm's own layout (its classifier dropped), else
    through the model module's checkpoint_filter_fn (original layouts, other position-embedding
    grids), as timm's own loader does; anything still incomplete is refused."""
    sd = {k: v for k, v in sd.items() if k not in _classifier_keys(sd, cfg)}
    if not _fits(net, sd):
        filt = getattr(sys.modules.get(type(net).__module__), "checkpoint_filter_fn", None)
        if filt is not None:
            try:
                sd = filt(dict(sd), net)
            except Exception:  # noqa: BLE001 - a filter that cannot read it: the completeness check says why
                pass
            sd = {k: v for k, v in sd.items() if k not in _classifier_keys(sd, cfg)}
    load_complete(net, sd, source)


def _stage_fn(net) -> tuple[str, Any]:
    from timm.models.convnext import ConvNeXt
    from timm.models.resnet import ResNet
    from timm.models.vision_transformer import VisionTransformer

    if isinstance(net, VisionTransformer):
        return "vit", vit_stages
    if isinstance(net, ConvNeXt):
        return "convnext", convnext_stages
    if isinstance(net, ResNet):
        return "resnet", resnet_stages
    return "other", None


def vit_stages(net) -> list:
    """embed (patch embedding, class/register tokens, position embedding, pre-norm), block0 … blockL−1;
    the last block also runs the final norm and the model's pooling (`forward_head(pre_logits=True)`:
    class token, mean or attention pooling, as the model defines it)."""
    def embed(x):
        return net.norm_pre(net.patch_drop(net._pos_embed(net.patch_embed(x))))

    own = dict(net._parameters)  # cls_token, reg_token, pos_embed: parameters of the net itself
    blocks = list(net.blocks)
    last = blocks[-1]

    def head(x):
        return net.forward_head(net.norm(last(x)), pre_logits=True)

    return ([("embed", Part(embed, patch_embed=net.patch_embed, norm_pre=net.norm_pre, **own))]
            + [(f"block{i}", b) for i, b in enumerate(blocks[:-1])]
            + [(f"block{len(blocks) - 1}", Part(head, block=last, norm=net.norm, fc_norm=net.fc_norm,
                                                  attn_pool=net.attn_pool))])


def convnext_stages(net) -> list:
    """stem, stage0 … stage{n−1}; the last with the pre-head norm and the head's pooling and norm."""
    stages = list(net.stages)
    last = stages[-1]

    def head(x):
        return net.forward_head(net.norm_pre(last(x)), pre_logits=True)

    return ([("stem", net.stem)] + [(f"stage{i}", s) for i, s in enumerate(stages[:-1])]
            + [(f"stage{len(stages) - 1}", Part(head, stage=last, norm_pre=net.norm_pre, head=net.head))])


def resnet_stages(net) -> list:
    """stem (conv1, bn1, act1, max-pool), layer1 … layer4 (the last with global pooling)."""
    def head(x):
        return net.forward_head(net.layer4(x), pre_logits=True)

    return [("stem", nn.Sequential(net.conv1, net.bn1, net.act1, net.maxpool)),
            ("layer1", net.layer1), ("layer2", net.layer2), ("layer3", net.layer3),
            ("layer4", Part(head, layer4=net.layer4, global_pool=net.global_pool))]


@BACKBONES.register(
    "timm:",
    doc="any timm model by name (e.g. timm:vit_small_patch14_dinov2.lvd142m, timm:vit_base_patch16_clip_224.openai, "
        "timm:convnext_atto); weights: --weights hub (the local Hugging Face cache, offline), PATH or none",
    stages=("ViT: embed, block0 … blockL−1 (the last with the final norm and pooling)",
            "ConvNeXt: stem, stage0 … stage3", "ResNet: stem, layer1 … layer4", "other models: trunk"),
    default_weights="hub",
)
def timm_model(weights: str | None = None, *, variant: str) -> Backbone:
    weights = weights or "hub"
    if weights == "imagenet":
        raise UserError(f"timm:{variant} takes --weights hub (timm's pretrained weights from the local Hugging Face "
                        "cache), PATH or none")
    net = _create(variant)
    # timm sets pretrained_cfg on the model at build time without declaring it on the class
    cfg: dict[str, Any] = dict(net.pretrained_cfg)
    net.reset_classifier(0)  # the trunk: pooled pre-logits features
    if weights != "none":
        path = hub_weights_path(cfg, variant) if weights == "hub" else Path(weights)
        _load(net, load_state_file(path), cfg, str(path))
    kind, stages_fn = _stage_fn(net)
    size = int(cfg.get("input_size", (3, 0, 0))[-1])
    crop = float(cfg.get("crop_pct") or 224 / 256)
    dim = int(getattr(net, "head_hidden_size", None) or net.num_features)  # what forward_head(pre_logits) gives
    return Backbone(f"timm:{variant}", net, dim, cfg.get("mean", (0.5,) * 3),
                    cfg.get("std", (0.5,) * 3), weights, stages_fn=stages_fn, input_size=size,
                    interpolation=str(cfg.get("interpolation") or "bilinear"), crop_pct=crop,
                    prefix_dtype=torch.float32)
