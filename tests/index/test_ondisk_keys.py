"""Re-rankers on the on-disk IVF without every gallery key in RAM: where the keys would take more
than their share of the memory budget, full-gallery scores stream the memory-mapped features
block by block (index/space/searcher_space.py) and give the in-RAM answers bit for bit."""
import dataclasses
import mmap

import numpy as np
import pytest

from index.backends.ondisk import OnDiskIVF, build_for_index
from index.backends.store import Items, write_index
from index.rerankers import RERANKERS
from index.search_config import SearchConfig
from index.space import CACHE, SearcherSpace, memory_budget, set_memory_budget
from index.space import searcher_space as ss
from index.space.pages import read_rows

N, DIM, NLIST, K = 400, 128, 8, 5
KEY_BYTES = N * DIM * 4  # 200 KiB
SMALL = 2 * KEY_BYTES - 4096  # keys above half of it; the neighbour lists (N × 32 × 8 = 100 KiB) within it
# the keys within half of it, k-reciprocal's pair matrix (N² × 4 = 625 KiB) above its 1/32 under both
# budgets: the two runs then differ in where the keys are read from alone
LARGE = 16 << 20
# each re-ranker at settings small enough for 400 items
PARAMS = {"none": {}, "aqe": {"n": 3, "alpha": 1.0}, "dba": {"n": 2}, "diffusion": {"k": 8, "kq": 4, "truncation": 60},
          "diffusion_offline": {"k": 8, "kq": 4, "item_truncation": 60}, "kreciprocal": {"k1": 6, "k2": 2}}


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    t = tmp_path_factory.mktemp("ondisk_keys")
    rng = np.random.default_rng(3)
    centres = rng.normal(size=(12, DIM))
    lab = rng.integers(0, 12, N)
    X = (centres[lab] + 0.8 * rng.normal(size=(N, DIM))).astype(np.float32)
    items = Items(np.arange(N), lab, [f"img/{i}.png" for i in range(N)], ["test"] * N)
    idx = write_index(t / "idx", X, items, rng.normal(size=(8, DIM)).astype(np.float32), normalize=True,
                      info={"backbone": "none"})
    build_for_index(idx, nlist=NLIST)
    return idx


@pytest.fixture(autouse=True)
def budget(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    before = memory_budget()
    CACHE.clear()
    yield
    set_memory_budget(before)
    CACHE.clear()


def open_ivf(index_dir) -> OnDiskIVF:
    g = OnDiskIVF(index_dir / "ivf_ondisk", rerank_factor=N)
    g.nprobe = NLIST  # every list probed
    return g


def run_all(index_dir, mode: str) -> dict:
    """Every registered re-ranker on a fresh on-disk gallery (its offline store empty): queries
    that are gallery items (left out of their own lists) and two that are not."""
    g = open_ivf(index_dir)
    X = np.asarray(g.features[[3, 50, 222]])
    q = np.vstack([X, np.random.default_rng(1).normal(size=(2, DIM)).astype(np.float32)])
    own = np.array([3, 50, 222, -1, -1])
    out = {}
    for name in RERANKERS.names():
        cfg = SearchConfig.of("spectral", {"p": 0.5}, mode, name, PARAMS[name])
        h = cfg.search(g, q, K, self_ids=own)
        out[name] = (h.rows, h.scores, cfg.space(g))
    return out


def test_every_registered_reranker_is_tried_here():
    assert set(PARAMS) == set(RERANKERS.names())


@pytest.mark.parametrize("mode", ["cosine", "bilinear"])
def test_every_reranker_gives_the_in_ram_answer_without_holding_the_keys(index_dir, mode, monkeypatch, tmp_path):
    # several blocks of 64 rows per full scan, under both budgets: the same products (a block of
    # another shape may sum in another order, to float32 round-off)
    monkeypatch.setattr(ss, "SCAN_CELLS", 64 * DIM)
    set_memory_budget(LARGE)
    want = run_all(index_dir, mode)
    assert want["kreciprocal"][2].held("keys")  # within the budget: the keys are kept
    CACHE.clear()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-small"))  # every offline pass again
    set_memory_budget(SMALL)

    def refused(self):
        raise AssertionError("the keys were built in RAM under a budget they exceed")
    monkeypatch.setattr(SearcherSpace, "keys", property(refused))
    got = run_all(index_dir, mode)
    for name in RERANKERS.names():
        assert not got[name][2].keys_fit() and not got[name][2].held("keys"), name
        np.testing.assert_array_equal(got[name][0], want[name][0], err_msg=name)
        np.testing.assert_array_equal(got[name][1], want[name][1], err_msg=name)


@pytest.mark.parametrize("mode", ["cosine", "bilinear"])
def test_a_streamed_full_score_equals_the_held_keys_bit_for_bit(index_dir, mode, monkeypatch):
    monkeypatch.setattr(ss, "SCAN_CELLS", 100 * DIM)  # blocks of 100 rows: the last one short
    g = open_ivf(index_dir)
    space = g.metric_space("spectral", {"p": 0.5}, mode)
    q = space.prepare(np.random.default_rng(2).normal(size=(7, DIM)))
    set_memory_budget(SMALL)
    streamed = space.score(q)
    assert not space.held("keys")
    set_memory_budget(LARGE)
    held = space.score(q)
    assert space.held("keys")
    np.testing.assert_array_equal(streamed, held)
    # and against an independent float64 computation: s = t(q) · key(x)
    X = np.asarray(g.features, dtype=np.float64)
    M = space.searcher.metric("spectral", {"p": 0.5}).M.astype(np.float64)
    if mode == "cosine":
        X = X / np.sqrt(np.einsum("ij,jk,ik->i", X, M, X))[:, None]
    np.testing.assert_allclose(streamed, space.transform(q).astype(np.float64) @ X.T, rtol=1e-4, atol=1e-5)


def test_rows_read_from_a_file_map_equal_the_file_and_leave_arrays_in_ram_alone(tmp_path):
    X = np.random.default_rng(4).normal(size=(3000, 64)).astype(np.float32)
    np.save(tmp_path / "x.npy", X)
    memmap = np.load(tmp_path / "x.npy", mmap_mode="r")
    with open(tmp_path / "x.npy", "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mapped = np.frombuffer(mm, dtype="<f4", count=X.size, offset=memmap.offset).reshape(X.shape)
    in_ram = X.copy()
    for src in (memmap, mapped, in_ram):
        for a, b in ((0, 1), (5, 700), (699, 3000), (2999, 3000)):
            got = read_rows(src, a, b)
            assert got.dtype == np.float32 and got.flags.c_contiguous and got.base is None
            np.testing.assert_array_equal(got, X[a:b])
        np.testing.assert_array_equal(src, X)  # read again after its pages were released
    del mapped
    mm.close()


@pytest.mark.parametrize("mode", ["cosine", "bilinear"])
@pytest.mark.parametrize("backend", ["ram", "ondisk"])
def test_scores_of_candidate_rows_read_in_place_match_a_float64_computation(index_dir, mode, backend):
    from index.backends.search import Searcher
    from index.backends.store import read_index
    if backend == "ondisk":
        g = open_ivf(index_dir)
    else:  # the features as one array in RAM
        data = read_index(index_dir)
        g = Searcher(dataclasses.replace(data, features=np.array(data.features)))
    space = g.metric_space("spectral", {"p": 0.5}, mode)
    assert space.searcher.data.features.flags.writeable == (backend == "ram")  # a file map on disk
    q = space.prepare(np.random.default_rng(5).normal(size=(6, DIM)))
    rows = np.random.default_rng(6).integers(0, N, (6, 40))
    rows[1, 3] = rows[4, 0] = -1  # no candidate there
    set_memory_budget(SMALL)
    assert space._scores_in_place(space.transform(q), rows) is not None  # FAISS reads the features in place
    streamed = space.score(q, rows)
    assert not space.held("keys")
    set_memory_budget(LARGE)
    space.keys  # noqa: B018 (held now)
    assert space.held("keys")
    np.testing.assert_array_equal(space.score(q, rows), streamed)  # held keys or not, the same products
    X = np.asarray(space.searcher.data.features, dtype=np.float64)
    M = space.searcher.metric("spectral", {"p": 0.5}).M.astype(np.float64)
    if mode == "cosine":
        X = X / np.sqrt(np.einsum("ij,jk,ik->i", X, M, X))[:, None]
    want = np.einsum("qd,qmd->qm", space.transform(q).astype(np.float64), X[np.maximum(rows, 0)])
    assert np.isneginf(streamed[rows < 0]).all() and np.isfinite(streamed[rows >= 0]).all()
    np.testing.assert_allclose(streamed[rows >= 0], want[rows >= 0], rtol=1e-4, atol=1e-5)
    # one row's 1-D scores (a BLAS product over gathered keys) agree to float32 round-off
    np.testing.assert_allclose(streamed[2], space.score(q[2:3], rows[2])[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(IndexError):
        space.score(q, np.full((6, 2), N))
