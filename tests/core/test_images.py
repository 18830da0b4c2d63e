"""Every image mode becomes RGB; broken files fail with an error naming the file."""
import io

import numpy as np
import pytest
from PIL import Image

from core.errors import CorruptImageError
from core.images import load_rgb


def _save(tmp_path, im, name, **kw):
    p = tmp_path / name
    im.save(p, **kw)
    return p


@pytest.mark.parametrize("mode", ["L", "1", "RGBA", "LA", "CMYK", "I;16", "I", "F", "P"])
def test_modes_become_rgb(tmp_path, mode):
    im = Image.new("RGB", (20, 10), (200, 30, 30)).convert(mode)
    fmt = "TIFF" if mode in ("I;16", "I", "F", "CMYK", "LA") else "PNG"
    p = _save(tmp_path, im, f"x.{fmt.lower()}", format=fmt)
    out = load_rgb(p)
    assert out.mode == "RGB" and out.size == (20, 10)


def test_sixteen_bit_keeps_scale(tmp_path):
    a = np.full((4, 4), 65535, np.uint16)
    a[0, 0] = 0
    p = _save(tmp_path, Image.fromarray(a), "w.png")
    out = np.asarray(load_rgb(p))
    assert out[1, 1, 0] == 255 and out[0, 0, 0] == 0


def test_rgba_and_palette_transparency_composite_on_white(tmp_path):
    im = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    out = np.asarray(load_rgb(_save(tmp_path, im, "t.png")))
    assert (out == 255).all()
    pal = Image.new("P", (4, 4), 0)
    pal.putpalette([0, 0, 0] * 256)
    pal.info["transparency"] = 0
    out = np.asarray(load_rgb(_save(tmp_path, pal, "p.png", transparency=0)))
    assert (out == 255).all()


def test_exif_orientation_is_applied(tmp_path):
    im = Image.new("RGB", (30, 10), (10, 200, 10))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° when displayed
    p = _save(tmp_path, im, "r.jpg", exif=exif.tobytes())
    assert load_rgb(p).size == (10, 30)


def test_bytes_and_file_objects(tmp_path):
    buf = io.BytesIO()
    Image.new("L", (5, 5)).save(buf, format="PNG")
    assert load_rgb(buf.getvalue()).mode == "RGB"
    buf.seek(0)
    assert load_rgb(buf).mode == "RGB"


def test_corrupt_truncated_empty_and_bomb(tmp_path, monkeypatch):
    (tmp_path / "a.jpg").write_bytes(b"this is not an image")
    with pytest.raises(CorruptImageError, match="a.jpg"):
        load_rgb(tmp_path / "a.jpg")
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(CorruptImageError, match="empty.png"):
        load_rgb(tmp_path / "empty.png")
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
    (tmp_path / "trunc.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    with pytest.raises(CorruptImageError, match="trunc.png"):
        load_rgb(tmp_path / "trunc.png")
    with pytest.raises(CorruptImageError, match="not found"):
        load_rgb(tmp_path / "missing.png")
    import core.images as ci
    monkeypatch.setattr(ci, "MAX_PIXELS", 100)
    p = _save(tmp_path, Image.new("RGB", (20, 20)), "big.png")
    with pytest.raises(CorruptImageError, match="too large"):
        load_rgb(p)


def test_pillow_decompression_bomb_limit_is_an_error(tmp_path, monkeypatch):
    p = _save(tmp_path, Image.new("RGB", (40, 40)), "bomb.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)  # 1600 px > 2×500: Pillow raises
    with pytest.raises(CorruptImageError, match="decompression bomb"):
        load_rgb(p)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # between 1× and 2×: Pillow only warns
    with pytest.raises(CorruptImageError, match="decompression bomb"):
        load_rgb(p)
