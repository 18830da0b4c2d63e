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

Resampling: on the CPU, torchvision's own `resized_crop` per image (its vectorised uint8 kernel), in
a few threads; on CUDA, one `grid_sample` over the batch at the same sample positions (bilinear,
clamped to the crop), rounded to uint8 like torchvision's kernel.  The two agree to ±1 grey level.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

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
    (width / height), in the coordinates of their `size` × `size` squashed copies."""
    a = aspect.to(torch.float64)[:, None]
    n = len(a)
    u = torch.rand(n, TRIES, 2, generator=generator, dtype=torch.float64)
    area = size * size * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    r = torch.exp(lo + (hi - lo) * u[..., 1])
    w = torch.round(torch.sqrt(area * r / a))
    h = torch.round(torch.sqrt(area * a / r))
    fits = (w > 0) & (w <= size) & (h > 0) & (h <= size)
    first = fits.to(torch.uint8).argmax(1, keepdim=True)  # the first try that fits
    found = fits.any(1)
    w, h = w.gather(1, first)[:, 0], h.gather(1, first)[:, 0]
    # torchvision's fallback: the whole image, cut to the nearest allowed aspect ratio, centred
    a = a[:, 0]
    fw = torch.where(a > ratio[1], torch.round(size * ratio[1] / a), torch.full_like(a, size)).clamp(1, size)
    fh = torch.where(a < ratio[0], torch.round(size * a / ratio[0]), torch.full_like(a, size)).clamp(1, size)
    w, h = torch.where(found, w, fw), torch.where(found, h, fh)
    pos = torch.rand(n, 2, generator=generator, dtype=torch.float64)
    top = torch.where(found, torch.floor(pos[:, 0] * (size - h + 1)), torch.floor((size - h) / 2))
    left = torch.where(found, torch.floor(pos[:, 1] * (size - w + 1)), torch.floor((size - w) / 2))
    flips = (torch.rand(n, generator=generator) < 0.5) if flip else torch.zeros(n, dtype=torch.bool)
    return Crops(top.long(), left.long(), h.long(), w.long(), flips)


class BatchAugment:
    """`augment(images, rows, aspect, generator)`: rows `rows` of cached uint8 images (N × S × S × 3,
    on the CPU (a memory map is read in place) or the training device), of original aspect ratios
    `aspect` → the augmented, normalised float batch (B × 3 × S × S) on their device."""

    def __init__(self, spec: TransformSpec, threads: int | None = None):
        if not spec.augment:
            raise ValueError("BatchAugment needs a training (augment) transform spec")
        self.spec, self.size = spec, spec.image_size
        self.threads = threads or max(1, torch.get_num_threads())
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
        from torchvision.transforms.v2 import functional as F

        s = self.size
        out = torch.empty(len(rows), 3, s, s)
        box = torch.stack([crops.top, crops.left, crops.height, crops.width], 1).tolist()
        flips = crops.flip.tolist()

        def work(ks):
            for k in ks:
                t, left, h, w = box[k]
                x = F.resized_crop(images[rows[k]].permute(2, 0, 1), t, left, h, w, [s, s], antialias=True)
                if flips[k]:
                    x = F.horizontal_flip(x)
                out[k] = self.spec.normalize(x)

        chunks = [range(i, len(rows), self.threads) for i in range(min(self.threads, len(rows)))]
        if len(chunks) <= 1:
            for c in chunks:
                work(c)
        else:  # torch's kernels release the GIL: the images of a batch resample in parallel
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="augment")
            for f in [self._pool.submit(work, c) for c in chunks]:
                f.result()
        return out

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
        return self.spec.normalize(x.round_().to(torch.uint8))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
