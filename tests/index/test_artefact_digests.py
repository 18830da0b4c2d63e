"""Every cached artefact is named by a digest of what made it: an answer never depends on the
requests that came before it, an artefact is never read with inputs other than its own, the
disk cache keeps within its budget, and a gallery dropped by its owner is freed."""
import gc
import os
import time
import weakref

import faiss
import numpy as np
import pytest

from core.errors import UserError
from index.backends.search import Searcher
from index.backends.store import Items, read_index, write_index
from index.rerankers import SearcherSpace, rerank
from index.space import CACHE, gallery_space
from index.space.store import prune


def clustered(n, d, seed=0, classes=60):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, d))
    lab = rng.integers(0, classes, n)
    return (centres[lab] + 0.8 * rng.normal(size=(n, d))).astype(np.float32), lab


def build(path, x, lab):
    n = len(x)
    items = Items(np.arange(n), lab.astype(np.int64), [f"img/{i}.png" for i in range(n)], ["test"] * n)
    W = np.random.default_rng(5).normal(size=(16, x.shape[1])).astype(np.float32)
    write_index(path, x, items, W, normalize=True, info={"backbone": "synthetic"})
    return Searcher(read_index(path))


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    """Every cache goes under the test's own folder, never the user's; the memory cache starts empty."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    CACHE.clear()
    yield
    CACHE.clear()


@pytest.fixture
def one_thread():
    """One FAISS thread: the HNSW graph is then built the same way in every "process"."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


def test_an_answer_does_not_depend_on_the_requests_before_it(tmp_path, monkeypatch, one_thread):
    """k1 = 20 on a gallery whose lists come from the HNSW graph (the threshold lowered, a weak
    graph, so that a deeper search orders the first entries differently): asked in a fresh
    process, after k1 = 70 in the same process, and in a fresh process that asked k1 = 70
    first, the answers are equal.  A fresh process is an empty memory cache and its own cache
    folder."""
    import index.rerankers.neighbours as nb

    monkeypatch.setattr(nb, "APPROXIMATE_ABOVE", 0)
    monkeypatch.setitem(nb.HNSW, "M", 4)
    monkeypatch.setitem(nb.HNSW, "ef_construction", 10)
    x, lab = clustered(1000, 16)
    searcher = build(tmp_path / "idx", x, lab)
    q = x[:30]
    own = np.arange(30)

    def process(name):
        CACHE.clear()
        return SearcherSpace(searcher, "trained", {}, "cosine", cache_dir=tmp_path / name)

    def k1(space, k):
        return rerank("kreciprocal", space, q, 10, params={"k1": k, "k2": 6}, self_ids=own)

    space = process("fresh")
    fresh = k1(space, 20)
    k1(space, 70)
    after = k1(space, 20)
    space = process("deep-first")
    k1(space, 70)
    first_deep = k1(space, 20)
    for got in (after, first_deep):
        np.testing.assert_array_equal(got.rows, fresh.rows)
        np.testing.assert_array_equal(got.scores, fresh.scores)
    # the premise: the deeper lists do order the first entries differently here
    short = nb.neighbour_lists(space, 22).rows
    long = nb.neighbour_lists(space, 72).rows[:, :22]
    assert (short != long).any(1).sum() > 0


def test_an_artefact_is_named_by_its_inputs(tmp_path):
    """The same name and parameters computed from other inputs are another artefact, in memory
    and on disk; the same inputs find the one built."""
    x, lab = clustered(200, 8)
    searcher = build(tmp_path / "idx", x, lab)
    space = SearcherSpace(searcher, "trained", {}, "bilinear", cache_dir=tmp_path / "cache")
    assert space.digest("a", {"k": 1}, ("x",)) != space.digest("a", {"k": 1}, ("y",))
    assert space.digest("a", {"k": 1}) != space.digest("a", {"k": 2})
    built = []

    def make(v):
        def build_it():
            built.append(v)
            return {"v": np.array([v])}
        return build_it
    assert space.artefact("a", {"k": 1}, make(1), inputs=("x",))["v"][0] == 1
    assert space.artefact("a", {"k": 1}, make(2), inputs=("y",))["v"][0] == 2
    assert space.artefact("a", {"k": 1}, make(3), inputs=("x",))["v"][0] == 1
    CACHE.clear()  # a new process: from the disk, each under its own inputs
    assert space.artefact("a", {"k": 1}, make(4), inputs=("y",))["v"][0] == 2
    assert built == [1, 2]
    other = SearcherSpace(searcher, "identity", {}, "bilinear", cache_dir=tmp_path / "cache")
    assert other.digest("a", {"k": 1}, ("x",)) != space.digest("a", {"k": 1}, ("x",))


def test_the_disk_cache_keeps_within_its_budget_least_recently_used_first(tmp_path):
    root = tmp_path / "rerank"
    files = []
    for i, name in enumerate(("s1/knn-a.npz", "s1/sets-b.npz", "s2/knn-c.npz", "milvus-k/features.npy")):
        f = root / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"x" * 1000)
        os.utime(f, (time.time() - 100 + i, time.time() - 100 + i))  # oldest first
        files.append(f)
    mine = root / "s3" / "notes.txt"  # not the cache's: never counted or deleted
    mine.parent.mkdir()
    mine.write_text("keep")
    gone = prune(root, budget=2500, keep=files[0])
    assert sorted(gone) == sorted(files[1:3])  # the least recently used, but never the one kept
    assert files[0].is_file() and files[3].is_file() and mine.is_file()
    assert not (root / "s2").exists() and (root / "s1").is_dir()
    assert prune(root, budget=10**6) == []


def test_the_store_prunes_after_each_write(tmp_path, monkeypatch):
    x, lab = clustered(300, 8)
    searcher = build(tmp_path / "idx", x, lab)
    space = SearcherSpace(searcher, "trained", {}, "bilinear", cache_dir=tmp_path / "cache")
    monkeypatch.setenv("DML_CACHE_DISK", "3K")
    for v in range(6):
        space.artefact("blob", {"v": v}, lambda: {"a": np.zeros(256, np.float32)})  # about 1.3 kB each
    left = sorted(p.name for p in space.store.dir.glob("*.npz"))
    assert len(left) == 2 and space.store.path("blob", space.digest("blob", {"v": 5})).name in left


def test_a_gallery_dropped_by_its_owner_is_freed(tmp_path):
    """Its metric spaces refer to it; they must not keep it alive."""
    x, lab = clustered(200, 8)
    searcher = build(tmp_path / "idx", x, lab)
    q = x[:3]
    for strategy, mode in (("trained", "cosine"), ("identity", "bilinear")):
        rerank("kreciprocal", gallery_space(searcher, strategy, {}, mode), q, 5, params={"k1": 6, "k2": 3})
    gone = weakref.ref(searcher)
    del searcher
    gc.collect()
    assert gone() is None


def test_the_lists_built_killed_and_resumed_equal_one_built_in_one_go(tmp_path, monkeypatch):
    """The exact pass writes a block of items at a time; a build cut short (Ctrl-C) after two
    blocks resumes from the third and gives the lists built in one go, bit for bit."""
    import index.rerankers.neighbours as nb

    monkeypatch.setattr(nb, "BLOCK", 64)
    x, lab = clustered(500, 8)
    searcher = build(tmp_path / "idx", x, lab)
    whole = nb.neighbour_lists(SearcherSpace(searcher, "trained", {}, "cosine", cache_dir=tmp_path / "a"), 40)
    CACHE.clear()
    space = SearcherSpace(searcher, "trained", {}, "cosine", cache_dir=tmp_path / "b")
    calls, cut = [], [True]
    exact = nb.searched_lists

    def cut_after_two(sp, items, Ls):
        calls.append(int(items[0]))
        if cut[0] and len(calls) == 3:
            raise KeyboardInterrupt
        return exact(sp, items, Ls)
    monkeypatch.setattr(nb, "searched_lists", cut_after_two)
    with pytest.raises(KeyboardInterrupt):
        nb.neighbour_lists(space, 40)
    assert calls == [0, 64, 128]
    calls.clear()
    cut[0] = False
    resumed = nb.neighbour_lists(space, 40)
    assert calls[0] == 128 and len(calls) == len(range(128, 500, 64))  # from the block it was cut in
    np.testing.assert_array_equal(resumed.rows, whole.rows)
    np.testing.assert_array_equal(resumed.sims, whole.sims)
    assert resumed.digest == whole.digest  # the same inputs: the same artefact
    assert not list(space.store.dir.glob("*.part"))  # whole now: the blocks' folder is gone


def test_the_graph_command_builds_what_searches_read(tmp_path, monkeypatch):
    from support import run_command

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    x, lab = clustered(300, 8)
    build(tmp_path / "idx", x, lab)
    r = run_command("index", "graph", "--index", tmp_path / "idx", "--length", "40", "--no-progress",
                    cwd=tmp_path, env={"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert r.returncode == 0, r.stderr
    assert "neighbour lists: 300 items × 40" in r.stdout and "row extremes: 300 items" in r.stdout
    stored = list((tmp_path / "xdg" / "dml-retrieval" / "rerank").glob("*/knn-*.blocks"))
    assert len(stored) == 1
    r = run_command("index", "graph", "--index", tmp_path / "idx", "--length", "0", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: --length must be ≥ 1")


@pytest.mark.parametrize("rerank,params,dim,need,what", [
    ("dba", {"n": 2}, 256, 400 * (256 + 2) * 4, "dba: the augmented gallery"),
    ("diffusion", {"k": 50}, 8, 400 * (50 * 12 + 16), "diffusion: the gallery's k-NN graph"),
    ("kreciprocal", {"k1": 60, "k2": 6}, 8, 400 * 61 * 12, "kreciprocal: the gallery's k-reciprocal sets"),
])
def test_the_budget_refuses_an_artefact_it_cannot_hold_before_building_it(tmp_path, monkeypatch, rerank, params,
                                                                          dim, need, what):
    """An offline artefact larger than the whole memory budget is refused in one line, naming it
    and the budget, before it is built (never built, used once and dropped)."""
    from index.rerankers import rerank as run

    x, lab = clustered(400, dim)
    searcher = build(tmp_path / "idx", x, lab)
    space = SearcherSpace(searcher, "trained", {}, "cosine", cache_dir=tmp_path / "cache")
    lists = 400 * 64 * 8 + 400 * 20  # the lists and row extremes every re-ranker here reads: they fit
    assert need > lists
    monkeypatch.setattr(CACHE, "budget", (lists + need) // 2)
    with pytest.raises(UserError, match=rf"^{what} \(400 items.* would take .* GiB, above the memory budget "
                                        r"\(--cache-memory [0-9.]+G\); raise --cache-memory") as e:
        run(rerank, space, x[:2], 5, params=params)
    assert "\n" not in str(e.value)
    built = sorted(p.name.split("-")[0] for p in space.store.dir.glob("*.npz")) if space.store.dir.is_dir() else []
    assert set(built) <= {"knn", "extremes"}  # nothing of the refused artefact was written
