"""The analyses' results in the process's one memory cache: the same comparison runs once however
many threads ask, two different ones run at the same time, keys are digests, the sweep reads the
features without copying them, and the why panel's eigendecomposition is made once per pair."""
import dataclasses
import threading

import numpy as np
import pytest

import index.analysis.compare as compare
import index.analysis.explain as explain
from index.analysis.compare import Comparer, data_digest
from index.analysis.explain import Explainer
from index.backends.search import Searcher
from index.backends.store import in_memory_index, read_index
from index.search_config import SearchConfig
from index.space import CACHE


@pytest.fixture()
def data():
    rng = np.random.default_rng(3)
    y = np.repeat(np.arange(8), 4)
    X = rng.normal(size=(8, 16))[y] + 0.7 * rng.normal(size=(32, 16))
    return in_memory_index(X, y, rng.normal(size=(5, 16)), normalize=True)


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # re-rankers' offline state
    CACHE.clear()  # what other tests computed over an equal gallery


def together(*calls) -> list:
    """Each call in its own thread, released at once; their results in order."""
    start, out = threading.Barrier(len(calls)), [None] * len(calls)

    def run(i):
        start.wait()
        out[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_the_same_comparison_asked_twice_at_once_runs_once(data, monkeypatch):
    runs = []
    reranked = Comparer._compute_reranked

    def counted(self, cfg, progress):
        runs.append(cfg.label())
        threading.Event().wait(0.2)  # the second caller arrives while it runs
        return reranked(self, cfg, progress)

    monkeypatch.setattr(Comparer, "_compute_reranked", counted)
    right = SearchConfig("trained", {}, "cosine", "aqe", {"n": 2})
    # two Comparers over the same gallery (two requests, two services): one cache entry
    a, b = together(lambda: Comparer(data).compare(SearchConfig(), right, k=5),
                    lambda: Comparer(data).compare(SearchConfig(), right, k=5))
    assert len(runs) == 1
    np.testing.assert_array_equal(a.ap_b, b.ap_b)
    assert Comparer(data).holds(right)


def test_two_different_comparisons_run_at_the_same_time(data, monkeypatch):
    """Each pass waits at a barrier for the other: a lock held over a whole pass would break it."""
    both = threading.Barrier(2, timeout=20)
    reranked = Comparer._compute_reranked

    def meet(self, cfg, progress):
        both.wait()
        return reranked(self, cfg, progress)

    monkeypatch.setattr(Comparer, "_compute_reranked", meet)
    c = Comparer(data)
    one, two = SearchConfig("trained", {}, "cosine", "aqe", {"n": 1}), SearchConfig("trained", {}, "cosine", "aqe",
                                                                                    {"n": 3})
    a, b = together(lambda: c.ap(one), lambda: c.ap(two))
    assert not both.broken and a is not None and b is not None and not np.array_equal(a, b)


def test_keys_are_digests_of_what_made_the_value(data):
    c = Comparer(data, Searcher(data))
    c.compare(SearchConfig(), SearchConfig("identity", {}, "cosine", "aqe", {"n": 1}))
    ex = Explainer(Searcher(data))
    ex.why(np.asarray(data.features[:1]), 3, SearchConfig(), SearchConfig("identity", {}, "cosine"), top=2)
    mine = [k for k in CACHE._entries if k[0] in ("analysis.compare", "analysis.explain")]
    assert {k[0] for k in mine} == {"analysis.compare", "analysis.explain"}
    assert all(isinstance(k, tuple) and all(isinstance(p, str) for p in k) for k in mine)
    # an equal gallery (another object) finds them; another gallery does not
    twin = dataclasses.replace(data, features=np.array(data.features))
    assert data_digest(twin) == data_digest(data)
    assert Comparer(twin).holds(SearchConfig("identity", {}, "cosine", "aqe", {"n": 1}))
    other = in_memory_index(np.asarray(data.features)[::-1], data.items.labels, data.W, normalize=True)
    assert not Comparer(other).holds(SearchConfig("identity", {}, "cosine", "aqe", {"n": 1}))


def test_the_batched_sweep_reads_the_index_features_without_a_copy(tiny_index, monkeypatch):
    d = read_index(tiny_index)
    sweeps = []
    init = compare.QuerySweep.__init__

    def seen(self, *a, **kw):
        init(self, *a, **kw)
        sweeps.append(self)

    monkeypatch.setattr(compare.QuerySweep, "__init__", seen)
    c = Comparer(d)
    assert c.batched()
    c.per_query_ap("identity", {}, "cosine")
    c.per_query_ap("identity", {}, "bilinear")
    assert len(sweeps) == 2 and all(np.shares_memory(s.phi, d.features) for s in sweeps)
    # ΦΦᵀ, read by both settings, is made once and kept in the cache (each sweep's buffers are its own)
    assert sweeps[0]._G is sweeps[1]._G is CACHE.peek(("analysis.compare", compare.key_hash(c.key, "gram")))
    assert sweeps[0]._G is not None


def test_one_eigendecomposition_per_pair_of_metrics(data, monkeypatch):
    made = []
    of = explain.Eigenspaces.of

    def counted(Ma, Mb, *a):
        made.append(1)
        return of(Ma, Mb, *a)

    monkeypatch.setattr(explain.Eigenspaces, "of", staticmethod(counted))
    left, right = SearchConfig("trained", {}, "cosine"), SearchConfig("random", {"r": 0.6, "seed": 2}, "bilinear")
    q = np.asarray(data.features[4:5])
    first = Explainer(Searcher(data)).why(q, 7, left, right, self_row=4, top=3)
    again = Explainer(Searcher(data)).why(q, 9, left, right, self_row=4, top=3)  # another request
    assert len(made) == 1
    assert first.change is not None and again.change is not None
    assert first.strips == Explainer(Searcher(data)).why(q, 7, left, right, self_row=4, top=3).strips
