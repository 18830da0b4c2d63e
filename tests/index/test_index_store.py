"""Index directories: round trip, refusal of damaged ones, add/remove, build and search end to end."""
import json
from pathlib import Path

import numpy as np
import pytest
from support import run_command, run_module

from core.errors import UserError
from index.backends.search import Searcher
from index.backends.store import FILES, Items, read_index, write_index
from index.build import add_features, build_from_dataset, build_from_features, remove_ids


def small_index(path, n=50, d=12, k=4, seed=0):
    rng = np.random.default_rng(seed)
    feats = rng.normal(size=(n, d)).astype(np.float32)
    W = rng.normal(size=(k, d)).astype(np.float32)
    items = Items(np.arange(n), rng.integers(0, 5, n), [f"p{i}.png" for i in range(n)], ["test"] * n)
    write_index(path, feats, items, W, normalize=True, info={"checkpoint_sha256": None, "backbone": None},
                class_names={0: "zero"})
    return feats, W, items


def test_roundtrip(tmp_path):
    feats, W, items = small_index(tmp_path / "i")
    data = read_index(tmp_path / "i")
    assert data.manifest["count"] == 50 and data.manifest["trunk_dim"] == 12
    assert data.manifest["normalize"] is True and data.manifest["index_type"] == "exact"
    np.testing.assert_allclose(np.asarray(data.features),
                               feats / np.linalg.norm(feats, axis=1, keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(data.W, W)
    np.testing.assert_array_equal(data.items.labels, items.labels)
    assert data.items.paths == items.paths and data.class_names == {0: "zero"}
    assert isinstance(data.features, np.memmap)  # memory-mapped, not read whole
    assert set(data.manifest["files"]) == set(FILES)


def test_refuses_corrupt_manifest_truncated_and_corrupted_files(tmp_path):
    small_index(tmp_path / "i")
    man = tmp_path / "i" / "manifest.json"
    good = man.read_text()
    man.write_text(good[:40])
    with pytest.raises(UserError, match="corrupt manifest"):
        read_index(tmp_path / "i")
    man.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(UserError, match="not a manifest"):
        read_index(tmp_path / "i")
    man.write_text(good)
    f = tmp_path / "i" / "index.faiss"
    blob = f.read_bytes()
    f.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(UserError, match="truncated"):
        read_index(tmp_path / "i")
    f.write_bytes(blob[:-4] + b"\x00\x01\x02\x03")  # same size, other bytes
    with pytest.raises(UserError, match="checksum"):
        read_index(tmp_path / "i")
    f.write_bytes(blob)
    (tmp_path / "i" / "W.npy").unlink()
    with pytest.raises(UserError, match="lacks W.npy"):
        read_index(tmp_path / "i")
    with pytest.raises(UserError, match="not found"):
        read_index(tmp_path / "nope")


def test_interrupted_rewrite_keeps_previous_index(tmp_path, monkeypatch):
    small_index(tmp_path / "i")
    import index.backends.store as st

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(st.faiss, "write_index", boom)
    with pytest.raises(KeyboardInterrupt):
        add_features(tmp_path / "i", np.ones((2, 12)), [1, 1])
    monkeypatch.undo()
    assert read_index(tmp_path / "i").manifest["count"] == 50
    assert [p.name for p in tmp_path.iterdir()] == ["i"]


def test_add_and_remove(tmp_path):
    feats, _, _ = small_index(tmp_path / "i")
    new = np.random.default_rng(3).normal(size=(3, 12)).astype(np.float32)
    ids = add_features(tmp_path / "i", new, [7, 7, 8])
    assert ids == [50, 51, 52]
    data = read_index(tmp_path / "i")
    assert data.manifest["count"] == 53 and list(data.items.labels[-3:]) == [7, 7, 8]
    # the added vector is found as its own nearest neighbour under the identity
    res = Searcher(data).search(new[1:2], "identity", k=1)
    assert data.items.ids[res.rows[0, 0]] == 51
    assert remove_ids(tmp_path / "i", [51, 0]) == 2
    data = read_index(tmp_path / "i")
    assert data.manifest["count"] == 51 and 51 not in data.items.ids and 0 not in data.items.ids
    res = Searcher(data).search(new[1:2], "identity", k=3)
    assert 51 not in data.items.ids[res.rows[0]]
    with pytest.raises(UserError, match="not in the index"):
        remove_ids(tmp_path / "i", [999])
    with pytest.raises(UserError, match="12-d"):
        add_features(tmp_path / "i", np.ones((1, 5)), [0])


def test_build_from_features_and_wrong_neck(tmp_path):
    rng = np.random.default_rng(0)
    np.save(tmp_path / "F.npy", rng.normal(size=(20, 8)).astype(np.float32))
    np.save(tmp_path / "L.npy", rng.integers(0, 3, 20))
    np.save(tmp_path / "W.npy", rng.normal(size=(4, 8)).astype(np.float32))
    np.save(tmp_path / "Wbad.npy", rng.normal(size=(4, 9)).astype(np.float32))
    build_from_features(tmp_path / "F.npy", tmp_path / "L.npy", tmp_path / "i", neck=tmp_path / "W.npy")
    assert read_index(tmp_path / "i").W.shape == (4, 8)
    with pytest.raises(UserError, match="k × 8"):
        build_from_features(tmp_path / "F.npy", tmp_path / "L.npy", tmp_path / "j", neck=tmp_path / "Wbad.npy")


# ------------------------------------------------------------ with a real (tiny) model (conftest)
def test_build_search_cli_matches_api_and_refuses_other_model(tiny_run, tmp_path):
    cfg, t = tiny_run
    ck = Path(cfg.out) / "best.pt"
    idx = tmp_path / "idx"
    build_from_dataset(ck, cfg.data_config(), idx, progress=False)
    data = read_index(idx)
    assert data.manifest["split"] == "test" and data.manifest["count"] == 6 * 4
    img = Path(data.root) / data.items.paths[3]
    def cli_search(*extra, run=run_command):
        out = tmp_path / "r.json"
        r = run("index", "search", "--index", str(idx), "--image", str(img), "--k", "5", "--json", str(out),
                *extra, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        return json.loads(out.read_text())["queries"][0]["results"]

    res = cli_search("--strategy", "trained", "--mode", "cosine", run=run_module)  # in a process of its own
    assert len(res) == 5 and res[0]["id"] == int(data.items.ids[3])  # cosine: the image finds itself first
    assert res[0]["score"] == pytest.approx(1.0, abs=1e-4)
    res = cli_search("--strategy", "random", "--r", "0.5", "--seed", "1")
    assert [x["score"] for x in res] == sorted([x["score"] for x in res], reverse=True)
    api = Searcher(data).search(np.asarray(data.features[3:4]), "random", {"r": 0.5, "seed": 1}, k=5)
    assert [x["id"] for x in res] == [int(data.items.ids[r]) for r in api.rows[0]]
    assert [x["score"] for x in res] == pytest.approx(api.scores[0].tolist(), rel=1e-4, abs=1e-5)
    # a model from another checkpoint is refused
    from model.checkpoint import model_from_checkpoint, read_checkpoint, save_checkpoint
    other = tmp_path / "other.pt"
    ckd = read_checkpoint(ck)
    save_checkpoint(other, model_from_checkpoint(ckd), config=ckd["config"], metrics={"x": 1})
    r = run_command("index", "search", "--index", str(idx), "--image", str(img),
                    "--checkpoint", str(other), cwd=tmp_path)
    assert r.returncode == 2 and "not the model this index was built with" in r.stderr
    # a query of the wrong dimension is refused
    np.save(tmp_path / "q.npy", np.ones((1, 7), np.float32))
    r = run_command("index", "search", "--index", str(idx), "--features",
                    str(tmp_path / "q.npy"), cwd=tmp_path)
    assert r.returncode == 2 and "this index holds 128-d features" in r.stderr
    # non-symmetric custom matrix via the CLI
    A = np.eye(128)
    A[0, 1] = 1
    np.save(tmp_path / "A.npy", A)
    r = run_command("index", "search", "--index", str(idx), "--image", str(img),
                    "--strategy", "custom", "--metric-matrix", str(tmp_path / "A.npy"), cwd=tmp_path)
    assert r.returncode == 2 and "not symmetric" in r.stderr


def test_strategy_evaluation_outputs(tmp_path):
    from index.analysis.strategy_eval import is_trained_equivalent, run_evaluation

    rng = np.random.default_rng(0)
    centers = rng.normal(size=(10, 16))
    y = np.repeat(np.arange(10), 5)
    X = np.abs(centers[y] + 0.5 * rng.normal(size=(50, 16)))
    W = rng.normal(size=(4, 16))
    res = run_evaluation(X, y, W, tmp_path, val=(X[:25], y[:25]), seeds=2, progress=False, grid_name="full")
    for f in ("strategies.json", "table.md", "restraint_sweep.png", "principles.png"):
        assert (tmp_path / f).is_file()
    rows = {r["row"] for r in res["table"]}
    assert any("validation-selected" in r for r in rows) and any("oracle" in r for r in rows)
    oracle = next(t for t in res["table"] if "oracle" in t["row"])
    assert not oracle["choice"].startswith(("trained", "shrink(alpha=0.0)", "spectral(p=1.0)"))
    diag = [r for r in res["test"] if r["strategy"] == "diagonal"]
    assert {r["params"]["r"] for r in diag} == {round(0.1 * i, 1) for i in range(11)}
    assert all(r["seeds"] == 2 for r in diag)
    # r = 0 is the trained metric exactly
    r0 = next(r for r in diag if r["params"]["r"] == 0.0)
    tr = next(r for r in res["test"] if r["strategy"] == "trained" and r["mode"] == "bilinear")
    assert r0["map@r"] == pytest.approx(tr["map@r"]) and is_trained_equivalent(r0)


def test_select_cli_chooses_on_validation(tiny_run, tmp_path):
    cfg, t = tiny_run
    out = tmp_path / "sel.json"
    r = run_command("index", "select", "--checkpoint", str(Path(cfg.out) / "best.pt"),
                    "--dataset", "kanji", "--data-root", cfg.data_root, "--num-classes", "12",
                    "--image-size", "32", "--kanji-fonts", ",".join(cfg.kanji_fonts), "--cache-dir",
                    cfg.cache_dir, "--seeds", "1", "--no-progress", "--json", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    best = max(res["all"], key=lambda row: row["map@r"])
    assert res["strategy"] == best["strategy"] and res["val_map@r"] == pytest.approx(best["map@r"])
    assert {"trace_over_frobenius", "frobenius_over_trace"} <= set(res["principles"])


def test_an_in_memory_index_holds_its_gallery_once():
    """in_memory_index's features are the Flat index's own vectors (no second copy), read-only,
    and a slice of them outlives the IndexData."""
    import gc

    import faiss

    from index.backends.store import in_memory_index

    x = np.random.default_rng(0).normal(size=(50, 6)).astype(np.float32)
    data = in_memory_index(x, np.arange(50) % 5, np.eye(6, dtype=np.float32), normalize=True)
    f = data.features
    assert f.ctypes.data == int(faiss.downcast_index(data.faiss_index).get_xb()) and not f.flags.writeable
    want = x / np.linalg.norm(x, axis=1, keepdims=True)
    np.testing.assert_allclose(f, want, rtol=1e-6)
    part = f[10:20]
    del data, f
    gc.collect()
    np.testing.assert_allclose(part, want[10:20], rtol=1e-6)
