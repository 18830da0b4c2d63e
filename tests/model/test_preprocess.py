"""model/preprocess.py: the resize modes, and how they reach cache keys and manifests."""
import numpy as np
import pytest
import torch
from PIL import Image

from data import DataConfig
from model.preprocess import TransformSpec, transform_for


class FakeBackbone:
    mean = (0.0, 0.0, 0.0)
    std = (1.0, 1.0, 1.0)


def wide_image_with_red_edges() -> Image.Image:
    a = np.full((20, 60, 3), 255, np.uint8)
    a[:, :9] = (255, 0, 0)   # left edge
    a[:, -9:] = (255, 0, 0)  # right edge
    a[:5, 9:-9] = (0, 0, 255)  # a blue band along the top quarter
    return Image.fromarray(a)


def share(x: torch.Tensor, rgb) -> float:
    hit = torch.ones(x.shape[1:], dtype=torch.bool)
    for c, v in enumerate(rgb):
        hit &= (x[c] - v).abs() < 0.1
    return float(hit.float().mean())


RED, BLUE = (1, 0, 0), (0, 0, 1)


def test_modes_follow_the_data_set_and_the_flag():
    bb = FakeBackbone()
    assert transform_for(bb, DataConfig(dataset="kanji")).mode == "resize"
    crop = transform_for(bb, DataConfig(dataset="imagefolder", image_size=32))
    assert (crop.mode, crop.image_size, crop.resize) == ("crop", 32, 37)
    pad = transform_for(bb, DataConfig(dataset="imagefolder", image_size=32, resize_mode="pad"))
    assert (pad.mode, pad.resize) == ("pad", 32)
    assert transform_for(bb, DataConfig(dataset="kanji", resize_mode="crop")).mode == "crop"


def test_crop_cuts_the_edges_pad_keeps_them():
    img = wide_image_with_red_edges()
    bb = FakeBackbone()
    out = {m: transform_for(bb, DataConfig(dataset="imagefolder", image_size=20, resize_mode=m)).build()(img)
           for m in ("crop", "resize", "pad")}
    assert all(x.shape == (3, 20, 20) for x in out.values())
    assert share(out["crop"], RED) == 0.0                # the centre crop loses both red edges
    assert share(out["pad"], RED) > 0.05 and share(out["resize"], RED) > 0.05
    # resize squashes: the blue band stays a quarter of the height; pad repeats the top row (blue)
    # above the image, so blue fills about (20 + 5) / 60 of it
    assert share(out["resize"], BLUE) == pytest.approx(0.25 * 42 / 60, abs=0.06)
    assert share(out["pad"], BLUE) == pytest.approx(25 / 60 * 42 / 60, abs=0.06)


def test_describe_keeps_old_keys_for_crop_and_resize_and_names_pad():
    old = {"image_size": 64, "resize": 64, "mean": (0.5,) * 3, "std": (0.5,) * 3, "augment": False}
    spec = TransformSpec.from_dict(old)
    assert spec.describe() == old and spec.mode == "resize"  # manifests and cache keys made before pad
    pad = TransformSpec(64, 64, (0.5,) * 3, (0.5,) * 3, False, "pad")
    assert pad.describe()["resize_mode"] == "pad" and pad.describe() != spec.describe()
    assert TransformSpec.from_dict(pad.describe()) == pad
