"""The offline default data set: kanji rendered from Debian CJK font packages.

Class = character, instance = font.  Only characters that every font maps in
its cmap *and* that render with visible ink in every font qualify (some fonts
map code points to empty glyphs).  Each glyph is rendered large, cropped to
its ink, padded to a square with a margin and resized, so scale and centring
are the same across fonts and only the style varies.

The rendered set is cached under `root/<key>/` (PNG files + manifest.json);
the key covers the font files' checksums, the class count, image size and seed.
`render_distractors` draws jittered characters of none of the data set's classes, in its fonts
(the large-gallery benchmark's distractors: docs/scale-out.md).
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
from core.memory import CACHE

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
    """The CJK code points a font maps.  Decoding a font's cmap takes a quarter of a second, and every
    data set rendered in a process asks again: kept in the memory cache under the file's digest."""

    def read() -> np.ndarray:  # every code point the font maps: the range is applied below
        from fontTools.ttLib import TTFont

        font = TTFont(str(path), fontNumber=0, lazy=True)
        try:
            return np.array(sorted(font.getBestCmap()), dtype=np.int64)
        finally:
            font.close()
    cmap = CACHE.get_or_build(("font-cmap", sha256_file(path)), read)
    return {c for c in cmap.tolist() if c in CJK_RANGE}


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
    candidates = _qualifying_order(fonts, cfg.seed)
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


def _qualifying_order(fonts, seed: int) -> list[int]:
    """Every code point all fonts map, in the seeded order prepare_kanji draws classes from."""
    common: set[int] | None = None
    for _, _, p, _ in fonts:
        cps = covered_codepoints(p)
        common = cps if common is None else common & cps
    candidates = sorted(common or ())
    random.Random(seed).shuffle(candidates)
    return candidates


def jitter(glyph: np.ndarray, rng: np.random.Generator, shift: float = 0.05, scale: float = 0.1,
           degrees: float = 8.0) -> np.ndarray:
    """A random similarity transform of a rendered glyph about its centre (white fill): a shift of
    up to `shift` of the side, a scale within 1 ± `scale`, a rotation within ± `degrees`."""
    side = glyph.shape[0]
    t = rng.uniform(-shift, shift, 2) * side
    s = rng.uniform(1 - scale, 1 + scale)
    a = np.deg2rad(rng.uniform(-degrees, degrees))
    c = (side - 1) / 2
    # PIL's AFFINE maps each output pixel back to its input: p_in = c + R(−a)(p_out − c − t) / s
    cos, sin = np.cos(a) / s, np.sin(a) / s
    ox, oy = c + t[0], c + t[1]
    data = (cos, sin, c - cos * ox - sin * oy, -sin, cos, c + sin * ox - cos * oy)
    im = Image.fromarray(glyph, mode="L").transform((side, side), Image.Transform.AFFINE, data,
                                                    resample=Image.Resampling.BILINEAR, fillcolor=255)
    return np.asarray(im)


def render_distractors(cfg: KanjiConfig, count: int, copies: int = 2, seed: int = 0):
    """Yield `count` distractor images (codepoint, font id, copy, H × W uint8) of the data set `cfg`:
    characters every font maps and inks but none of the data set's classes (train, validation or
    test), in its fonts, each rendered `copies` times with its own jitter (seeded by `seed`, the
    character, the font and the copy).  Characters come in the data set's own seeded order after
    its classes; each yields all its fonts and copies before the next."""
    if count < 0 or copies < 1:
        raise UserError(f"distractors need count ≥ 0 and copies ≥ 1, not {count} and {copies}")
    classes = set(json.loads((prepare_kanji(cfg, progress=False) / "manifest.json").read_text())["codepoints"])
    fonts = find_fonts(tuple(cfg.fonts))
    canvas = max(128, 2 * cfg.image_size)
    faces = [ImageFont.truetype(str(p), int(canvas * 0.7), index=0) for _, _, p, _ in fonts]
    made = 0
    for cp in _qualifying_order(fonts, cfg.seed):
        if made >= count:
            return
        if cp in classes:
            continue
        glyphs = [render_glyph(f, chr(cp), cfg.image_size, canvas) for f in faces]
        if any(g is None for g in glyphs):
            continue
        for fi, ((fid, _, _, _), g) in enumerate(zip(fonts, glyphs, strict=True)):
            for c in range(copies):
                if made >= count:
                    return
                assert g is not None
                yield cp, fid, c, jitter(g, np.random.default_rng([seed, cp, fi, c]))
                made += 1
    if made < count:
        raise UserError(f"only {made:,} distractors exist in these fonts with {copies} copies each; "
                        f"asked for {count:,} (more copies make more)")


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
