"""Mixed requests at once, as an app serves them: six threads started together, each sending
every request (re-rankers with different parameters, strategies, modes, leave-one-out queries)
in its own order, on the in-RAM index, the on-disk IVF and Milvus Lite, under a memory budget
far below what the requests keep, so entries are evicted and rebuilt while others read them.
Every answer is the one the same request gives alone, computed first in an empty cache."""
import random
import threading
import traceback

import faiss
import numpy as np
import pytest

from index.backends.gallery import Hits
from index.backends.search import Searcher
from index.backends.store import Items, read_index, write_index
from index.search_config import SearchConfig
from index.space import CACHE, memory_budget, set_memory_budget

N, DIM, K, THREADS = 160, 16, 8, 6
SHRINK = {"alpha": 0.3}
REQUESTS = [  # strategy, its parameters, mode, re-ranker, its parameters
    ("trained", {}, "cosine", "kreciprocal", {"k1": 6, "k2": 3}),
    ("trained", {}, "cosine", "kreciprocal", {"k1": 10, "k2": 1}),
    ("identity", {}, "bilinear", "kreciprocal", {"k1": 8, "k2": 2, "pool": 40}),
    ("shrink", SHRINK, "cosine", "diffusion", {}),
    ("identity", {}, "cosine", "diffusion", {"k": 10, "truncation": 60}),
    ("trained", {}, "bilinear", "dba", {"n": 3}),
    ("shrink", SHRINK, "cosine", "aqe", {"n": 2}),
    ("identity", {}, "cosine", "aqe", {"n": 4, "alpha": 3}),
    ("shrink", SHRINK, "bilinear", "none", {}),
    ("trained", {}, "cosine", "none", {}),
]
OWN = np.array([3, 77, 150])  # gallery items asked as queries, each left out of its own answer


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    t = tmp_path_factory.mktemp("mixed")
    rng = np.random.default_rng(3)
    centres = rng.standard_normal((8, DIM))
    lab = rng.integers(0, 8, N)
    X = (centres[lab] + 0.8 * rng.standard_normal((N, DIM))).astype(np.float32)
    items = Items(np.arange(N), lab, [f"img/{i}.png" for i in range(N)], ["gallery"] * N)
    idx = write_index(t / "idx", X, items, rng.standard_normal((6, DIM)).astype(np.float32), normalize=True,
                      info={"backbone": "none"}, class_names={c: f"c{c}" for c in range(8)})
    return t, idx, rng.standard_normal((5, DIM)).astype(np.float32)


def ram(t, idx):
    return Searcher(read_index(idx)), lambda: None


def ondisk(t, idx):
    from index.backends.ondisk import OnDiskIVF, build_for_index

    cosine = tuple({(s, tuple(sorted(p.items()))) for s, p, mode, _, _ in REQUESTS if mode == "cosine"})
    out = build_for_index(idx, t / "ivf", cosine_for=tuple((s, dict(p)) for s, p in cosine), nlist=4)
    return OnDiskIVF(out, nprobe=2), lambda: None


def milvus(t, idx):
    pytest.importorskip("pymilvus", reason="the Milvus backend needs pymilvus and milvus-lite: "
                                           "pip install -r requirements-milvus.txt")
    from index.backends.milvus_store import MilvusGallery, export_index

    uri = str(t / "mixed.db")
    export_index(idx, uri, "mixed")
    g = MilvusGallery(uri, "mixed")
    return g, g.close


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    """The re-rankers' offline caches under the test's folder, never the user's; the memory
    budget as it was afterwards."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    budget = memory_budget()
    CACHE.clear()
    yield
    set_memory_budget(budget)
    CACHE.clear()


@pytest.mark.parametrize("backend", [ram, ondisk, pytest.param(milvus, marks=pytest.mark.milvus)],
                         ids=["ram", "ondisk", "milvus"])
def test_mixed_requests_from_six_threads_give_each_request_its_answer_alone(index_dir, backend, tmp_path,
                                                                            monkeypatch):
    import index.rerankers.diffusion as diffusion
    import index.rerankers.kreciprocal as kreciprocal
    import index.rerankers.kreciprocal.sets as sets
    from index import threads

    # small batches: each re-ranked call and each offline pass runs several, in the shared pool
    monkeypatch.setattr(kreciprocal, "BATCH", 2)
    monkeypatch.setattr(kreciprocal, "MAX_BATCH", 2)
    monkeypatch.setattr(sets, "SET_CELLS", 2000)
    monkeypatch.setattr(diffusion, "BATCH_CELLS", 2 * N)
    pooled = []
    in_threads = threads.in_threads

    def recorded(fn, items):
        def run(a):
            pooled.append(threading.current_thread().name)
            return fn(a)
        return in_threads(run, items)

    for module in (kreciprocal, sets, diffusion):
        monkeypatch.setattr(module, "in_threads", recorded)
    # a client thread's own FAISS setting (below) stands: no serving process's setting from an
    # earlier test in this process (the app's start-up) applies to request threads here
    monkeypatch.setattr(threads, "_serving_faiss", None)
    t, idx, Q = index_dir
    gallery, close = backend(t, idx)
    try:
        data = read_index(idx)
        own_q = np.asarray(data.features[OWN])
        calls = []
        for strategy, params, mode, rerank, rparams in REQUESTS:
            cfg = SearchConfig.of(strategy, params, mode, rerank, rparams, strict=True)
            calls += [(cfg, Q, None), (cfg, own_q, OWN)]

        def ask(i: int):
            cfg, q, self_ids = calls[i]
            return cfg.search(gallery, q, K, self_ids=self_ids)

        CACHE.clear()
        alone = [ask(i) for i in range(len(calls))]  # each request alone, in a fresh cache
        held = CACHE.used
        budget = held // 6
        assert budget > 0  # the requests keep state: a budget of a sixth of it evicts
        # a fresh cache, in memory and on disk: the threads build every artefact themselves
        CACHE.clear()
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-concurrent"))
        set_memory_budget(budget)
        start = threading.Barrier(THREADS)
        got: dict[tuple[int, int], Hits] = {}
        errors: list[tuple[int, int, BaseException]] = []

        def client(c: int):
            faiss.omp_set_num_threads(2)  # (this thread's alone) the re-rankers' batches in the shared pool
            order = list(range(len(calls)))
            random.Random(c).shuffle(order)
            start.wait()
            for i in order:
                try:
                    got[c, i] = ask(i)
                except BaseException as e:  # every failure reported, with its request
                    errors.append((c, i, e))

        pooled.clear()
        ts = [threading.Thread(target=client, args=(c,)) for c in range(THREADS)]
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        assert CACHE.used <= budget
        assert not errors, "\n".join(
            f"{calls[i][0].label()} ({'leave-one-out' if calls[i][2] is not None else 'queries'}, thread {c}):\n"
            + "".join(traceback.format_exception(e)) for c, i, e in errors[:3]) + f"\n({len(errors)} failed)"
        for (c, i), hits in got.items():
            want = alone[i]
            np.testing.assert_array_equal(hits.rows, want.rows, err_msg=f"{calls[i][0].label()} (thread {c})")
            np.testing.assert_allclose(hits.scores, want.scores, rtol=0, atol=1e-6,
                                       err_msg=f"{calls[i][0].label()} (thread {c})")
        assert len(got) == THREADS * len(calls)
        assert any(name.startswith("index-batch") for name in pooled)  # batches ran in the shared pool
    finally:
        close()
