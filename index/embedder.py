"""Turning query or gallery images into trunk features with the index's own model.

The model comes from the checkpoint the index was built with; a checkpoint
whose checksum differs from the manifest's is refused (another model would
put its features in another space).  Preprocessing is the manifest's, so a
query is treated exactly as the indexed images were.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from core.errors import UserError
from core.hashing import sha256_file
from core.images import load_rgb
from model.checkpoint import load_model, recorded_data
from model.device import resolve_device
from model.preprocess import TransformSpec, transform_for


class ImageEmbedder:
    def __init__(self, checkpoint, manifest: dict | None = None, device: str = "cpu"):
        if manifest is not None and not manifest.get("checkpoint_sha256"):
            raise UserError("this index was built from precomputed features: it has no model to "
                            "embed images with; search it by feature vectors (--features)")
        checkpoint = Path(checkpoint or "")
        if not checkpoint.is_file():
            raise UserError(f"the model checkpoint {checkpoint} is not there: pass --checkpoint with the "
                            "model this index was built with")
        if manifest is not None:
            want = manifest["checkpoint_sha256"]
            got = sha256_file(checkpoint)
            if got != want:
                raise UserError(f"checkpoint {checkpoint} is not the model this index was built with "
                                f"(checksum {got[:12]}… ≠ {want[:12]}…)")
        self.model, self.ck = load_model(checkpoint)
        if manifest is not None and self.model.trunk_dim != manifest["trunk_dim"]:
            raise UserError(f"model trunk dim {self.model.trunk_dim} ≠ index dim {manifest['trunk_dim']}")
        self.backbone = self.model.backbone.eval()
        t = (manifest or {}).get("transform")
        if t is None:  # no manifest: the checkpoint's own data settings decide the preprocessing
            self.spec = transform_for(self.backbone, recorded_data(self.ck))
        else:
            self.spec = TransformSpec.from_dict(t)
        self.transform = self.spec.build()
        self.device = resolve_device(device)
        # channels-last on the CPU: one query image at a time through a mobile backbone's
        # depthwise and 1×1 convolutions runs faster there (oneDNN; bench/serving_costs.py); the
        # same weights, features equal to float round-off (tested against the gallery's).  GPUs
        # keep the default layout, which is what was measured there (nothing, here).
        self.layout = torch.channels_last if self.device.type == "cpu" else torch.contiguous_format
        self.model.to(self.device)  # Module.to takes a device or a memory format, not both (its documented forms)
        self.model.to(memory_format=self.layout)
        self.sha256 = sha256_file(checkpoint)
        self.path = checkpoint

    @torch.inference_mode()
    def features(self, images) -> np.ndarray:
        """Images (paths, bytes or PIL images) → trunk features (n × d)."""
        from PIL import Image

        tensors = []
        for im in images:
            im = im.convert("RGB") if isinstance(im, Image.Image) else load_rgb(im)
            tensors.append(self.transform(im))
        if not tensors:
            return np.zeros((0, self.model.trunk_dim), np.float32)
        # FAISS is on the CPU: features come back as contiguous float32 there
        x = torch.stack(tensors).to(self.device, memory_format=self.layout)
        return self.model.eval().trunk_features(x).float().cpu().numpy()
