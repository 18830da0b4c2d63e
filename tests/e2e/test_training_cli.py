"""`python -m training evaluate` and `train` end to end, and their refusals: through the command's
main(argv) in this process, and once in a process of its own (python -m training)."""
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from support import run_command, run_module


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # CLI outputs (cache/, runs/) land in tmp, never in the repository


def run(*args, check=True):
    return run_command("training", *args, cwd=Path.cwd(), check=check)


def test_embeddings_to_flat_json(tmp_path):
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(10), 6)
    x = np.eye(10)[y] * 3 + rng.normal(size=(60, 10))
    np.save(tmp_path / "E.npy", x.astype(np.float32))
    np.save(tmp_path / "L.npy", y)
    out = tmp_path / "out.json"
    # the one run of `python -m training` in a process of its own
    r = run_module("training", "evaluate", "--embeddings", tmp_path / "E.npy", "--labels", tmp_path / "L.npy",
                   "--ks", "1,4", "--json", out, cwd=tmp_path, check=True)
    assert json.loads(r.stdout) == json.loads(out.read_text()) and "MAP@R" in r.stderr
    res = json.loads(out.read_text())
    assert set(res) == {"recall@1", "recall@4", "map@r", "r_precision", "precision@1", "nmi", "f1",
                        "n_classes", "n_queries", "n_skipped_queries"}
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
    args = ("evaluate", "--dataset", "imagefolder", "--data-root", str(tmp_path), "--backbone", "small_cnn",
            "--weights", "none", "--image-size", "16", "--val-fraction", "0", "--json", str(out),
            "--cache-dir", str(tmp_path.parent / f"{tmp_path.name}-cache"))
    r = run(*args)
    res = json.loads(out.read_text())
    assert res["n_skipped_images"] == 3 and res["n_queries"] == 9 and res["n_classes"] == 3
    assert "skipped" in r.stderr and "0.png" in r.stderr
    # the raw trunk's features went into the cache (keyed by the random-init weights: no reuse here)
    assert len(list((tmp_path.parent / f"{tmp_path.name}-cache").iterdir())) == 1


# ------------------------------------------------------------------ train: refusals and run folders
TINY = ("--dataset", "kanji", "--num-classes", "12", "--image-size", "32", "--kanji-fonts", "ipag,ipam,seto,ukai",
        "--backbone", "small_cnn", "--weights", "none", "--embed-dim", "8", "--batch-size", "8",
        "--m-per-class", "4", "--no-progress")


def tiny_train(tmp_path, *args, check=True):
    return run("train", *TINY, "--data-root", str(tmp_path / "kanji"), "--cache-dir", str(tmp_path / "cache"),
               *args, check=check)


def test_refused_configurations_write_nothing(tmp_path):
    """A new user's reproductions, as they ran them (more refusals: tests/training/test_train_cli.py)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("best.pt", "latest.pt"):
        (run_dir / name).write_bytes(b"the user's run")
    for bad, msg in [(("--embed-dim", "0"), "--embed-dim must be ≥ 1, got 0"),
                     (("--lr", "-1"), "--lr must be > 0, got -1.0")]:
        r = tiny_train(tmp_path, "--out", str(run_dir), "--overwrite", *bad, check=False)
        assert (r.returncode, r.stderr) == (2, f"error: {msg}\n"), bad
        assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == {"best.pt": b"the user's run",
                                                                     "latest.pt": b"the user's run"}
    r = tiny_train(tmp_path, "--out", str(tmp_path / "new"), "--loss", "lifted", check=False)
    assert r.returncode == 2 and "argument --loss: unknown loss 'lifted'" in r.stderr
    assert not (tmp_path / "new").exists() and not (tmp_path / "cache").exists()


def test_config_toml_reproduces_the_run_and_flags_override_it(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    tiny_train(tmp_path, "--out", str(a), "--epochs", "2", "--json", str(tmp_path / "a.json"))
    assert not (a / "config.json").exists()
    r = run("train", "--config", str(a / "config.toml"), "--out", str(b), "--json", str(tmp_path / "b.json"))
    first, again = json.loads((tmp_path / "a.json").read_text()), json.loads((tmp_path / "b.json").read_text())
    assert again["test"] == first["test"] and again["selected_epoch"] == first["selected_epoch"]
    assert "test (6 classes, 24 queries): MAP@R" in r.stderr and "val (" in r.stderr
    # a flag given with --config wins; --overwrite replaces our own run
    run("train", "--config", str(a / "config.toml"), "--epochs", "1", "--overwrite")
    assert "epochs = 1" in (a / "config.toml").read_text()
    assert len((a / "log.jsonl").read_text().splitlines()) == 1


# ------------------------------------------------------------------ evaluate a checkpoint on its own data
def test_evaluate_checkpoint_takes_its_data_settings(tiny_run, tmp_path):
    cfg, _ = tiny_run
    ck = str(Path(cfg.out) / "best.pt")
    r = run("evaluate", "--checkpoint", ck, "--cache-dir", str(tmp_path / "c"), "--no-progress", "--threads", "1",
            "--json", str(tmp_path / "m.json"))
    assert "warning" not in r.stderr
    assert "test (6 classes, 24 queries): MAP@R" in r.stderr
    res = json.loads((tmp_path / "m.json").read_text())
    assert (res["n_classes"], res["n_queries"]) == (6, 24)
    r = run("evaluate", "--checkpoint", ck, "--image-size", "48", "--no-progress")
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: --image-size 48 differs from the checkpoint's 32; the results measure the model "
                        "on other data than it was trained and selected on"]


def test_train_and_evaluate_backbone_resolve_the_same_image_size(tmp_path):
    """An ImageFolder of 40-px images: `train` and `evaluate --backbone` both embed at 40 px (the
    largest side), not at the data set's 224-px default."""
    rng = np.random.default_rng(0)
    data = tmp_path / "folder"
    for c in range(8):
        color = rng.integers(0, 255, 3)
        (data / f"c{c}").mkdir(parents=True)
        for k in range(4):
            a = np.clip(color + rng.normal(0, 20, (40, 40, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(a).save(data / f"c{c}" / f"{k}.png")
    common = ("--dataset", "imagefolder", "--data-root", str(data), "--backbone", "small_cnn", "--weights", "none",
              "--cache-dir", str(tmp_path / "cache"), "--no-progress")
    ev = tmp_path / "ev.json"
    run("evaluate", *common, "--json", str(ev))
    run("train", *common, "--embed-dim", "8", "--batch-size", "8", "--m-per-class", "4", "--epochs", "1",
        "--out", str(tmp_path / "run"))
    import torch
    ck = torch.load(tmp_path / "run" / "best.pt", map_location="cpu", weights_only=True)
    from model.checkpoint import recorded_data
    trained = recorded_data(ck)
    assert trained.image_size == 40
    assert json.loads(ev.read_text())["image_size"] == trained.image_size
    assert json.loads(ev.read_text())["resize_mode"] == trained.resize_mode
