"""Do the default training recipes improve on the frozen neck on an ImageFolder of the new user's
shape (about 1,900 classes, 4–7 small icon-like images each, 64 px)?

  python bench/recipe_imagefolder.py [--domain emoji|kanji] [--classes 1900] [--loss proxy_anchor]
                                     [--rows raw,frozen,tail-demo,tail-default,ft-default] [--seeds 0]
                                     [--epochs 4] [--data DIR] [--runs DIR] [--threads 2]
                                     [--out bench/results/recipe_imagefolder]

The user's own data set is not ours to have, so this builds one of the same shape from what
ships offline, as a plain ImageFolder (root/<class>/<image>.png) loaded through
`--dataset imagefolder` with every data default (so the split, resize mode and augmentations are
what a user of an ImageFolder gets):
  emoji  one class per glyph of Debian's fonts-noto-color-emoji (single code points, flags,
         keycaps and ZWJ sequences; skin-tone variants left out), 4–7 images each, varied the way
         photos of one icon vary: scale, offset, rotation, background colour or gradient,
         brightness, blur, noise, JPEG; where fonts-symbola has the code point, half the classes
         have one monochrome Symbola rendering among their images
  kanji  rendered kanji, each class a random 4–7 of the 23 fonts (a domain close to the demo's)
Rows (`--rows`), on the test classes (half of them, never seen in training):
  raw           efficientnet_lite0's ImageNet features, cosine, no training
  frozen        the frozen neck: the neck and loss on cached trunk features (the default mode)
  tail-demo     --train-blocks 2 --epochs 15 --probe-epochs 0: the demo's tail recipe without a probe
  tail-default  --train-blocks 2 --epochs 15: the same with every other default
  tail-probe, tail-lr01, tail-5ep, tail-probe-5ep, tail-probe-lr01: the diagnosis candidates (a
                30-epoch probe; no probe with a 10× lower trunk learning rate; no probe and 5 epochs;
                a probe then 5 epochs; a probe and the lower trunk learning rate)
  ft-noprobe    --mode finetune --probe-epochs 0
  ft-default    --mode finetune: a 30-epoch probe first, then the whole trunk
Results go to OUT/<domain>_<loss>.md and .json.
"""
from __future__ import annotations

import argparse
import io
import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
from common import ROOT, pm

from core.atomic import atomic_dir, write_json, write_text
from core.logs import setup_logging
from training.config import TrainConfig
from training.trainer import train_or_reuse

KEYS = ("map@r", "recall@1")
EMOJI_FONT = "/usr/share/fonts/truetype/noto/NotoColorEmoji.ttf"        # apt-get install fonts-noto-color-emoji
MONO_FONT = "/usr/share/fonts/truetype/ancient-scripts/Symbola_hint.ttf"  # apt-get install fonts-symbola

TAIL = dict(train_blocks=2, epochs=15)  # the tail rows' recipe: the demo's two stages (it trains them 6 epochs)
# key: (row name, the run's settings; "epochs" None means --epochs)
ROWS = {
    "frozen": ("frozen neck", dict(epochs=30)),
    "tail-demo": ("tail, no probe (--probe-epochs 0)", dict(TAIL, probe_epochs=0)),
    "tail-default": ("tail, default (--train-blocks 2 --epochs 15)", dict(TAIL)),
    "tail-probe": ("tail, probe 30 (--probe-epochs 30)", dict(TAIL, probe_epochs=30)),
    "tail-lr01": ("tail, no probe, --backbone-lr-mult 0.1", dict(TAIL, probe_epochs=0, backbone_lr_mult=0.1)),
    "tail-5ep": ("tail, no probe, 5 epochs", dict(TAIL, probe_epochs=0, epochs=5)),
    "tail-probe-5ep": ("tail, probe 30, 5 epochs", dict(TAIL, probe_epochs=30, epochs=5)),
    "tail-probe-lr01": ("tail, probe 30, --backbone-lr-mult 0.1", dict(TAIL, probe_epochs=30, backbone_lr_mult=0.1)),
    "ft-noprobe": ("fine-tune, no probe (--probe-epochs 0)", dict(mode="finetune", epochs=None, probe_epochs=0)),
    "ft-default": ("fine-tune, default (probe 30 epochs, then all stages)", dict(mode="finetune", epochs=None)),
}


# ------------------------------------------------------------------ kanji
def build_kanji_folder(dst: Path, classes: int, seed: int = 0) -> Path:
    """root/<codepoint>/<font>.png: `classes` kanji, a random 4–7 fonts each (rendered once)."""
    from data.kanji import KanjiConfig, prepare_kanji

    if (dst / "DONE").is_file():
        return dst
    src = prepare_kanji(KanjiConfig(root=str(ROOT / "cache" / "kanji"), num_classes=classes, image_size=64))
    rng = random.Random(seed)
    with atomic_dir(dst) as tmp:
        for d in sorted((src / "images").iterdir()):
            fonts = sorted(d.iterdir())
            (tmp / d.name).mkdir()
            for f in rng.sample(fonts, rng.randint(4, 7)):
                shutil.copyfile(f, tmp / d.name / f.name)
        (tmp / "DONE").write_text("")
    return dst


# ------------------------------------------------------------------ emoji
def emoji_classes(font_path: str = EMOJI_FONT) -> dict[str, str]:
    """{folder name: text} for every glyph the colour font draws for one emoji: single code points and
    the sequences its ligatures draw as one glyph (flags, keycaps, ZWJ), one text per glyph.  Skin-tone
    variants are left out: they are the same icon recoloured, not another one."""
    from fontTools.ttLib import TTFont

    font = TTFont(font_path)
    cmap = font.getBestCmap()
    glyph_cp: dict[str, int] = {}
    for cp, g in sorted(cmap.items()):
        glyph_cp.setdefault(g, cp)

    def component(c: int) -> bool:  # never an emoji alone: joiners, selectors, regional letters, tags, tones
        return (c <= 0x7F or c in (0x200D, 0x20E3, 0xFE0E, 0xFE0F) or 0x1F3FB <= c <= 0x1F3FF
                or 0x1F1E6 <= c <= 0x1F1FF or 0xE0000 <= c <= 0xE007F)

    out: dict[str, str] = {}
    for cp, g in sorted(cmap.items()):
        if not component(cp) and glyph_cp[g] == cp:
            out[f"{cp:04X}"] = chr(cp)
    seen: set[str] = set()
    for lookup in font["GSUB"].table.LookupList.Lookup:
        if lookup.LookupType != 4:  # ligatures
            continue
        for sub in lookup.SubTable:
            for first, ligs in sorted(sub.ligatures.items()):
                for lig in ligs:
                    seq = [glyph_cp.get(g) for g in [first, *lig.Component]]
                    if lig.LigGlyph in seen or None in seq or any(0x1F3FB <= c <= 0x1F3FF for c in seq):
                        continue
                    seen.add(lig.LigGlyph)  # the font draws some sequences in either order: one class
                    out["-".join(f"{c:04X}" for c in seq)] = "".join(map(chr, seq))
    return out


def _glyph(text: str, font, colour=None):
    """The glyph alone, cropped to its ink, as RGBA: the emoji in its own colours, or `colour`."""
    from PIL import Image, ImageDraw

    im = Image.new("RGBA", (320, 200), (0, 0, 0, 0))
    d = ImageDraw.Draw(im)
    if colour is None:
        d.text((10, 10), text, font=font, embedded_color=True)
    else:
        d.text((10, 10), text, font=font, fill=(*colour, 255))
    box = im.getchannel("A").getbbox()
    return im.crop(box) if box else None


def render_instance(glyph, rng: random.Random, size: int = 64):
    """One 'photo' of an icon: the glyph scaled, rotated and placed on a plain or gradient background,
    then brightness/contrast, blur, noise and JPEG, drawn at twice the size and reduced to `size`."""
    from PIL import Image, ImageEnhance, ImageFilter

    s = 2 * size
    c1 = tuple(rng.randint(225, 255) for _ in range(3)) if rng.random() < 0.4 else \
        tuple(rng.randint(0, 255) for _ in range(3))
    bg = Image.new("RGB", (s, s), c1)
    if rng.random() < 0.5:  # a linear gradient to a second colour
        c2 = np.array([rng.randint(0, 255) for _ in range(3)], np.float32)
        t = np.linspace(0, 1, s, dtype=np.float32)[:, None, None]
        g = (1 - t) * np.array(c1, np.float32) + t * c2
        g = np.broadcast_to(g, (s, s, 3)) if rng.random() < 0.5 else np.broadcast_to(g.transpose(1, 0, 2), (s, s, 3))
        bg = Image.fromarray(np.ascontiguousarray(g).astype(np.uint8))
    side = rng.uniform(0.5, 0.9) * s
    w, h = glyph.size
    k = side / max(w, h)
    gl = glyph.resize((max(1, round(w * k)), max(1, round(h * k))), Image.LANCZOS)
    gl = gl.rotate(rng.uniform(-15, 15), resample=Image.BICUBIC, expand=True)
    x = (s - gl.size[0]) / 2 + rng.uniform(-0.5, 0.5) * max(0, s - gl.size[0])
    y = (s - gl.size[1]) / 2 + rng.uniform(-0.5, 0.5) * max(0, s - gl.size[1])
    bg.paste(gl, (round(x), round(y)), gl)
    bg = ImageEnhance.Brightness(bg).enhance(rng.uniform(0.8, 1.2))
    bg = ImageEnhance.Contrast(bg).enhance(rng.uniform(0.8, 1.2))
    if rng.random() < 0.5:
        bg = bg.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.5)))
    im = bg.resize((size, size), Image.LANCZOS)
    if rng.random() < 0.5:
        a = np.asarray(im, np.float32)
        noise = np.random.default_rng(rng.getrandbits(32)).normal(0, rng.uniform(2, 8), a.shape)
        im = Image.fromarray(np.clip(a + noise, 0, 255).astype(np.uint8))
    if rng.random() < 0.3:
        buf = io.BytesIO()
        im.save(buf, format="JPEG", quality=rng.randint(40, 90))
        im = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    return im


def build_emoji_folder(dst: Path, classes: int, seed: int = 0) -> Path:
    """root/<code points>/<i>.png: `classes` emoji (all ~2,000 when 0 or more), 4–7 images each."""
    from fontTools.ttLib import TTFont
    from PIL import ImageFont

    if (dst / "DONE").is_file():
        return dst
    if not Path(EMOJI_FONT).is_file():
        raise SystemExit(f"{EMOJI_FONT} not found: apt-get install fonts-noto-color-emoji (and fonts-symbola)")
    names = emoji_classes()
    chosen = sorted(names) if not classes or classes >= len(names) else sorted(random.Random(seed).sample(
        sorted(names), classes))
    colour = ImageFont.truetype(EMOJI_FONT, 109, layout_engine=ImageFont.Layout.RAQM)  # its only bitmap size
    mono = ImageFont.truetype(MONO_FONT, 109) if Path(MONO_FONT).is_file() else None
    mono_cps = set(TTFont(MONO_FONT).getBestCmap()) if mono else set()
    with atomic_dir(dst) as tmp:
        for name in chosen:
            text = names[name]
            rng = random.Random(f"{seed}-{name}")
            n = rng.randint(4, 7)
            glyphs = [_glyph(text, colour)] * n
            if len(text) == 1 and ord(text) in mono_cps and rng.random() < 0.5:
                g = _glyph(text, mono, tuple(rng.randint(0, 80) for _ in range(3)))
                glyphs[-1] = g or glyphs[-1]
            if glyphs[0] is None:
                continue
            (tmp / name).mkdir()
            for i, g in enumerate(glyphs):
                render_instance(g, rng).save(tmp / name / f"{i}.png")
        (tmp / "DONE").write_text("")
    return dst


# ------------------------------------------------------------------ the rows
def raw_trunk(data_root: str, cache_dir: str) -> dict:
    """The demo's raw-trunk baseline (same feature cache), on this folder's test classes."""
    from data import DataConfig, load_data
    from data.config import resolve
    from demo.pipeline import pretrained_baselines

    dcfg = DataConfig(dataset="imagefolder", data_root=data_root)
    splits = load_data(dcfg, progress=False)
    baselines = pretrained_baselines(resolve(dcfg, splits), splits, cache_dir)
    return baselines["efficientnet_lite0 trunk, ImageNet, no training"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--domain", choices=("emoji", "kanji"), default="emoji", help="what the folder holds "
                                                                                  "(default: %(default)s)")
    ap.add_argument("--classes", type=int, default=1900, help="classes in the folder (default: %(default)s)")
    ap.add_argument("--rows", default="raw,frozen,tail-demo,tail-default,ft-default",
                    help=f"rows, comma-separated, of raw,{','.join(ROWS)} (default: %(default)s)")
    ap.add_argument("--epochs", type=int, default=4, help="fine-tuning epochs (default: %(default)s)")
    ap.add_argument("--seeds", default="0", help="training seeds (default: %(default)s)")
    ap.add_argument("--loss", default="proxy_anchor", help="metric loss (default: %(default)s)")
    ap.add_argument("--data", default="", help="where the folder is built "
                                               "(default: cache/imagefolder-<domain><classes>)")
    ap.add_argument("--runs", default="runs/bench-recipe-imagefolder", help="run folders, reused when finished "
                                                                             "(default: %(default)s)")
    ap.add_argument("--out", default="bench/results/recipe_imagefolder", help="results folder (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default) (default: %(default)s)")
    args = ap.parse_args()
    setup_logging()
    rows_wanted = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows_wanted if r != "raw" and r not in ROWS]
    if unknown:
        ap.error(f"unknown rows {unknown}; known: raw, {', '.join(ROWS)}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    data = Path(args.data or f"cache/imagefolder-{args.domain}{args.classes}")
    build = build_emoji_folder if args.domain == "emoji" else build_kanji_folder
    root = str(build(data, args.classes))
    n_classes = sum(1 for p in Path(root).iterdir() if p.is_dir())
    n_images = sum(1 for _ in Path(root).glob("*/*.png"))
    print(f"{root}: {n_classes} classes, {n_images} images", flush=True)
    cache = "cache/features"
    rows = []
    if "raw" in rows_wanted:
        rows.append({"model": "raw trunk (ImageNet, cosine)", "key": "raw", "epochs": 0, "val": [],
                     **{k: [v] for k, v in raw_trunk(root, cache).items() if k in KEYS}, "seconds": [0.0]})
    base = dict(dataset="imagefolder", data_root=root, loss=args.loss, progress=False, device="cpu", cache_dir=cache,
                threads=args.threads)
    for key in [r for r in rows_wanted if r != "raw"]:
        name, kw = ROWS[key]
        kw = {k: (args.epochs if k == "epochs" and v is None else v) for k, v in kw.items()}
        r = {"model": name, "key": key, "epochs": kw["epochs"], **{k: [] for k in KEYS}, "val": [], "seconds": [],
             "selected_epoch": []}
        for s in [int(v) for v in args.seeds.split(",")]:
            out = f"{args.runs}/{args.domain}-{args.loss}-{key}-s{s}"
            cfg = TrainConfig(out=out, seed=s, **base, **kw)
            m, _ = train_or_reuse(cfg)
            r["probe_epochs"] = cfg.resolved_probe_epochs()
            r["seconds"].append(m["train_seconds"])
            r["val"].append(m["val"]["map@r"])
            r["selected_epoch"].append(m["selected_epoch"])
            for k in KEYS:
                r[k].append(m["test"][k])
            log = [json.loads(x) for x in (Path(out) / "log.jsonl").read_text().splitlines()]
            r.setdefault("val_curve", []).append([round(h["val_map@r"] * 100, 2) for h in log])
            print(key, s, {k: round(r[k][-1] * 100, 2) for k in KEYS}, flush=True)
        rows.append(r)

    def fmt(v):  # one seed: its value alone
        return f"{v[0] * 100:.2f}" if len(v) == 1 else pm(v)

    import datetime
    import os

    lines = [f"{args.domain} ImageFolder: {n_classes} classes, {n_images} images, 64 px; loss {args.loss}; "
             f"seeds {args.seeds}; test classes, the model selected on validation; written "
             f"{datetime.date.today()} on {os.cpu_count()} CPU cores by",
             f"`python bench/recipe_imagefolder.py {' '.join(sys.argv[1:])}` "
             "(train s/run: as timed in the run, probe included, while other jobs shared the cores)",
             "",
             "| model | epochs | probe | val MAP@R | test MAP@R | test R@1 | selected epoch | "
             "val MAP@R per epoch (0: probe) | train s/run |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        curve = "; ".join(", ".join(map(str, c)) for c in r.get("val_curve", [])) if r["key"] != "frozen" else ""
        sel = ", ".join(map(str, r.get("selected_epoch", [])))
        lines.append(f"| {r['model']} | {r['epochs']} | {r.get('probe_epochs', '')} | {fmt(r['val'])} | "
                     f"{fmt(r['map@r'])} | {fmt(r['recall@1'])} | {sel} | {curve} | {np.mean(r['seconds']):.0f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / f"{args.domain}_{args.loss}.md", "\n".join(lines) + "\n")
    write_json(out / f"{args.domain}_{args.loss}.json", rows)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
