"""Embedding a gallery in shards: `build --shard i/N` + `index merge`, and a 2-rank torchrun build,
give the same index (ids, features, search results) as one process; merges of shards that do not
belong together are refused."""
from pathlib import Path

import numpy as np
import pytest
from support import run_command, run_module

from index.backends.search import Searcher
from index.backends.store import read_index


def same_index(a, b):
    x, y = read_index(a), read_index(b)
    assert x.items.ids.tolist() == y.items.ids.tolist() and len(x.items) > 0
    assert x.items.labels.tolist() == y.items.labels.tolist() and x.items.paths == y.items.paths
    np.testing.assert_allclose(np.asarray(x.features), np.asarray(y.features), atol=1e-5)
    q = np.asarray(x.features[:5])
    rx, ry = Searcher(x).search(q, "identity", {}, "cosine", 6), Searcher(y).search(q, "identity", {}, "cosine", 6)
    assert (rx.rows == ry.rows).all()


@pytest.fixture(scope="module")
def shards(tiny_run, tmp_path_factory):
    cfg, _ = tiny_run
    t = tmp_path_factory.mktemp("shards")
    ck = Path(cfg.out) / "best.pt"
    for i in range(2):
        r = run_command("index", "build", "--checkpoint", ck, "--shard", f"{i}/2", "--out", t / f"s{i}",
                        "--cache-dir", "", "--no-progress", cwd=t)
        assert r.returncode == 0, r.stderr
    return t, ck


def test_shards_merged_equal_one_build(tiny_index, shards):
    t, _ = shards
    assert 0 < read_index(t / "s0").manifest["count"] < read_index(tiny_index).manifest["count"]
    r = run_command("index", "merge", t / "s1", t / "s0", "--out", t / "merged", cwd=t)
    assert r.returncode == 0, r.stderr
    same_index(tiny_index, t / "merged")


def test_merge_refuses_shards_that_do_not_belong_together(tiny_index, shards):
    t, _ = shards
    r = run_command("index", "merge", t / "s0", t / "s0", "--out", t / "bad", cwd=t)
    assert r.returncode == 2 and "exactly once" in r.stderr and not (t / "bad").exists()
    r = run_command("index", "merge", t / "s0", tiny_index, "--out", t / "bad", cwd=t)
    assert r.returncode == 2 and "is not a shard" in r.stderr and not (t / "bad").exists()


@pytest.mark.multiprocess
def test_torchrun_two_ranks_equal_one_build(tiny_index, shards):
    t, ck = shards
    r = run_module("torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "index", "build",
                   "--checkpoint", ck, "--out", t / "ddp", "--cache-dir", "", "--no-progress", cwd=t)
    assert r.returncode == 0, r.stderr
    same_index(tiny_index, t / "ddp")
    assert not [p.name for p in t.iterdir() if ".shards-" in p.name]  # the per-rank shards are gone
