"""Load any image file as 8-bit RGB, or fail with an error that names the file.

Handles grayscale, 1-bit, RGBA/LA (composited on white), palette with
transparency, CMYK, 16-bit and float images, and EXIF orientation.  Pillow's
decompression-bomb limit stays on: a huge image is refused, not decoded.
"""
from __future__ import annotations

import io
import os
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .errors import CorruptImageError

# Pillow warns at MAX_IMAGE_PIXELS and raises at 2x; make the warning an error
# too, so a bomb never gets decoded half-way by a data loader worker.
MAX_PIXELS = Image.MAX_IMAGE_PIXELS or 89_478_485


def _to_8bit_gray(im: Image.Image) -> Image.Image:
    a = np.asarray(im, dtype=np.float64)
    lo, hi = float(np.nanmin(a)), float(np.nanmax(a))
    if im.mode.startswith("I;16") or (im.mode == "I" and hi <= 65535 and lo >= 0):
        # 16-bit: keep the absolute scale, as a viewer would.
        a = a / 257.0 if hi > 255 else a
    elif hi > lo:
        a = (a - lo) / (hi - lo) * 255.0
    return Image.fromarray(np.clip(np.nan_to_num(a), 0, 255).astype(np.uint8), mode="L")


def to_rgb(im: Image.Image) -> Image.Image:
    """Convert an opened PIL image (any mode) to RGB, applying EXIF orientation."""
    im = ImageOps.exif_transpose(im)
    mode = im.mode
    if mode == "RGB":
        return im
    if mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
        mode = im.mode
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        im = im.convert("RGBA")
        bg = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, im).convert("RGB")
    if mode in ("I", "F") or mode.startswith("I;16"):
        return _to_8bit_gray(im).convert("RGB")
    # 1, L, CMYK, YCbCr, LAB, HSV ...
    return im.convert("RGB")


def load_rgb(source) -> Image.Image:
    """Open a path, bytes or file object and return a fully decoded RGB image."""
    name = source if isinstance(source, (str, os.PathLike)) else "<upload>"
    if isinstance(source, (bytes, bytearray)):
        source = io.BytesIO(source)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(source) as im:
                if im.width * im.height > MAX_PIXELS:
                    raise CorruptImageError(name, f"image too large ({im.width}x{im.height} pixels)")
                im.load()
                return to_rgb(im)
    except CorruptImageError:
        raise
    except FileNotFoundError:
        raise CorruptImageError(name, "file not found") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise CorruptImageError(name, f"refused as a decompression bomb ({e})") from None
    except UnidentifiedImageError:
        raise CorruptImageError(name, "not an image, or an unknown format") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise CorruptImageError(name, f"corrupt or truncated ({e})") from None
