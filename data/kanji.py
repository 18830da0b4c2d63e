"""The offline default data set: kanji rendered from Debian CJK font packages.

Class = character, instance = font.  Only characters that every font maps in
its cmap *and* that render with visible ink in every font qualify (some fonts
map code points to empty glyphs).  Each glyph is rendered large, cropped to
its ink, padded to a square with a margin and resized, so scale and centring
are the same across fonts and only the style varies.

The rendered set is cached under `root/<key>/` (PNG files + manifest.json);
the key covers the font files' checksums, the class count, image size and seed.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont
from tqdm import tqdm

from core.atomic import atomic_dir, write_json
from core.errors import UserError
from core.hashing import sha256_file

from .registry import DATASETS
from .splits import DatasetSplits, Subset, carve_validation

RENDER_VERSION = 1
CJK_RANGE = range(0x4E00, 0xA000)  # CJK Unified Ideographs

# (font id, Debian package, file name, style).  One file per distinct face:
# proportional twins (ipagp, VL-PGothic, ...) draw identical kanji and are left out.
FONTS: list[tuple[str, str, str, str]] = [
    ("ipag", "fonts-ipafont-gothic", "ipag.ttf", "gothic"),
    ("ipam", "fonts-ipafont-mincho", "ipam.ttf", "mincho"),
    ("vlgothic", "fonts-vlgothic", "VL-Gothic-Regular.ttf", "gothic"),
    ("seto", "fonts-seto", "setofont.ttf", "handwriting"),
    ("kiloji", "fonts-kiloji", "kiloji.ttf", "handwriting"),
    ("aoyagi-kouzan", "fonts-aoyagi-kouzan-t", "AoyagiKouzanT.ttf", "brush"),
    ("aoyagi-soseki", "fonts-aoyagi-soseki", "aoyagi-soseki.ttf", "brush"),
    ("kouzan-sousyo", "fonts-kouzan-mouhitsu", "KouzanBrushFontSousyo.ttf", "cursive brush"),
    ("kouzan-gyosho", "fonts-kouzan-mouhitsu", "kouzan-mouhitsu-gyosho.ttf", "cursive brush"),
    ("kouzan-mouhitsu", "fonts-kouzan-mouhitsu", "kouzan-mouhitsu.ttf", "brush"),
    ("ume-gothic", "fonts-horai-umefont", "ume-tgo4.ttf", "gothic"),
    ("ume-mincho", "fonts-horai-umefont", "ume-tmo3.ttf", "mincho"),
    ("motoya-cedar", "fonts-motoya-l-cedar", "MTLc3m.ttf", "gothic"),
    ("motoya-maruberi", "fonts-motoya-l-maruberi", "MTLmr3m.ttf", "rounded gothic"),
    ("sawarabi-gothic", "fonts-sawarabi-gothic", "sawarabi-gothic-medium.ttf", "gothic"),
    ("sawarabi-mincho", "fonts-sawarabi-mincho", "sawarabi-mincho-medium.ttf", "mincho"),
    ("konatu", "fonts-konatu", "Konatu.ttf", "handwriting"),
    ("monapo", "fonts-monapo", "monapo.ttf", "gothic"),
    ("dejima-mincho", "fonts-dejima-mincho", "dejima-mincho-r227.ttf", "mincho"),
    ("wqy-microhei", "fonts-wqy-microhei", "wqy-microhei.ttc", "gothic"),
    ("wqy-zenhei", "fonts-wqy-zenhei", "wqy-zenhei.ttc", "gothic"),
    ("ukai", "fonts-arphic-ukai", "ukai.ttc", "brush (kai)"),
    ("uming", "fonts-arphic-uming", "uming.ttc", "mincho (ming)"),
]


@dataclass
class KanjiConfig:
    root: str = "cache/kanji"  # rendered once; not a data/ folder (that name is the package)
    num_classes: int = 500        # 0 = every qualifying character (~3,300)
    image_size: int = 64
    seed: int = 0
    val_fraction: float = 0.2     # of the train classes
    fonts: tuple[str, ...] = ()   # font ids to use; () = all of FONTS


def font_dirs() -> list[Path]:
    env = os.environ.get("KANJI_FONT_DIRS")
    return [Path(p) for p in env.split(os.pathsep)] if env else [Path("/usr/share/fonts")]


def find_fonts(ids: tuple[str, ...] = ()) -> list[tuple[str, str, Path, str]]:
    """Locate the font files; a missing one names its package and the install command."""
    wanted = [f for f in FONTS if not ids or f[0] in ids]
    unknown = set(ids) - {f[0] for f in FONTS}
    if unknown:
        raise UserError(f"unknown kanji font ids {sorted(unknown)}; known: {[f[0] for f in FONTS]}")
    index: dict[str, Path] = {}
    for d in font_dirs():
        if d.is_dir():
            for p in d.rglob("*"):
                index.setdefault(p.name, p)
    found, missing = [], []
    for fid, pkg, fname, style in wanted:
        if fname in index:
            found.append((fid, pkg, index[fname], style))
        else:
            missing.append(pkg)
    if missing:
        pkgs = " ".join(sorted(set(missing)))
        raise UserError(
            f"kanji fonts missing: package(s) {pkgs} not installed. "
            f"Install with: apt-get install -y {pkgs}  (or run `make setup` as root)")
    return found


def covered_codepoints(path: Path) -> set[int]:
    from fontTools.ttLib import TTFont

    font = TTFont(str(path), fontNumber=0, lazy=True)
    try:
        return {c for c in font.getBestCmap() if c in CJK_RANGE}
    finally:
        font.close()


def render_glyph(font: ImageFont.FreeTypeFont, ch: str, size: int, canvas: int) -> np.ndarray | None:
    """Black ink on white, cropped to the ink and padded square; None if (nearly) blank."""
    im = Image.new("L", (canvas, canvas), 0)
    ImageDraw.Draw(im).text((canvas // 2, canvas // 2), ch, font=font, fill=255, anchor="mm")
    a = np.asarray(im)
    ink = a > 64
    if ink.sum() < max(8, canvas * canvas // 2000):
        return None
    ys, xs = np.nonzero(ink)
    crop = a[ys.min(): ys.max() + 1, xs.min(): xs.max() + 1]
    side = int(max(crop.shape) * 1.15) + 2  # ~7% margin on each side
    sq = np.zeros((side, side), np.uint8)
    y0, x0 = (side - crop.shape[0]) // 2, (side - crop.shape[1]) // 2
    sq[y0: y0 + crop.shape[0], x0: x0 + crop.shape[1]] = crop
    out = Image.fromarray(255 - sq).resize((size, size), Image.Resampling.LANCZOS)
    return np.asarray(out)


def _key(cfg: KanjiConfig, fonts) -> str:
    h = hashlib.sha256(json.dumps({
        "v": RENDER_VERSION, "n": cfg.num_classes, "size": cfg.image_size, "seed": cfg.seed,
        "fonts": [(fid, sha256_file(p)) for fid, _, p, _ in fonts],
    }, sort_keys=True).encode())
    return h.hexdigest()[:12]


def prepare_kanji(cfg: KanjiConfig, progress: bool = True) -> Path:
    """Render (or reuse) the data set; returns its directory."""
    fonts = find_fonts(tuple(cfg.fonts))
    out = Path(cfg.root) / f"{cfg.image_size}px-{cfg.num_classes or 'all'}c-s{cfg.seed}-{_key(cfg, fonts)}"
    if (out / "manifest.json").is_file():
        return out
    t0 = time.time()
    common: set[int] | None = None
    for _, _, p, _ in fonts:
        cps = covered_codepoints(p)
        common = cps if common is None else common & cps
    candidates = sorted(common or ())
    random.Random(cfg.seed).shuffle(candidates)
    canvas = max(128, 2 * cfg.image_size)
    faces = [ImageFont.truetype(str(p), int(canvas * 0.7), index=0) for _, _, p, _ in fonts]

    want = cfg.num_classes or len(candidates)
    chosen: list[int] = []
    n_blank = 0
    h = hashlib.sha256()
    with atomic_dir(out) as tmp:
        bar = tqdm(total=want, desc="render kanji", unit="class", disable=not progress)
        for cp in candidates:
            if len(chosen) >= want:
                break
            glyphs = [render_glyph(f, chr(cp), cfg.image_size, canvas) for f in faces]
            if any(g is None for g in glyphs):
                n_blank += 1
                continue
            d = tmp / "images" / f"{cp:05X}"
            d.mkdir(parents=True)
            for (fid, _, _, _), g in zip(fonts, (g for g in glyphs if g is not None), strict=True):
                Image.fromarray(g, mode="L").save(d / f"{fid}.png", optimize=False)
                h.update(g.tobytes())
            chosen.append(cp)
            bar.update(1)
        bar.close()
        if cfg.num_classes and len(chosen) < want:
            raise UserError(f"only {len(chosen)} characters qualify in these fonts; asked for {want}")
        if len(chosen) < 4:
            raise UserError("kanji needs at least 4 classes (train, validation and test classes)")
        manifest = {
            "dataset": "kanji", "render_version": RENDER_VERSION,
            "config": asdict(cfg) | {"fonts": list(cfg.fonts)},
            "fonts": [{"id": fid, "package": pkg, "file": str(p), "style": st, "sha256": sha256_file(p)}
                      for fid, pkg, p, st in fonts],
            "characters": [chr(c) for c in chosen],
            "codepoints": chosen,
            "candidates_covered_by_all_fonts": len(candidates),
            "rejected_blank_in_some_font": n_blank,
            "qualifying_scanned_all": not cfg.num_classes,
            "image_size": cfg.image_size, "seed": cfg.seed,
            "images": len(chosen) * len(fonts),
            "checksum_sha256": h.hexdigest(),
            "render_seconds": round(time.time() - t0, 2),
        }
        write_json(tmp / "manifest.json", manifest)
    return out


def load_kanji(cfg: KanjiConfig, progress: bool = True) -> DatasetSplits:
    d = prepare_kanji(cfg, progress=progress)
    man = json.loads((d / "manifest.json").read_text())
    cps: list[int] = list(man["codepoints"])
    font_ids = [f["id"] for f in man["fonts"]]
    # Class split is deterministic from the seed: half test, the other half train(+val).
    order = sorted(cps)
    random.Random(cfg.seed + 1).shuffle(order)
    n_test = len(order) // 2
    test_cl, trainval = sorted(order[:n_test]), order[n_test:]
    train_cl, val_cl = carve_validation(trainval, cfg.val_fraction, cfg.seed)
    root = d / "images"

    def subset(name, classes):
        paths = [f"{cp:05X}/{fid}.png" for cp in classes for fid in font_ids]
        labels = [cp for cp in classes for _ in font_ids]
        return Subset(name, root, paths, labels)

    return DatasetSplits(
        name="kanji", root=root,
        train=subset("train", train_cl), val=subset("val", val_cl), test=subset("test", test_cl),
        class_names={cp: chr(cp) for cp in cps},
        info={"manifest": str(d / "manifest.json"), "fonts": font_ids,
              "render_seconds": man["render_seconds"], "checksum": man["checksum_sha256"]},
    )


@DATASETS.register("kanji", doc="kanji glyphs rendered offline from 23 Debian CJK fonts (class = character)",
                   image_size=64, resize_mode="resize", renders=True, flip=False)  # a mirrored glyph is no kanji
def _kanji(cfg, progress: bool = True) -> DatasetSplits:
    kc = KanjiConfig(root=cfg.data_root or KanjiConfig.root, num_classes=cfg.num_classes,
                     image_size=cfg.resolved_image_size(), seed=cfg.data_seed, val_fraction=cfg.val_fraction,
                     fonts=tuple(cfg.kanji_fonts))
    return load_kanji(kc, progress=progress)
