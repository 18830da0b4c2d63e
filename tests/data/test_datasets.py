"""Data-set loaders on tiny synthetic trees in their exact official layouts."""
import dataclasses
import json

import numpy as np
import pytest
from PIL import Image

from core.errors import DatasetLayoutError, UserError
from data import DataConfig, load_data
from data.splits import carve_validation


def load_dataset(name, root, val_fraction=0.2, seed=0):
    return load_data(DataConfig(dataset=name, data_root=None if root is None else str(root),
                                val_fraction=val_fraction, data_seed=seed), progress=False)


def _img(path, color=(0, 0, 0)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), color).save(path)


def _disjoint(splits):
    sets = {k: set(s.classes) for k, s in splits.subsets().items() if k not in ("query", "gallery")}
    names = list(sets)
    for i in range(len(names)):
        for j in range(i + 1, len(names)):
            assert not sets[names[i]] & sets[names[j]], (names[i], names[j])


def make_cub(root, per_class=2):
    root = root / "CUB_200_2011"
    lines, labels, classes = [], [], []
    n = 0
    for c in range(1, 201):
        classes.append(f"{c} {c:03d}.Bird_{c}")
        for k in range(per_class):
            n += 1
            rel = f"{c:03d}.Bird_{c}/img_{k}.jpg"
            _img(root / "images" / rel)
            lines.append(f"{n} {rel}")
            labels.append(f"{n} {c}")
    (root / "images.txt").write_text("\n".join(lines) + "\n")
    (root / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    (root / "classes.txt").write_text("\n".join(classes) + "\n")
    return root.parent


def test_cub_standard_split(tmp_path):
    s = load_dataset("cub", make_cub(tmp_path), val_fraction=0.2, seed=0)
    assert s.test.classes == list(range(101, 201))
    assert len(s.train.classes) + len(s.val.classes) == 100 and len(s.val.classes) == 20
    assert max(s.train.classes + s.val.classes) == 100
    assert s.train.abspath(0).is_file()
    _disjoint(s)


def test_cub_missing_file_names_it(tmp_path):
    root = make_cub(tmp_path)
    (root / "CUB_200_2011" / "image_class_labels.txt").unlink()
    with pytest.raises(DatasetLayoutError, match="image_class_labels.txt"):
        load_dataset("cub", root)
    with pytest.raises(DatasetLayoutError, match="not found"):
        load_dataset("cub", tmp_path / "nope")


def make_cars(root):
    from scipy.io import savemat

    ann = np.zeros((196 * 2,), dtype=[("relative_im_path", "O"), ("class", "O"), ("test", "O")])
    for i in range(196 * 2):
        c = i // 2 + 1
        rel = f"car_ims/{i + 1:06d}.jpg"
        _img(root / rel)
        ann[i] = (rel, c, i % 2)
    savemat(root / "cars_annos.mat", {"annotations": ann.reshape(1, -1),
                                      "class_names": np.array([f"car {c}" for c in range(1, 197)], dtype=object)})
    return root


def test_cars_standard_split(tmp_path):
    s = load_dataset("cars", make_cars(tmp_path), val_fraction=0.0)
    assert s.train.classes == list(range(1, 99)) and s.test.classes == list(range(99, 197))
    assert len(s.test) == 196 and s.class_names[1] == "car 1"
    assert s.test.abspath(0).is_file()


def test_cars_missing_images_folder(tmp_path):
    make_cars(tmp_path)
    import shutil
    shutil.rmtree(tmp_path / "car_ims")
    with pytest.raises(DatasetLayoutError, match="car_ims"):
        load_dataset("cars", tmp_path)


def make_sop(root, n_train=11318, n_test=11316):
    root = root / "Stanford_Online_Products"
    root.mkdir(parents=True)
    # only a handful of real files: loaders read the lists, not every image
    tr = ["image_id class_id super_class_id path"]
    te = ["image_id class_id super_class_id path"]
    i = 0
    for c in range(1, n_train + 1):
        i += 1
        tr.append(f"{i} {c} 1 bicycle_final/{c}_0.JPG")
    for c in range(n_train + 1, n_train + n_test + 1):
        i += 1
        te.append(f"{i} {c} 2 chair_final/{c}_0.JPG")
    (root / "Ebay_train.txt").write_text("\n".join(tr) + "\n")
    (root / "Ebay_test.txt").write_text("\n".join(te) + "\n")
    return root.parent


def test_sop_standard_split(tmp_path):
    s = load_dataset("sop", make_sop(tmp_path))
    assert len(s.test.classes) == 11316 and len(s.train.classes) + len(s.val.classes) == 11318
    assert s.test.classes[0] == 11319
    _disjoint(s)


def test_sop_missing_list(tmp_path):
    root = make_sop(tmp_path, 3, 3)
    (root / "Stanford_Online_Products" / "Ebay_test.txt").unlink()
    with pytest.raises(DatasetLayoutError, match="Ebay_test.txt"):
        load_dataset("sop", root)


def make_inshop(root):
    rows = []
    for item in range(12):
        status = "train" if item < 6 else None
        for k in range(3):
            rel = f"img/WOMEN/Dresses/id_{item:08d}/{k:02d}_1_front.jpg"
            _img(root / rel)
            st = status or ("query" if k == 0 else "gallery")
            rows.append(f"{rel} id_{item:08d} {st}")
    (root / "list_eval_partition.txt").write_text(f"{len(rows)}\nimage_name item_id evaluation_status\n"
                                                  + "\n".join(rows) + "\n")
    return root


def test_inshop_query_gallery(tmp_path):
    s = load_dataset("inshop", make_inshop(tmp_path), val_fraction=0.34)
    assert s.test is None and len(s.query) == 6 and len(s.gallery) == 12
    assert set(s.query.classes) == set(s.gallery.classes)
    assert len(s.train.classes) == 4 and len(s.val.classes) == 2
    q, g = s.eval_pair("test")
    assert q.name == "query" and g.name == "gallery"
    assert q.abspath(0).is_file()


def test_inshop_bad_status(tmp_path):
    make_inshop(tmp_path)
    p = tmp_path / "list_eval_partition.txt"
    p.write_text(p.read_text().replace(" train\n", " weird\n", 1))
    with pytest.raises(DatasetLayoutError, match="unexpected row"):
        load_dataset("inshop", tmp_path)


def test_imagefolder_class_disjoint(tmp_path):
    for c in range(10):
        for k in range(3):
            _img(tmp_path / f"class_{c}" / f"{k}.png")
    s = load_dataset("imagefolder", tmp_path, val_fraction=0.25, seed=3)
    _disjoint(s)
    assert sum(len(x.classes) for x in s.subsets().values()) == 10
    s2 = load_dataset("imagefolder", tmp_path, val_fraction=0.25, seed=3)
    assert s2.test.classes == s.test.classes  # deterministic from the seed


def test_imagefolder_errors(tmp_path):
    with pytest.raises(DatasetLayoutError, match="no class sub-folders"):
        load_dataset("imagefolder", tmp_path)
    with pytest.raises(UserError, match="data-root"):
        load_dataset("cub", None)
    with pytest.raises(UserError, match="unknown data set"):
        load_dataset("mnist", tmp_path)


def test_carve_validation_is_deterministic_and_disjoint():
    a = carve_validation(list(range(50)), 0.2, 7)
    assert a == carve_validation(list(range(50)), 0.2, 7)
    assert a != carve_validation(list(range(50)), 0.2, 8)
    assert not set(a[0]) & set(a[1]) and len(a[1]) == 10


# ------------------------------------------------------------------ kanji
KANJI_FONTS = ("ipag", "ipam", "seto", "kouzan-sousyo")


def test_kanji_renders_cached_manifest_and_split(tmp_path):
    from data.kanji import KanjiConfig, load_kanji

    cfg = KanjiConfig(root=str(tmp_path), num_classes=12, image_size=32, seed=1, fonts=KANJI_FONTS)
    s = load_kanji(cfg, progress=False)
    man = json.loads(open(s.info["manifest"]).read())
    assert man["images"] == 12 * 4 and len(man["characters"]) == 12
    assert [f["id"] for f in man["fonts"]] == list(KANJI_FONTS)
    assert man["candidates_covered_by_all_fonts"] > 1000
    assert len(s.test.classes) == 6 and len(s.train.classes) + len(s.val.classes) == 6
    _disjoint(s)
    im = Image.open(s.test.abspath(0))
    assert im.size == (32, 32)
    a = np.asarray(im)
    assert a.min() < 100 and a.max() > 200  # ink on white, not blank
    assert s.class_names[s.test.labels[0]] in man["characters"]
    # same config -> same cached set, same split; other seed -> other characters
    s2 = load_kanji(cfg, progress=False)
    assert s2.test.classes == s.test.classes and s2.info["checksum"] == s.info["checksum"]
    s3 = load_kanji(KanjiConfig(root=str(tmp_path), num_classes=12, image_size=32, seed=2,
                                fonts=KANJI_FONTS), progress=False)
    assert set(s3.class_names) != set(s.class_names)


def test_kanji_all_qualifying_characters(tmp_path, monkeypatch):
    from data import kanji
    from data.kanji import KanjiConfig, load_kanji

    monkeypatch.setattr(kanji, "CJK_RANGE", range(0x4E00, 0x5200))  # a slice of the block: fast

    # two fonts, every covered character (num_classes=0): blank glyphs are dropped, not an error
    s = load_kanji(KanjiConfig(root=str(tmp_path), num_classes=0, image_size=16, fonts=("ipag", "kouzan-sousyo")),
                   progress=False)
    man = json.loads(open(s.info["manifest"]).read())
    assert man["qualifying_scanned_all"] and len(man["characters"]) + man["rejected_blank_in_some_font"] == \
        man["candidates_covered_by_all_fonts"]
    assert man["rejected_blank_in_some_font"] > 0  # the brush font maps some code points to empty glyphs


def test_kanji_missing_font_names_package(tmp_path, monkeypatch):
    from data.kanji import KanjiConfig, load_kanji

    monkeypatch.setenv("KANJI_FONT_DIRS", str(tmp_path))
    with pytest.raises(UserError, match=r"fonts-ipafont-gothic.*apt-get install"):
        load_kanji(KanjiConfig(root=str(tmp_path / "k"), num_classes=4, fonts=("ipag",)), progress=False)


def test_kanji_interrupted_render_leaves_no_manifest(tmp_path, monkeypatch):
    from data import kanji

    calls = {"n": 0}
    real = kanji.render_glyph

    def boom(*a, **k):
        calls["n"] += 1
        if calls["n"] > 10:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(kanji, "render_glyph", boom)
    cfg = kanji.KanjiConfig(root=str(tmp_path), num_classes=8, image_size=32, fonts=KANJI_FONTS)
    with pytest.raises(KeyboardInterrupt):
        kanji.load_kanji(cfg, progress=False)
    assert list(tmp_path.iterdir()) == []  # no half-rendered set, not even a temp dir
    monkeypatch.setattr(kanji, "render_glyph", real)
    s = kanji.load_kanji(cfg, progress=False)  # a later run renders cleanly
    assert len(s.test) == 4 * 4


def test_image_folder_size_follows_small_images(tmp_path):
    from data.config import resolve

    for c in range(4):
        (tmp_path / f"c{c}").mkdir()
        for j in range(2):
            Image.new("RGB", (48 + 8 * j, 40), (c * 40, 0, 0)).save(tmp_path / f"c{c}" / f"{j}.png")
    cfg = DataConfig(dataset="imagefolder", data_root=str(tmp_path))
    r = resolve(cfg, load_data(cfg, progress=False))
    assert (r.image_size, r.resize_mode) == (56, "crop")  # the largest side, not 224
    assert resolve(dataclasses.replace(cfg, image_size=32), load_data(cfg, progress=False)).image_size == 32
    Image.new("RGB", (300, 20)).save(tmp_path / "c0" / "big.png")
    assert resolve(cfg, load_data(cfg, progress=False)).image_size == 224  # one large image: the default
    kanji = DataConfig(dataset="kanji")
    assert (kanji.resolved_image_size(), kanji.resolved_resize_mode()) == (64, "resize")


@pytest.mark.parametrize("field, value, message", [
    ("num_classes", -1, "--num-classes must be ≥ 0"), ("image_size", 8, "--image-size must be 0"),
    ("val_fraction", 1.0, r"--val-fraction must be in \[0, 1\)"), ("eval_batch_size", 0, "--eval-batch-size"),
    ("workers", -2, "--workers must be ≥ 0"), ("dataset", "mnist", "unknown data set 'mnist'"),
])
def test_data_config_is_validated_before_anything_is_read(tmp_path, field, value, message):
    cfg = dataclasses.replace(DataConfig(dataset="imagefolder", data_root=str(tmp_path / "none")), **{field: value})
    with pytest.raises(UserError, match=message):
        load_data(cfg)


def test_a_folder_of_only_corrupt_images_is_refused_clearly(tmp_path):
    from model.backbones import build_backbone
    from model.features import embed_subset
    from model.preprocess import transform_for

    for c in range(4):
        (tmp_path / f"c{c}").mkdir()
        for j in range(2):
            (tmp_path / f"c{c}" / f"{j}.jpg").write_bytes(b"garbage")
    cfg = DataConfig(dataset="imagefolder", data_root=str(tmp_path), image_size=32)
    splits = load_data(cfg, progress=False)
    bb = build_backbone("small_cnn", "none")
    with pytest.raises(UserError, match=r"no readable images in .* \(test split: all 4 failed to load, e.g. cannot"):
        embed_subset(bb.eval(), splits.test, transform_for(bb, cfg), cfg, "x", progress=False)


def test_kanji_distractors_exclude_classes_seeded_jittered(tmp_path):
    from data.kanji import KanjiConfig, jitter, load_kanji, render_distractors

    cfg = KanjiConfig(root=str(tmp_path), num_classes=12, image_size=32, seed=1, fonts=KANJI_FONTS)
    classes = set(load_kanji(cfg, progress=False).class_names)  # train, validation and test
    got = list(render_distractors(cfg, 30, copies=2, seed=3))
    assert len(got) == 30
    assert {cp for cp, *_ in got}.isdisjoint(classes)
    # every font and copy of a character before the next character
    assert [(f, c) for cp, f, c, _ in got[:8]] == [(f, c) for f in KANJI_FONTS for c in (0, 1)]
    assert len({cp for cp, *_ in got[:8]}) == 1
    a = got[0][3]
    assert a.shape == (32, 32) and a.dtype == np.uint8 and a.min() < 100 and a.max() > 200
    assert not np.array_equal(got[0][3], got[1][3])  # two copies: two jitters
    again = list(render_distractors(cfg, 30, copies=2, seed=3))
    assert all(np.array_equal(x[3], y[3]) and x[:3] == y[:3] for x, y in zip(got, again, strict=True))
    other = next(iter(render_distractors(cfg, 1, copies=2, seed=4)))
    assert other[:3] == got[0][:3] and not np.array_equal(other[3], got[0][3])
    # the jitter moves ink: a pure shift by a quarter of the side moves the ink's centre by 8 pixels
    g = np.full((32, 32), 255, np.uint8)
    g[12:20, 12:20] = 0

    class Fixed:
        def uniform(self, lo, hi, size=None):
            return np.full(size, hi) if size else (lo + hi) / 2  # the shift at its top; scale 1, no rotation
    moved = jitter(g, Fixed(), shift=0.25)
    ys, xs = np.nonzero(moved < 128)
    assert abs(xs.mean() - (15.5 + 8)) < 0.6 and abs(ys.mean() - (15.5 + 8)) < 0.6
    with pytest.raises(UserError):
        next(iter(render_distractors(cfg, 5, copies=0)))
