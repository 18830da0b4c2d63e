"""The app's pictures: matplotlib figures (a metric's heatmap, the gallery's 2-D map), the star
that marks a query on a map, and thumbnails, read from the gallery's image on demand; an item
without an image file (a synthetic distractor has no path) gets a placeholder that says so."""
from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from core.errors import CorruptImageError
from core.images import load_rgb

NO_IMAGE, NOT_FOUND = "no image", "image not found"


def image_path(root: str, rel: str) -> Path | None:
    """Where an item's image is (None: it has none, as a synthetic distractor)."""
    if not rel:
        return None
    return Path(rel) if Path(rel).is_absolute() or not root else Path(root) / rel


def has_image(root: str, rel: str) -> bool:
    p = image_path(root, rel)
    return p is not None and p.is_file()


def thumbnail(root: str, rel: str, item_id: int, size: int) -> Image.Image:
    """The item's image scaled to fit size × size, or a grey placeholder naming the item and why
    there is no picture ("no image": the item has no image file; "image not found")."""
    p = image_path(root, rel)
    img = None
    if p is not None:
        try:
            img = load_rgb(p)
        except CorruptImageError:
            img = None
    if img is None:
        img = Image.new("RGB", (size, size), (230, 230, 230))
        draw = ImageDraw.Draw(img)
        draw.text((6, size // 2 - 14), NO_IMAGE if p is None else NOT_FOUND, fill=(90, 90, 90))
        draw.text((6, size // 2 + 2), f"id {item_id}", fill=(90, 90, 90))
        return img
    img.thumbnail((size, size))
    return img


def data_uri(img: Image.Image) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fig_to_pil(fig) -> Image.Image:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    _pyplot().close(fig)
    buf.seek(0)
    return Image.open(buf).convert("RGB")


def plot_matrix(M: np.ndarray, title: str, max_side: int = 256) -> Image.Image:
    """|M′| entries block-averaged down to at most max_side², on a symmetric colour scale."""
    d = M.shape[0]
    b = max(1, int(np.ceil(d / max_side)))
    pad = (-d) % b
    Mp = np.pad(M, ((0, pad), (0, pad)))
    small = Mp.reshape(Mp.shape[0] // b, b, Mp.shape[1] // b, b).mean(axis=(1, 3))
    plt = _pyplot()
    v = float(np.abs(small).max()) or 1.0
    fig, ax = plt.subplots(figsize=(4.2, 3.6))
    im = ax.imshow(small, cmap="RdBu_r", vmin=-v, vmax=v, interpolation="nearest")
    fig.colorbar(im, ax=ax, fraction=0.046)
    ax.set_title(f"{title}  (d = {d}{f', {b}×{b} blocks' if b > 1 else ''})", fontsize=8)
    ax.set_xticks([])
    ax.set_yticks([])
    fig.tight_layout()
    return fig_to_pil(fig)


def plot_map(xy, labels, title: str):
    """The gallery scatter as an image, and data (x, y) ↦ its pixel (x, y)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 4), dpi=90)  # the saved image's dpi: display pixels = image pixels
    _, codes = np.unique(labels, return_inverse=True)
    ax.scatter(xy[:, 0], xy[:, 1], c=codes % 20, cmap="tab20", s=4, alpha=0.6, linewidths=0)
    ax.set_title(title, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])
    fig.tight_layout()
    fig.canvas.draw()  # fixes the layout, so the transform below is the saved image's
    transform, height = ax.transData.transform, fig.get_figheight() * fig.dpi

    def to_pixel(p):
        dx, dy = transform((float(p[0]), float(p[1])))
        return dx, height - dy  # image rows run downwards
    return fig_to_pil(fig), to_pixel


def draw_star(img: Image.Image, x: float, y: float, r: float = 11.0) -> None:
    """A black five-pointed star with a yellow rim at pixel (x, y)."""
    pts = [(x + (r if i % 2 == 0 else r * 0.42) * np.sin(np.pi * i / 5),
            y - (r if i % 2 == 0 else r * 0.42) * np.cos(np.pi * i / 5)) for i in range(10)]
    ImageDraw.Draw(img).polygon(pts, fill=(0, 0, 0), outline=(255, 215, 0), width=2)
