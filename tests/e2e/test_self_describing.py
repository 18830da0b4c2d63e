"""A new user's path on an ImageFolder: train at a non-default size, then `index build --checkpoint`
with no data flags builds the same index as one given every flag; contradicting flags warn; a moved
data root is named."""
import json

import numpy as np
import pytest
from PIL import Image
from support import run_command

SIZE = 40  # a non-default size (the images are 56 px, the backbone default 224)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    t = tmp_path_factory.mktemp("selfdesc")
    rng = np.random.default_rng(0)
    for c in range(8):
        (t / "images" / f"class{c}").mkdir(parents=True)
        base = rng.integers(0, 255, size=(56, 56, 3))
        for i in range(4):
            px = np.clip(base + rng.normal(0, 20, size=base.shape), 0, 255).astype(np.uint8)
            Image.fromarray(px).save(t / "images" / f"class{c}" / f"{i}.png")
    r = run_command("training", "train", "--dataset", "imagefolder", "--data-root", t / "images",
                    "--image-size", SIZE, "--backbone", "small_cnn", "--weights", "none", "--embed-dim", 8,
                    "--epochs", 1, "--batch-size", 8, "--m-per-class", 4, "--out", t / "run",
                    "--cache-dir", t / "cache", "--no-progress", cwd=t)
    assert r.returncode == 0, r.stderr
    return t


def build(t, out, *flags):
    r = run_command("index", "build", "--checkpoint", t / "run" / "best.pt", "--out", t / out,
                    "--cache-dir", "", "--no-progress", *flags, cwd=t)
    assert r.returncode == 0, r.stderr
    return json.loads((t / out / "manifest.json").read_text()), r.stderr


def test_build_takes_the_data_settings_from_the_checkpoint(trained):
    t = trained
    man, err = build(t, "idx")
    assert "warning" not in err
    assert man["data"]["dataset"] == "imagefolder" and man["data"]["image_size"] == SIZE
    assert man["split"] == "test" and man["transform"]["image_size"] == SIZE
    assert man["data"]["data_root"] == str((t / "images").resolve())
    # half of the 8 classes are test classes, 4 images each
    assert man["count"] == 4 * 4 and man["classes"] == 4

    explicit, _ = build(t, "idx_explicit", "--dataset", "imagefolder", "--data-root", t / "images",
                        "--image-size", SIZE, "--split", "test")
    assert explicit["data"] == man["data"] and explicit["transform"] == man["transform"]
    assert (np.load(t / "idx" / "features.npy") == np.load(t / "idx_explicit" / "features.npy")).all()
    res = []
    for idx in ("idx", "idx_explicit"):
        r = run_command("index", "search", "--index", t / idx, "--image", t / "images" / "class1" / "0.png",
                        "--k", 5, cwd=t)
        assert r.returncode == 0, r.stderr
        res.append(json.loads(r.stdout)["queries"][0]["results"])
    assert res[0] == res[1] and len(res[0]) == 5


def test_a_flag_that_contradicts_the_checkpoint_warns(trained):
    man, err = build(trained, "idx_64", "--image-size", 64)
    assert "warning: --image-size 64 differs from checkpoint" in err and f"'s {SIZE}" in err
    assert man["transform"]["image_size"] == 64  # the flag wins, and the user was told


def test_a_moved_data_root_is_named_with_the_flag_that_overrides_it(trained):
    t = trained
    (t / "images").rename(t / "moved")
    try:
        r = run_command("index", "build", "--checkpoint", t / "run" / "best.pt", "--out", t / "idx_moved",
                        "--cache-dir", "", "--no-progress", cwd=t)
        assert r.returncode == 2
        assert str((t / "images").resolve()) in r.stderr and "--data-root" in r.stderr
        assert r.stderr.startswith("error: ") and "Traceback" not in r.stderr
        assert not (t / "idx_moved").exists()
        man, _ = build(t, "idx_moved", "--data-root", t / "moved")
        assert man["count"] == 16
    finally:
        (t / "moved").rename(t / "images")
