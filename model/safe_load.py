"""The one way a file of tensors is read: torch.load(weights_only=True), so a file from a user can
never run code, and any failure is a one-line refusal."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from core.errors import UserError


def load_tensors(path: str | os.PathLike, what: str):
    """The object in `path` (tensors, and dicts / lists / numbers of them), never an arbitrary pickle."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} not found: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise UserError(f"cannot read {what} {path}: {e}") from None
