"""Never answer garbage, never lose data, in-process through the index CLI:
damaged index contents, bad arrays to add and to search with, huge numbers, guarded
outputs and a full disk each give one `error:` line and exit 2, and change nothing."""
import errno
import hashlib
import json
import re

import numpy as np
import pytest

from core.cli import run_cli
from core.errors import UserError
from index.backends.store import Items, read_index, write_index
from index.cli import main
from index.refinements import strategy_params

N, D = 20, 6


@pytest.fixture
def idx(tmp_path):
    rng = np.random.default_rng(0)
    items = Items(np.arange(N), np.repeat(np.arange(4), N // 4), [""] * N, ["test"] * N)
    return write_index(tmp_path / "idx", rng.normal(size=(N, D)), items, rng.normal(size=(3, D)),
                       normalize=True, info={})


def cli(capsys, *argv):
    """(exit code, stdout, the stderr line) of `python -m index ARGV` run in-process."""
    rc = run_cli(main, [str(a) for a in argv])
    out, err = capsys.readouterr()
    assert err.count("\n") <= 1 and "Traceback" not in err
    return rc, out, err.strip()


def save(path, a):
    np.save(path, a)
    return path


def rewrite(idx, name, data: bytes):
    """Replace one index file and keep the manifest consistent with it: the damage is in the
    contents (as a buggy writer would leave it), not caught by the checksums."""
    (idx / name).write_bytes(data)
    man = json.loads((idx / "manifest.json").read_text())
    man["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (idx / "manifest.json").write_text(json.dumps(man))


def edit_manifest(idx, change):
    man = json.loads((idx / "manifest.json").read_text())
    change(man)
    (idx / "manifest.json").write_text(json.dumps(man))


def edit_metadata(idx, change):
    meta = json.loads((idx / "metadata.json").read_text())
    change(meta)
    rewrite(idx, "metadata.json", json.dumps(meta).encode())


def npy_bytes(a, tmp_path):
    return save(tmp_path / "x.npy", a).read_bytes()


# ------------------------------------------------------------ index contents (schema on read)
@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(files=list(m["files"])), r"manifest field 'files' must be dict, got list"),
    (lambda m: m["files"]["W.npy"].pop("bytes"), r"manifest entry files\['W.npy'\] has no field 'bytes'"),
    (lambda m: m["files"]["W.npy"].update(bytes="128"),
     r"manifest entry files\['W.npy'\] field 'bytes' must be int, got str"),
    (lambda m: m.pop("count"), r"manifest has no field 'count'"),
    (lambda m: m.update(normalize="yes"), r"manifest field 'normalize' must be bool, got str"),
    (lambda m: m.update(trunk_dim=True), r"manifest field 'trunk_dim' must be int, got bool"),
])
def test_malformed_manifest_is_refused_naming_the_index_and_field(idx, change, message):
    edit_manifest(idx, change)
    with pytest.raises(UserError, match=r"^index .*idx: " + message):
        read_index(idx)


def test_nan_in_W_or_a_feature_row_is_refused(idx, tmp_path):
    good_W = (idx / "W.npy").read_bytes()
    W = np.load(idx / "W.npy")
    W[1, 2] = np.nan
    rewrite(idx, "W.npy", npy_bytes(W, tmp_path))
    with pytest.raises(UserError, match=r"idx: W.npy contains NaN or infinite values \(first at row 1\)"):
        read_index(idx)
    rewrite(idx, "W.npy", good_W)
    F = np.load(idx / "features.npy")
    F[3, 0] = np.inf
    rewrite(idx, "features.npy", npy_bytes(F, tmp_path))
    with pytest.raises(UserError, match=r"idx: features.npy contains NaN or infinite values \(first at row 3\)"):
        read_index(idx)
    assert read_index(idx, verify=False).manifest["count"] == N  # --no-verify skips the full reads


@pytest.mark.parametrize("change, message", [
    (lambda m: m["ids"].__setitem__(5, 2), r"metadata.json: ids are not unique \(e.g. 2\)"),
    (lambda m: m["labels"].__setitem__(0, "cat"), r"metadata.json: 'labels' must hold ints, found 'cat'"),
    (lambda m: m["labels"].__setitem__(0, 1.5), r"metadata.json: 'labels' must hold ints, found 1.5"),
    (lambda m: m.update(ids={"0": 0}), r"metadata.json: 'ids' must be a list, got dict"),
    (lambda m: m.update(class_names={"cat": "x"}), r"'class_names' must map integer labels to names"),
])
def test_bad_metadata_is_refused(idx, change, message):
    edit_metadata(idx, change)
    with pytest.raises(UserError, match=message):
        read_index(idx)


# ------------------------------------------------------------ index add
@pytest.mark.parametrize("feats, labels, message", [
    (np.full((2, D), np.nan), None, r"features file .*A.npy contains NaN or infinite values \(first at row 0\)"),
    (np.ones((2, D)), np.array([1.0, 2.5]), r"labels of the features file .*A.npy must be integer class labels; "
                                            r"entry 1 is 2.5"),
    (np.ones((3, D)), np.array([1, 2]), r"labels of the features file .*A.npy has 2 labels for 3 rows"),
    (np.array(["a", "b"]), None, r"features file .*A.npy must hold numbers"),
])
def test_index_add_refuses_bad_arrays_and_changes_nothing(idx, tmp_path, capsys, feats, labels, message):
    before = (idx / "manifest.json").read_text()
    argv = ["add", "--index", idx, "--features", save(tmp_path / "A.npy", feats)]
    if labels is not None:
        argv += ["--labels", save(tmp_path / "B.npy", labels)]
    rc, _, err = cli(capsys, *argv)
    assert rc == 2 and err.startswith("error: ") and re.search(message, err), err
    assert (idx / "manifest.json").read_text() == before


def test_index_add_takes_integral_float_labels(idx, tmp_path, capsys):
    rc, out, _ = cli(capsys, "add", "--index", idx, "--features", save(tmp_path / "A.npy", np.ones((2, D))),
                     "--labels", save(tmp_path / "B.npy", np.array([3.0, 4.0])))
    assert rc == 0 and json.loads(out) == {"added_ids": [N, N + 1]}
    assert read_index(idx).items.labels[-2:].tolist() == [3, 4]


# ------------------------------------------------------------ index search
@pytest.mark.parametrize("query, message", [
    (np.array([["0.1"] * D]), r"query features file .*Q.npy must hold numbers, got dtype <U3"),
    (np.ones((1, D, 2)), r"query features file .*Q.npy must be 1-D \(d\) or 2-D \(n × d\), got shape \(1, 6, 2\)"),
    (np.ones((0, D)), r"query features file .*Q.npy has 0 rows; at least 1 needed"),
    (np.zeros((2, D)), r"query features file .*Q.npy: row 0 is all zeros: every item would score the same"),
    (np.full((1, D), 1e30, dtype=np.float32), r"Q.npy: row 0 is too large: its norm overflows float32"),
    (np.full((1, D), 1e39), r"Q.npy has values beyond the float32 range"),
    (np.ones((1, D + 1)), r"Q.npy have dimension 7; this index holds 6-d features"),
])
def test_search_refuses_bad_queries(idx, tmp_path, capsys, query, message):
    rc, out, err = cli(capsys, "search", "--index", idx, "--features", save(tmp_path / "Q.npy", query))
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and re.search(message, err), err


def test_k_is_capped_at_the_index_size_before_anything_is_allocated(idx, tmp_path, capsys):
    rc, out, _ = cli(capsys, "search", "--index", idx, "--features", save(tmp_path / "Q.npy", np.ones(D)),
                     "--k", 10 ** 9)
    res = json.loads(out)
    assert rc == 0 and res["k"] == N and len(res["queries"][0]["results"]) == N


def test_a_negative_seed_is_refused_in_the_cli_and_in_the_parameters_the_app_uses(idx, tmp_path, capsys):
    rc, _, err = cli(capsys, "search", "--index", idx, "--features", save(tmp_path / "Q.npy", np.ones(D)),
                     "--strategy", "random", "--seed", -1)
    assert rc == 2 and err == "error: refinement strategy 'random': seed must be ≥ 0, got -1"
    with pytest.raises(UserError, match="seed must be ≥ 0, got -1"):
        strategy_params("diagonal", {"r": 0.5, "seed": -1})


def test_a_custom_matrix_beyond_float32_is_refused(idx, tmp_path, capsys):
    M = np.eye(D) * 1e39
    rc, _, err = cli(capsys, "search", "--index", idx, "--features", save(tmp_path / "Q.npy", np.ones(D)),
                     "--strategy", "custom", "--metric-matrix", save(tmp_path / "M.npy", M))
    assert rc == 2 and err.startswith("error: custom matrix") and err.endswith("has values beyond the float32 range "
                                                                              "(|x| > 3.4e+38)")


def test_json_onto_a_directory_is_refused_before_any_work(idx, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    rc, _, err = cli(capsys, "search", "--index", idx, "--features", save(tmp_path / "Q.npy", np.ones(D)),
                     "--json", tmp_path / "out")
    assert rc == 2 and err == f"error: {tmp_path / 'out'} is a directory; give a file name to write"


# ------------------------------------------------------------ index build --out
@pytest.fixture
def build_inputs(tmp_path):
    rng = np.random.default_rng(1)
    return ["build", "--features", save(tmp_path / "F.npy", rng.normal(size=(12, 4))),
            "--labels", save(tmp_path / "L.npy", np.arange(12) % 3), "--out"]


def test_build_never_replaces_what_is_not_an_index(tmp_path, capsys, build_inputs):
    user = tmp_path / "photos"
    user.mkdir()
    (user / "holiday.jpg").write_bytes(b"irreplaceable")
    (tmp_path / "notes.txt").write_text("mine")
    for extra in ([], ["--overwrite"]):
        rc, _, err = cli(capsys, *build_inputs, user, *extra)
        assert rc == 2 and err == f"error: {user} is a directory that is not an index: refusing to replace it " \
                                  f"(choose another output path)"
        rc, _, err = cli(capsys, *build_inputs, tmp_path / "notes.txt", *extra)
        assert rc == 2 and "notes.txt is a file that is not an index" in err
    assert (user / "holiday.jpg").read_bytes() == b"irreplaceable" and (tmp_path / "notes.txt").read_text() == "mine"


def test_build_replaces_an_index_only_with_overwrite(tmp_path, capsys, build_inputs):
    out = tmp_path / "idx"
    assert cli(capsys, *build_inputs, out)[0] == 0
    rc, _, err = cli(capsys, *build_inputs, out)
    assert rc == 2 and err == f"error: {out} already holds an index; give --overwrite to replace it"
    assert cli(capsys, *build_inputs, out, "--overwrite")[0] == 0
    assert read_index(out).manifest["count"] == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == ["F.npy", "L.npy", "idx"]


# ------------------------------------------------------------ a full disk
def test_a_full_disk_during_index_add_changes_nothing(idx, tmp_path, capsys, monkeypatch):
    before = {p.name: p.read_bytes() for p in idx.iterdir()}

    def full(path, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    query = save(tmp_path / "A.npy", np.ones((2, D)))
    monkeypatch.setattr(np, "save", full)
    rc, _, err = cli(capsys, "add", "--index", idx, "--features", query, "--label", 1)
    assert rc == 2 and err == f"error: no space left on device: nothing was changed ({idx} is as it was)"
    assert {p.name: p.read_bytes() for p in idx.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["A.npy", "idx"]


def test_a_full_disk_while_writing_json_keeps_the_old_file(idx, tmp_path, capsys, monkeypatch):
    out = tmp_path / "r.json"
    out.write_text("previous results")

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    query = save(tmp_path / "A.npy", np.ones((2, D)))
    monkeypatch.setattr("core.atomic.os.replace", full)
    rc, _, err = cli(capsys, "search", "--index", idx, "--features", query, "--json", out)
    assert rc == 2 and err == f"error: no space left on device: nothing was changed ({out} is as it was)"
    assert out.read_text() == "previous results"
