"""Checkpoints: written atomically, read with torch.load(weights_only=True).

A checkpoint is a plain dict of tensors and JSON-like values (never pickled
objects), holding everything needed to rebuild the model and to know what it
was trained on: config, backbone name and weights, dims, class split, metrics,
and any extra state (loss proxies, flows) under "extra".
"""
from __future__ import annotations

import torch

from core.atomic import write_with
from core.errors import CheckpointMismatchError

from .backbones import build_backbone
from .network import EmbeddingModel

FORMAT = "dml-retrieval-checkpoint"
VERSION = 1


def save_checkpoint(path, model: EmbeddingModel, *, config: dict | None = None,
                    split: dict | None = None, metrics: dict | None = None,
                    extra: dict | None = None, data: dict | None = None) -> None:
    """`data` is {"config": the resolved DataConfig fields, "transform": TransformSpec.describe()}:
    what downstream commands read instead of asking the user again."""
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "backbone": model.backbone.name,
        "backbone_weights": str(model.backbone.weights),
        "backbone_preprocessing": model.backbone.preprocessing(),
        "trunk_dim": model.trunk_dim,
        "embed_dim": model.embed_dim,
        "heads": model.heads_spec(),
        "config": config or {},
        "split": split or {},
        "data": data or {},
        "metrics": metrics or {},
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "extra": extra or {},
    }
    write_with(path, lambda tmp: torch.save(payload, tmp))


def read_checkpoint(path) -> dict:
    from core.manifest import check_versioned

    from .safe_load import load_tensors

    return check_versioned(load_tensors(path, "checkpoint"), FORMAT, VERSION, str(path), "checkpoint")


def recorded_data(ck: dict):
    """The data configuration a checkpoint was trained on (its resolved image size and resize
    mode); checkpoints written before `data` was recorded fall back to their run config."""
    from data import DataConfig

    return DataConfig.from_dict((ck.get("data") or {}).get("config") or ck.get("config") or {})


def data_config_for(ck: dict, given=None, source: str = "the checkpoint"):
    """The checkpoint's data configuration with the settings the user gave laid over it
    (data.config.with_overrides: a change that alters the result prints a warning)."""
    from data.config import with_overrides

    return with_overrides(recorded_data(ck), given, source)


def check_compatible(ck: dict, *, backbone: str | None = None, embed_dim: int | None = None,
                     trunk_dim: int | None = None, source: str = "checkpoint") -> None:
    if backbone is not None and ck["backbone"] != backbone:
        raise CheckpointMismatchError(
            f"{source} was trained with backbone {ck['backbone']!r}, not {backbone!r}")
    if embed_dim is not None and ck["embed_dim"] != embed_dim:
        raise CheckpointMismatchError(
            f"{source} has embedding dimension {ck['embed_dim']}, expected {embed_dim}")
    if trunk_dim is not None and ck["trunk_dim"] != trunk_dim:
        raise CheckpointMismatchError(
            f"{source} has trunk dimension {ck['trunk_dim']}, expected {trunk_dim}")


def model_from_checkpoint(ck: dict) -> EmbeddingModel:
    """Rebuild the embedding model; weights come from the checkpoint, nothing is downloaded."""
    from .flows import FlowSpec
    from .network import FlowHead

    backbone = build_backbone(ck["backbone"], weights="none")
    heads = {k: FlowHead(FlowSpec.from_dict(v)) for k, v in ck.get("heads", {}).items()}
    model = EmbeddingModel(backbone, ck["embed_dim"], **heads)
    backbone.weights = ck.get("backbone_weights", "none")
    if ck.get("backbone_preprocessing"):  # as trained, whatever the installed timm's configuration says now
        backbone.set_preprocessing(ck["backbone_preprocessing"])
    sd = ck["state_dict"]
    own = model.state_dict()
    bad = [k for k in own if k not in sd or tuple(own[k].shape) != tuple(sd[k].shape)]
    extra = [k for k in sd if k not in own]
    if bad or extra:
        raise CheckpointMismatchError(
            f"checkpoint weights do not fit {ck['backbone']} with embedding dim {ck['embed_dim']}: "
            f"{len(bad)} missing or mis-shaped (e.g. {bad[:3]}), {len(extra)} unexpected")
    model.load_state_dict(sd)
    return model.eval()


def load_model(path, **expect) -> tuple[EmbeddingModel, dict]:
    ck = read_checkpoint(path)
    check_compatible(ck, source=str(path), **expect)
    return model_from_checkpoint(ck), ck

