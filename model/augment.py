"""The training augmentation on whole batches of decoded images, with torch on the training device.

It is the per-image training transform of `TransformSpec.build()` (augment): torchvision's
RandomResizedCrop (area fraction CROP_SCALE, aspect ratio CROP_RATIO_RANGE, antialiased bilinear
resampling to uint8) then, where the data set allows it, a horizontal flip, then scaling and
normalisation.  The inputs are the rows of a decoded-image cache (model/features.cached_images:
each whole image squashed to the input size S, its original width and height kept beside it).

Crops are drawn as torchvision draws them on the original image, aspect ratio included: in the
cache's coordinates a crop of area fraction f and (original) aspect ratio r of an image of aspect
a = width / height is round(√(f·S²·r/a)) × round(√(f·S²·a/r)) pixels, so an image cached at its own
size (a glyph rendered at S px) gets exactly torchvision's crop.  The draws come, a batch at a
time, from the CPU generator passed in: the same seed gives the same crops on every device.

Resampling: on the CPU, torchvision's own `resized_crop` per image (its vectorised uint8 kernel),
the images shared out over a few threads; on CUDA, one `grid_sample` over the batch at the same
sample positions (bilinear, clamped to the crop), rounded to uint8 like torchvision's kernel.  The
two agree to ±1 grey level.  The normalisation is the spec's, in fewer passes (equal within 1e-6).
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from .preprocess import CROP_RATIO_RANGE, CROP_SCALE, TransformSpec

TRIES = 10  # torchvision's attempts at a crop that fits, before its central fallback


@dataclass
class Crops:
    """One batch's crops in the cached image's pixels, and which images are flipped."""
    top: torch.Tensor       # int64, B
    left: torch.Tensor
    height: torch.Tensor
    width: torch.Tensor
    flip: torch.Tensor      # bool, B


def draw_crops(aspect: torch.Tensor, size: int, generator: torch.Generator, flip: bool,
               scale: tuple[float, float] = CROP_SCALE, ratio: tuple[float, float] = CROP_RATIO_RANGE) -> Crops:
    """torchvision's RandomResizedCrop.get_params for a batch of images of aspect ratio `aspect`
    (width / height), in the coordinates of their `size` × `size` squashed copies.  The uniform draws
    come from `generator`; the arithmetic on them is numpy's (a few hundred numbers: torch would
    spread each op over its threads and wait for them)."""
    n = len(aspect)
    u = torch.rand(n, TRIES, 2, generator=generator, dtype=torch.float64).numpy()
    pos = torch.rand(n, 2, generator=generator, dtype=torch.float64).numpy()
    flips = (torch.rand(n, generator=generator) < 0.5) if flip else torch.zeros(n, dtype=torch.bool)
    a = aspect.to(torch.float64).numpy()[:, None]
    area = size * size * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    r = np.exp(lo + (hi - lo) * u[..., 1])
    w = np.round(np.sqrt(area * r / a))  # numpy rounds half to even, as Python's round in torchvision
    h = np.round(np.sqrt(area * a / r))
    fits = (w > 0) & (w <= size) & (h > 0) & (h <= size)
    first = fits.argmax(1)[:, None]  # the first try that fits
    found = fits.any(1)
    w, h = np.take_along_axis(w, first, 1)[:, 0], np.take_along_axis(h, first, 1)[:, 0]
    # torchvision's fallback: the whole image, cut to the nearest allowed aspect ratio, centred
    a = a[:, 0]
    fw = np.clip(np.where(a > ratio[1], np.round(size * ratio[1] / a), size), 1, size)
    fh = np.clip(np.where(a < ratio[0], np.round(size * a / ratio[0]), size), 1, size)
    w, h = np.where(found, w, fw), np.where(found, h, fh)
    top = np.where(found, np.floor(pos[:, 0] * (size - h + 1)), np.floor((size - h) / 2))
    left = np.where(found, np.floor(pos[:, 1] * (size - w + 1)), np.floor((size - w) / 2))
    as_long = lambda v: torch.from_numpy(v.astype(np.int64))  # noqa: E731
    return Crops(as_long(top), as_long(left), as_long(h), as_long(w), flips)


class BatchAugment:
    """`augment(images, rows, aspect, generator)`: rows `rows` of cached uint8 images (N × S × S × 3,
    on the CPU (a memory map is read in place) or the training device), of original aspect ratios
    `aspect` → the augmented, normalised float batch (B × 3 × S × S) on their device."""

    def __init__(self, spec: TransformSpec):
        if not spec.augment:
            raise ValueError("BatchAugment needs a training (augment) transform spec")
        self.spec, self.size = spec, spec.image_size
        self._pool: ThreadPoolExecutor | None = None

    def __call__(self, images: torch.Tensor, rows: torch.Tensor, aspect: torch.Tensor,
                 generator: torch.Generator) -> torch.Tensor:
        if images.shape[1:] != (self.size, self.size, 3):
            raise ValueError(f"expected N × {self.size} × {self.size} × 3 pixels, got {tuple(images.shape)}")
        crops = draw_crops(aspect, self.size, generator, self.spec.flip)
        if images.device.type == "cpu":
            return self.resample_each(images, rows.tolist(), crops)
        return self.resample_grid(images.index_select(0, rows.to(images.device)), crops)

    # ------------------------------------------------------------ the CPU: torchvision per image
    def resample_each(self, images: torch.Tensor, rows: list[int], crops: Crops) -> torch.Tensor:
        """torchvision's resized_crop (its kernel) and flip image by image, read in place from the cache and
        written, normalised, into one float batch.  The images are shared out over as many Python
        threads as torch has (its kernels release the GIL), each kernel on one thread: an image is too
        small to split, and split kernels wait on each other's threads whenever the cores are busy."""
        s = self.size
        out = torch.empty(len(rows), 3, s, s)
        boxes = torch.stack([crops.top, crops.left, crops.height, crops.width], 1).tolist()
        flips = crops.flip.tolist()
        mul, add = self._affine(out.device)

        def work(ks):
            for k in ks:
                t, left, h, w = boxes[k]
                x = images[rows[k], t: t + h, left: left + w].permute(2, 0, 1)
                if (h, w) != (s, s):  # torchvision's resized_crop on uint8, minus its dispatch
                    x = torch.nn.functional.interpolate(x[None], size=(s, s), mode="bilinear", align_corners=False,
                                                        antialias=True)[0]
                out[k].copy_(x.flip(-1) if flips[k] else x).mul_(mul).add_(add)

        threads = torch.get_num_threads()
        parts = [range(i, len(rows), threads) for i in range(min(threads, len(rows)))]
        torch.set_num_threads(1)
        try:
            if len(parts) > 1:
                self._pool = self._pool or ThreadPoolExecutor(threads, thread_name_prefix="augment")
                for f in [self._pool.submit(work, p) for p in parts]:
                    f.result()
            else:
                work(range(len(rows)))
        finally:
            torch.set_num_threads(threads)
        return out

    def _affine(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        std = torch.tensor(self.spec.std, device=device).view(3, 1, 1)
        mean = torch.tensor(self.spec.mean, device=device).view(3, 1, 1)
        return 1 / (255 * std), -mean / std

    def scale(self, pixels: torch.Tensor) -> torch.Tensor:
        """Pixel values (0 … 255, uint8 or float) → `spec.normalize`'s input, in two in-place passes
        over one float tensor (equal to it within 1e-6)."""
        mul, add = self._affine(pixels.device)
        return pixels.to(torch.float32).mul_(mul).add_(add)

    # ------------------------------------------------------------ an accelerator: one grid_sample
    def resample_grid(self, pixels: torch.Tensor, crops: Crops) -> torch.Tensor:
        s, dev = self.size, pixels.device
        top, left, h, w, flip = (v.to(dev, non_blocking=True) for v in
                                 (crops.top, crops.left, crops.height, crops.width, crops.flip))
        c = (torch.arange(s, device=dev, dtype=torch.float32) + 0.5)[None]
        # the source positions of torchvision's antialiased bilinear upsampling, clamped to the crop
        ys = (top[:, None] + c * (h[:, None] / s) - 0.5).clamp(min=top[:, None], max=(top + h - 1)[:, None])
        xs = (left[:, None] + c * (w[:, None] / s) - 0.5).clamp(min=left[:, None], max=(left + w - 1)[:, None])
        xs = torch.where(flip[:, None], xs.flip(1), xs)
        gx, gy = (2 * xs + 1) / s - 1, (2 * ys + 1) / s - 1   # grid_sample's coordinates (align_corners=False)
        grid = torch.stack(torch.broadcast_tensors(gx[:, None, :], gy[:, :, None]), -1)
        x = torch.nn.functional.grid_sample(pixels.permute(0, 3, 1, 2).float(), grid, mode="bilinear",
                                            padding_mode="border", align_corners=False)
        return self.scale(x.round_())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
