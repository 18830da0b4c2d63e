"""model/augment.py and the decoded-image cache: the batched augmentation is torchvision's
RandomResizedCrop + flip per image, and the cache holds exactly the pixels the per-image
transforms see."""
import math

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as F

from data import DataConfig, load_data
from model.augment import BatchAugment, draw_crops
from model.features import cached_images
from model.preprocess import CROP_RATIO_RANGE, CROP_SCALE, TransformSpec, transform_for

SPEC = TransformSpec(24, 24, (0.5, 0.4, 0.3), (0.2, 0.25, 0.3), augment=True, flip=True)


def torchvision_reference(images, crops, spec):
    """Each image through torchvision's own resized_crop and flip, then the spec's normalisation."""
    out = []
    for k in range(len(images)):
        x = F.resized_crop(images[k].permute(2, 0, 1).contiguous(), int(crops.top[k]), int(crops.left[k]),
                           int(crops.height[k]), int(crops.width[k]), [spec.image_size] * 2, antialias=True)
        if crops.flip[k]:
            x = F.horizontal_flip(x)
        out.append(T.Compose([T.ToDtype(torch.float32, scale=True), T.Normalize(spec.mean, spec.std)])(x))
    return torch.stack(out)


def test_batched_crops_on_the_cpu_equal_torchvision_image_by_image():
    images = torch.randint(0, 256, (40, 24, 24, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    rows = torch.tensor([3, 0, 7, 7, 39, 12])
    aspect = torch.tensor([1.0, 1.3, 0.7, 1.0, 2.5, 0.2])
    out = BatchAugment(SPEC)(images, rows, aspect, torch.Generator().manual_seed(5))
    crops = draw_crops(aspect, 24, torch.Generator().manual_seed(5), flip=True)  # the same draws
    assert out.shape == (6, 3, 24, 24) and out.dtype == torch.float32
    ref = torchvision_reference(images[rows], crops, SPEC)
    assert torch.allclose(out, ref, rtol=0, atol=2e-6)  # the same pixels; the normalisation's round-off
    pixels = (out * torch.tensor(SPEC.std).view(1, 3, 1, 1) + torch.tensor(SPEC.mean).view(1, 3, 1, 1)) * 255
    assert torch.equal(pixels.round(), (ref * torch.tensor(SPEC.std).view(1, 3, 1, 1)
                                        + torch.tensor(SPEC.mean).view(1, 3, 1, 1)).mul(255).round())


def test_the_accelerator_path_agrees_with_torchvision_to_one_grey_level():
    images = torch.randint(0, 256, (30, 24, 24, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    crops = draw_crops(torch.ones(30), 24, torch.Generator().manual_seed(2), flip=True)
    grid = BatchAugment(SPEC).resample_grid(images, crops)  # the CUDA code path, run on CPU tensors
    ref = torchvision_reference(images, crops, SPEC)
    grey = (grid - ref).abs() * torch.tensor(SPEC.std).view(1, 3, 1, 1) * 255
    assert grey.max() < 1.01 and (grey > 0.5).float().mean() < 0.25


def test_crops_are_drawn_as_torchvision_draws_them():
    """Crop area fraction and aspect ratio (in the original image), for square and oblong images."""
    n = 6000
    for a in (1.0, 1.6, 0.5):
        w_orig, h_orig = round(120 * a), 120
        crops = draw_crops(torch.full((n,), a), 64, torch.Generator().manual_seed(3), flip=False)
        area = (crops.height * crops.width).double() / 64**2
        ratio = crops.width.double() / crops.height * a  # back in the original's pixels
        torch.manual_seed(0)
        tv = torch.tensor([T.RandomResizedCrop.get_params(torch.empty(3, h_orig, w_orig), list(CROP_SCALE),
                                                          list(CROP_RATIO_RANGE)) for _ in range(n)]).double()
        tv_area, tv_ratio = tv[:, 2] * tv[:, 3] / (w_orig * h_orig), tv[:, 3] / tv[:, 2]
        assert area.mean() == pytest.approx(float(tv_area.mean()), abs=0.01)
        assert ratio.mean() == pytest.approx(float(tv_ratio.mean()), abs=0.02)
        assert ratio.std() == pytest.approx(float(tv_ratio.std()), abs=0.02)
        inside = ((crops.top >= 0) & (crops.left >= 0) & (crops.top + crops.height <= 64)
                  & (crops.left + crops.width <= 64))
        assert bool(inside.all()) and not crops.flip.any()
    # a square image: the scale and ratio ranges hold up to one pixel of rounding
    crops = draw_crops(torch.ones(n), 64, torch.Generator().manual_seed(4), flip=True)
    area = (crops.height * crops.width).double() / 64**2
    assert area.min() >= CROP_SCALE[0] - 2 * 65 / 64**2 and area.max() <= 1.0
    assert 0.45 < crops.flip.double().mean() < 0.55
    again = draw_crops(torch.ones(n), 64, torch.Generator().manual_seed(4), flip=True)
    assert all(torch.equal(getattr(crops, k), getattr(again, k)) for k in ("top", "left", "height", "width", "flip"))


@pytest.fixture()
def folder(tmp_path):
    rng = np.random.default_rng(0)
    for c in range(8):
        (tmp_path / "img" / f"c{c}").mkdir(parents=True)
        for j in range(3):
            Image.fromarray(rng.integers(0, 255, (20 + 4 * j, 30, 3), dtype=np.uint8)).save(
                tmp_path / "img" / f"c{c}" / f"{j}.png")
    (tmp_path / "img" / "c1" / "broken.png").write_bytes(b"not a png")
    return tmp_path


class FakeBackbone:
    mean = (0.485, 0.456, 0.406)
    std = (0.229, 0.224, 0.225)


def test_the_cache_holds_what_the_transforms_see_and_is_reused(folder):
    from core.images import load_rgb

    cfg = DataConfig(dataset="imagefolder", data_root=str(folder / "img"), image_size=24, workers="0")
    splits = load_data(cfg, progress=False)
    cache = str(folder / "cache")
    for sub in (splits.train, splits.val, splits.test):
        readable = [i for i in range(len(sub)) if not sub.paths[i].endswith("broken.png")]
        ev = transform_for(FakeBackbone(), cfg)  # evaluation: crop mode, exactly build()'s input
        c = cached_images(splits, sub, ev, cfg, cache, progress=False)
        assert isinstance(c.pixels, np.memmap) and c.pixels.shape == (len(readable), 24, 24, 3)
        assert c.kept.tolist() == readable and len(c.skipped) == len(sub) - len(readable)
        x = ev.normalize(torch.from_numpy(np.asarray(c.pixels)).permute(0, 3, 1, 2).contiguous())
        ref = torch.stack([ev.build()(load_rgb(sub.abspath(i))) for i in readable])
        assert torch.equal(x, ref)
        tr = transform_for(FakeBackbone(), cfg, augment=True)  # training: the whole image, squashed
        t = cached_images(splits, sub, tr, cfg, cache, progress=False)
        first = load_rgb(sub.abspath(readable[0]))
        assert t.sizes[0].tolist() == list(first.size)
        squashed = T.Compose([T.ToImage(), T.Resize((24, 24), antialias=True)])(first)
        assert torch.equal(torch.from_numpy(np.asarray(t.pixels[0])).permute(2, 0, 1), squashed)
        assert t.path != c.path and cached_images(splits, sub, tr, cfg, cache, progress=False).path == t.path
    n = len(list((folder / "cache").iterdir()))
    assert n == 6  # 3 splits × 2 geometries, each built once
    bigger = transform_for(FakeBackbone(), DataConfig(dataset="imagefolder", image_size=28), augment=True)
    assert cached_images(splits, splits.train, bigger, cfg, cache, progress=False).pixels.shape[1:] == (28, 28, 3)
    assert len(list((folder / "cache").iterdir())) == n + 1


def test_a_crop_of_a_cached_oblong_image_keeps_the_original_aspect():
    """An image twice as wide as high, squashed into the cache: a crop that takes its whole height takes
    a width of the cached square that is, in the original, at most 1.25 × that height (the ratio range)."""
    crops = draw_crops(torch.full((4000,), 2.0), 64, torch.Generator().manual_seed(0), flip=False)
    ratio = crops.width.double() / crops.height * 2.0
    assert ratio.min() >= CROP_RATIO_RANGE[0] - 0.05 and ratio.max() <= CROP_RATIO_RANGE[1] + 0.05
    assert math.isclose(float((crops.height * crops.width).double().mean() / 64**2), 0.62, abs_tol=0.05)
