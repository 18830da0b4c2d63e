"""`python -m training evaluate` end to end, and its refusals."""
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import run_module



@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # CLI outputs (cache/, runs/) land in tmp, never in the repository


def run(*args, check=True):
    return run_module("training", *args, cwd=Path.cwd(), check=check)


def test_embeddings_to_flat_json(tmp_path):
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(10), 6)
    x = np.eye(10)[y] * 3 + rng.normal(size=(60, 10))
    np.save(tmp_path / "E.npy", x.astype(np.float32))
    np.save(tmp_path / "L.npy", y)
    out = tmp_path / "out.json"
    run("evaluate", "--embeddings", str(tmp_path / "E.npy"), "--labels", str(tmp_path / "L.npy"),
        "--ks", "1,4", "--json", str(out))
    res = json.loads(out.read_text())
    assert set(res) == {"recall@1", "recall@4", "map@r", "r_precision", "precision@1", "nmi", "f1",
                        "n_queries", "n_skipped_queries"}
    assert all(0 <= v <= 1 for k, v in res.items() if not k.startswith("n_"))
    assert res["n_queries"] == 60 and res["precision@1"] == res["recall@1"]
    from evaluation import evaluate
    assert res["map@r"] == pytest.approx(evaluate(x, y, ks=(1, 4))["map@r"])
    # separate queries
    np.save(tmp_path / "Q.npy", x[:7].astype(np.float32))
    np.save(tmp_path / "QL.npy", y[:7])
    r = run("evaluate", "--embeddings", str(tmp_path / "E.npy"), "--labels", str(tmp_path / "L.npy"),
            "--query-embeddings", str(tmp_path / "Q.npy"), "--query-labels", str(tmp_path / "QL.npy"))
    assert json.loads(r.stdout)["n_queries"] == 7


def test_bad_inputs_give_clear_errors(tmp_path):
    np.save(tmp_path / "E.npy", np.ones((4, 3), np.float32))
    np.save(tmp_path / "L3.npy", np.arange(3))
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    r = run("evaluate", "--embeddings", str(tmp_path / "nope.npy"), "--labels", "x", check=False)
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr
    r = run("evaluate", "--embeddings", str(tmp_path / "E.npy"), "--labels", str(tmp_path / "L3.npy"), check=False)
    assert r.returncode == 2 and "4 entries" in r.stderr
    r = run("evaluate", "--embeddings", str(tmp_path / "obj.npy"), "--labels", str(tmp_path / "L3.npy"), check=False)
    assert r.returncode == 2 and "not a plain .npy" in r.stderr
    r = run("evaluate", "--dataset", "cub", "--data-root", str(tmp_path / "missing"),
            "--backbone", "small_cnn", check=False)
    assert r.returncode == 2 and "data-set folder not found" in r.stderr
    r = run("evaluate", "--ks", "0", "--embeddings", "a", check=False)
    assert r.returncode == 2 and "--ks" in r.stderr
    np.save(tmp_path / "unique.npy", np.arange(4))  # every label unique: no query has a positive
    r = run("evaluate", "--embeddings", str(tmp_path / "E.npy"), "--labels", str(tmp_path / "unique.npy"),
            check=False)
    assert r.returncode == 2 and "no query has a positive" in r.stderr and "NaN" not in r.stdout


def test_backbone_on_image_folder_skips_corrupt_image(tmp_path):
    rng = np.random.default_rng(0)
    for c in range(6):
        color = rng.integers(0, 255, 3)
        for k in range(4):
            a = np.clip(color + rng.normal(0, 10, (16, 16, 3)), 0, 255).astype(np.uint8)
            (tmp_path / f"c{c}").mkdir(exist_ok=True)
            Image.fromarray(a).save(tmp_path / f"c{c}" / f"{k}.png")
    test_dirs = sorted(tmp_path.iterdir())
    # corrupt one image in every class, so the test split surely has one
    for d in test_dirs:
        (d / "0.png").write_bytes(b"garbage")
    out = tmp_path / "o.json"
    r = run("evaluate", "--dataset", "imagefolder", "--data-root", str(tmp_path), "--backbone",
            "small_cnn", "--weights", "none", "--image-size", "16", "--val-fraction", "0",
            "--json", str(out))
    res = json.loads(out.read_text())
    assert res["n_skipped_images"] == 3 and res["n_queries"] == 9
    assert "skipped" in r.stderr and "0.png" in r.stderr
