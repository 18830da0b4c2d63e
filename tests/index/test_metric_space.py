"""The metric-space layer (index/space): one memory cache with a byte budget, least recently
used evicted first, each artefact built once however many threads ask; and concurrent
searches that differ only in λ or in strategy give, row for row, the sequential answers."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import faiss
import numpy as np
import pytest

from core.errors import UserError
from core.memory import ARRAY_ENTRY, ROW_ENTRY, ROW_SHARE, MemoryCache, row_bytes
from index.backends.search import Searcher
from index.backends.store import in_memory_index
from index.rerankers import rerank
from index.space import CACHE, SearcherSpace, parse_bytes, set_memory_budget


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    CACHE.clear()


def gallery(n=300, d=16, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(10, d))
    lab = rng.integers(0, 10, n)
    x = (centres[lab] + 0.7 * rng.normal(size=(n, d))).astype(np.float32)
    W = rng.normal(size=(6, d)).astype(np.float32)
    return Searcher(in_memory_index(x, lab, W)), x


# ---------------------------------------------------------------- the cache
def test_entries_are_evicted_least_recently_used_first_by_bytes():
    c = MemoryCache(budget=1000)
    for k in "abc":
        c.get_or_build(k, lambda: np.zeros(300, np.uint8))
    assert c.used == 900
    c.peek("a")  # a is now the most recent: b goes first
    c.get_or_build("d", lambda: np.zeros(300, np.uint8))
    assert c.peek("b") is None and all(c.peek(k) is not None for k in "acd")
    assert c.used == 900
    big = c.get_or_build("e", lambda: np.zeros(2000, np.uint8))  # above the budget: returned, not kept
    assert len(big) == 2000 and c.peek("e") is None and c.used == 900
    small = c.get_or_build("f", lambda: np.zeros(10, np.uint8), max_bytes=5)  # above its own cap
    assert c.peek("f") is None and len(small) == 10
    c.set_budget(400)
    assert c.used <= 400


def test_an_evicted_value_a_reader_holds_stays_counted_until_it_lets_go():
    c = MemoryCache(budget=1000)
    a = c.get_or_build("a", lambda: np.zeros(600, np.uint8))  # a request reads it
    c.get_or_build("b", lambda: np.zeros(600, np.uint8))  # evicts a, which the reader still holds
    assert c.peek("b") is not None and c.used == 1200 and c.held_bytes == 600
    c.get_or_build("c", lambda: np.zeros(300, np.uint8))  # b, which nobody reads, makes room for it
    assert c.peek("b") is None and c.used == 900
    del a
    assert c.used == 300 and c.held_bytes == 0
    # a reader that keeps one array of a value it unpacked holds that value's memory too
    rows, sims = c.get_or_build("t", lambda: (np.zeros(400, np.uint8), np.zeros(200, np.uint8)))
    c.get_or_build("u", lambda: np.zeros(900, np.uint8))
    assert c.held_bytes == 600
    del rows
    assert c.held_bytes == 600  # the value is let go when its last array is
    del sims
    assert c.held_bytes == 0 and c.used == 900


def test_a_reader_that_keeps_one_object_of_a_value_holds_the_value():
    """A strategy's M′ is cached as (metric, [its arrays]) and read as `refined[0]`."""
    class Metric:
        pass
    c = MemoryCache(budget=1000)
    metric = c.get_or_build("m", lambda: (Metric(), [np.zeros(600, np.uint8)]))[0]
    c.get_or_build("b", lambda: np.zeros(600, np.uint8))
    assert c.held_bytes == 600
    del metric
    assert c.held_bytes == 0 and c.used == 600


def test_a_held_value_asked_for_again_is_given_back_not_built_twice():
    c = MemoryCache(budget=1000)
    a = c.get_or_build("a", lambda: np.zeros(600, np.uint8))
    c.get_or_build("b", lambda: np.zeros(600, np.uint8))
    again = c.get_or_build("a", lambda: pytest.fail("built a second copy"))
    assert again is a and c.peek("b") is None and c.used == 600 and c.held_bytes == 0
    c.get_or_build("b", lambda: np.zeros(600, np.uint8))  # a evicted, held again
    assert c.peek("a") is a and c.peek("b") is None and c.used == 600  # peek gives it back too
    # a give-back first forgets what readers let go: b, held and then let go, evicts nothing
    b = c.get_or_build("b", lambda: np.zeros(600, np.uint8))
    c.get_or_build("x", lambda: np.zeros(300, np.uint8))  # evicts a (held) and b (held)
    assert c.held_bytes == 1200
    del b
    assert c.get_or_build("a", lambda: pytest.fail("built a second copy")) is a
    assert c.peek("x") is not None and c.used == 900


def test_a_build_too_large_to_keep_evicts_nothing_for_its_reservation():
    c = MemoryCache(budget=1000)
    c.get_or_build("a", lambda: np.zeros(600, np.uint8))
    big = c.get_or_build("big", lambda: np.zeros(1500, np.uint8), reserve=1500)
    assert len(big) == 1500 and c.peek("a") is not None and c.used == 600


def test_a_comparisons_gram_counts_from_its_build_and_while_its_sweep_reads_it(monkeypatch):
    from index.analysis.compare import QuerySweep

    rng = np.random.default_rng(0)
    n = 60
    sweep = QuerySweep(rng.normal(size=(n, 8)).astype(np.float32), rng.integers(0, 4, n),
                       rng.normal(size=(3, 8)).astype(np.float32), key="gallery")
    before = CACHE.budget
    try:
        CACHE.set_budget(n * n * 4 + 1000)
        CACHE.get_or_build("older", lambda: np.zeros(2000, np.uint8))
        during = []
        build = QuerySweep.new_gram
        monkeypatch.setattr(QuerySweep, "new_gram", lambda self: during.append(CACHE.peek("older") is None)
                            or build(self))
        G = sweep.gram()
        assert during == [True]  # the older entry made room before the Gram was built
        assert np.allclose(G, sweep.phi @ sweep.phi.T, atol=1e-5)
        CACHE.get_or_build("newer", lambda: np.zeros(n * n * 4, np.uint8))  # evicts the Gram
        del G
        assert CACHE.held_bytes == n * n * 4  # the sweep still reads it
        del sweep
        assert CACHE.held_bytes == 0
    finally:
        CACHE.set_budget(before)


def test_a_held_value_of_a_dropped_owner_is_forgotten():
    c = MemoryCache(budget=1000)
    owner = object()
    v = c.get_or_build((owner, "norms"), lambda: np.zeros(600, np.uint8))
    c.get_or_build("b", lambda: np.zeros(600, np.uint8))
    assert c.held_bytes == 600
    c.drop_owner(owner)
    assert c.held_bytes == 0 and c.used == 600
    del v


def test_a_value_another_object_holds_too_is_not_counted_after_its_eviction():
    """An array the cache did not make (a gallery's own, kept by the gallery for its life) would
    stay counted for ever: eviction cannot free it, and it would shrink the budget for good."""
    own = np.zeros(600, np.uint8)
    c = MemoryCache(budget=1000)
    c.get_or_build("own", lambda: own)
    c.get_or_build("b", lambda: np.zeros(600, np.uint8))
    assert c.peek("own") is None and c.held_bytes == 0 and c.used == 600


def test_a_build_that_declares_its_size_makes_room_before_it_runs():
    c = MemoryCache(budget=1000)
    for k in "abc":
        c.get_or_build(k, lambda: np.zeros(300, np.uint8))
    during = []

    def build():
        during.append((c.used, [k for k in "abc" if c.peek(k) is not None]))
        return np.zeros(500, np.uint8)
    c.get_or_build("big", build, reserve=500)
    assert during == [(300 + 500, ["c"])]  # a and b went before the build began, not after
    assert c.used == 800 and c.peek("big") is not None
    assert c.get_or_build("big", lambda: 1 / 0, reserve=500) is not None  # found: nothing reserved
    assert c.used == 800

    def fails():
        raise RuntimeError("no")
    with pytest.raises(RuntimeError):
        c.get_or_build("x", fails, reserve=100)
    assert c.used == 800  # a failed build's reservation is returned


def test_a_reservation_is_returned_when_a_build_fails_and_its_waiter_builds_again():
    c = MemoryCache(budget=1000)
    started, go = threading.Event(), threading.Event()
    seen = []

    def failing():
        started.set()
        go.wait(5)
        seen.append(c.used)  # the reservation counted while the build runs
        raise RuntimeError("no")

    def fine():
        return np.zeros(200, np.uint8)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(c.get_or_build, "k", failing, reserve=300)
        assert started.wait(5)
        second = pool.submit(c.get_or_build, "k", fine, reserve=300)  # waits for the first build
        time.sleep(0.1)
        go.set()
        with pytest.raises(RuntimeError):
            first.result(5)
        assert len(second.result(5)) == 200  # the failed build's waiter built it itself
    assert seen == [300] and c.used == 200 and c.peek("k") is not None


def test_rows_read_by_row_count_against_the_one_budget_and_keep_to_their_share():
    """The rows an engine's gallery is read by (core.memory.rows_put) are held in the same budget
    as the entries: together never above it, the rows never above their share, least recently
    used first, each row's size its data and the interpreter's bytes around it."""
    c = MemoryCache(budget=40_000)
    row = lambda r: (np.full(64, r, np.int32), np.full(64, r, np.float32))  # noqa: E731
    each = row_bytes(row(0))
    assert each == ROW_ENTRY + 2 * (ARRAY_ENTRY + 256)
    c.get_or_build("M", lambda: np.zeros(30_000, np.uint8))
    share = 40_000 // ROW_SHARE
    c.rows_put("lists", np.arange(5), [row(r) for r in range(5)])
    assert c.rows_used == 5 * each <= share and c.used == 30_000 + 5 * each
    # past the share: the oldest rows go, not the entry
    c.rows_put("lists", np.arange(5, 40), [row(r) for r in range(5, 40)])
    kept = share // each
    assert c.rows_used == kept * each and c.peek("M") is not None
    found, values = c.rows_get("lists", np.arange(40))
    np.testing.assert_array_equal(np.flatnonzero(found), np.arange(40 - kept, 40))
    assert [int(v[0][0]) for v in values] == list(range(40 - kept, 40))
    # another space's row 39 is another row
    assert not c.rows_get("vectors", np.array([39]))[0].any()
    # read through: the held rows come from here, only the others are fetched, and then kept
    asked: list[list[int]] = []
    got = c.rows_through("lists", np.array([37, 38, 39, 41]), lambda m: asked.append(m.tolist()) or [row(r) for r in m])
    assert asked == [[41]] and [int(v[0][0]) for v in got] == [37, 38, 39, 41]
    assert c.rows_get("lists", np.array([41]))[0].all()
    # an entry that with the rows would pass the budget evicts the older entry, then the rows
    c.get_or_build("N", lambda: np.zeros(38_000, np.uint8))
    assert c.peek("M") is None and c.peek("N") is not None and c.used <= 40_000
    # a lowered budget: the rows keep to their share of it, and everything to it
    c.set_budget(20_000)
    assert c.rows_used <= 20_000 // ROW_SHARE and c.used <= 20_000
    c.clear()
    assert c.used == 0 and c.rows_used == 0 and not c.rows_get("lists", np.arange(40))[0].any()


def test_an_artefact_is_built_once_under_concurrent_requests():
    c = MemoryCache(budget=1 << 20)
    builds, start = [], threading.Barrier(8)

    def build():
        builds.append(1)
        time.sleep(0.05)  # long enough for every other thread to ask meanwhile
        return np.arange(10)

    def ask(_):
        start.wait()
        return c.get_or_build("pairs", build)

    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(ask, range(8)))
    assert len(builds) == 1
    assert all(g is got[0] for g in got)


def test_a_failed_build_is_not_kept_and_the_next_request_builds():
    c = MemoryCache(budget=1 << 20)

    def fail():
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError):
        c.get_or_build("x", fail)
    assert c.get_or_build("x", lambda: np.ones(3)).sum() == 3


def test_sizes_and_the_budget_setting():
    assert parse_bytes("4G") == 4 << 30 and parse_bytes("512M") == 512 << 20 and parse_bytes("1.5K") == 1536
    assert parse_bytes("100") == 100 and parse_bytes("2GiB") == 2 << 30
    with pytest.raises(UserError, match="--cache-memory wants a size such as 512M or 4G, got 'lots'"):
        parse_bytes("lots")
    before = CACHE.budget
    try:
        set_memory_budget("64M")
        assert CACHE.budget == 64 << 20
    finally:
        CACHE.set_budget(before)


def test_a_bad_environment_budget_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("DML_CACHE_MEMORY", "much")
    with pytest.raises(UserError, match="DML_CACHE_MEMORY wants a size"):
        set_memory_budget(None)


# ---------------------------------------------------------------- concurrent searches
def test_every_offline_artefact_is_built_once_under_concurrent_searches(monkeypatch):
    """8 searches at once on a fresh space, differing only in λ: each artefact (lists, sets,
    the pair matrix, the inverted index, the λ-free terms) is built exactly once."""
    searcher, x = gallery()
    builds: dict[str, int] = {}
    lock = threading.Lock()
    artefact = SearcherSpace.artefact

    def counted(self, name, params, build, **kw):
        def wrapped():
            with lock:
                at = (name, repr(params), kw.get("inputs", ()))  # one artefact: its name, parameters and inputs
                builds[at] = builds.get(at, 0) + 1
            time.sleep(0.02)  # widen the window in which the others ask
            return build()
        return artefact(self, name, params, wrapped, **kw)
    in_blocks = SearcherSpace.artefact_in_blocks

    def counted_blocks(self, name, params, columns, fill, **kw):  # built in blocks: counted at its first
        def wrapped(a, b):
            if a == 0:
                with lock:
                    at = (name, repr(params), kw.get("inputs", ()))
                    builds[at] = builds.get(at, 0) + 1
                time.sleep(0.02)
            return fill(a, b)
        return in_blocks(self, name, params, columns, wrapped, **kw)
    monkeypatch.setattr(SearcherSpace, "artefact", counted)
    monkeypatch.setattr(SearcherSpace, "artefact_in_blocks", counted_blocks)
    space = SearcherSpace(searcher, "trained", {}, "cosine")
    start = threading.Barrier(8)

    def one(lam):
        start.wait()
        return rerank("kreciprocal", space, x[:40], 10, params={"k1": 10, "k2": 3, "lambda_value": lam},
                      self_ids=np.arange(40))
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(one, np.linspace(0, 1, 8)))
    names = {name for name, _, _ in builds}
    assert {"knn", "kreciprocal-sets", "kreciprocal-pairs", "kreciprocal-support", "kreciprocal-terms"} <= names
    assert builds == {at: 1 for at in builds}


CONFIGS = ([("kreciprocal", "trained", "cosine", {"k1": 10, "k2": 3, "lambda_value": lam}) for lam in (0.1, 0.3, 0.6)]
           + [("kreciprocal", "identity", "bilinear", {"k1": 10, "k2": 3, "lambda_value": lam}) for lam in (0.1, 0.6)]
           + [("kreciprocal", "trained", "cosine", {"k1": 6, "k2": 3, "lambda_value": 0.3, "pool": 40}),
              ("dba", "trained", "cosine", {"n": 3}), ("diffusion", "identity", "bilinear", {"k": 10, "kq": 4}),
              ("aqe", "trained", "bilinear", {"n": 3})])


def test_concurrent_searches_differing_in_lambda_and_strategy_give_the_sequential_rows():
    """Each configuration run alone, one after another, then all of them twice from 8 threads at
    once on shared spaces with an empty cache (batches threaded inside k-reciprocal too): every
    row and every score is the same."""
    searcher, x = gallery()
    rng = np.random.default_rng(1)
    own = np.concatenate([np.full(30, -1), rng.choice(len(x), 40, replace=False)])  # 70 probes: 3 batches
    q = np.vstack([x[rng.choice(len(x), 30)] + 0.3 * rng.normal(size=(30, x.shape[1])), x[own[30:]]])
    spaces = {(s, m): SearcherSpace(searcher, s, {}, m) for _, s, m, _ in CONFIGS}

    def run(cfg):
        name, strategy, mode, params = cfg
        return rerank(name, spaces[strategy, mode], q, 10, params=params, self_ids=own)

    want = [run(c) for c in CONFIGS]
    CACHE.clear()
    before = faiss.omp_get_max_threads()
    jobs = [i for i in range(len(CONFIGS)) for _ in range(2)]
    rng.shuffle(jobs)
    try:
        faiss.omp_set_num_threads(2)  # k-reciprocal's own batch threads, under the 8 request threads
        with ThreadPoolExecutor(8) as ex:
            got = list(ex.map(lambda i: (i, run(CONFIGS[i])), jobs))
    finally:
        faiss.omp_set_num_threads(before)
    for i, h in got:
        np.testing.assert_array_equal(h.rows, want[i].rows, err_msg=str(CONFIGS[i]))
        np.testing.assert_array_equal(h.scores, want[i].scores, err_msg=str(CONFIGS[i]))
    assert not (want[0].rows < 0).any()  # a complete answer (a batch left out would read −1)


def test_the_searchers_cosine_state_is_built_once_kept_in_the_budget_and_dropped_with_it(monkeypatch):
    """8 cosine searches at once on a fresh searcher compute the gallery's M′-norms once; the norms
    and the norm-scaled copy are entries of the one cache, gone when the searcher is."""
    import gc

    searcher, x = gallery()
    rm = searcher.metric("trained", {})
    calls = []
    m_norms = rm.op.m_norms
    monkeypatch.setattr(rm.op, "m_norms", lambda X: calls.append(1) or time.sleep(0.05) or m_norms(X))
    rows = cosine_searches_at_once(searcher, x[:5])
    assert len(calls) == 1 and all(np.array_equal(r, rows[0]) for r in rows)
    assert searcher.holds_cosine_parts("trained", {})
    assert CACHE.used >= x.nbytes  # the norm-scaled copy of the gallery counts against the budget
    del searcher, rm
    gc.collect()
    assert CACHE.used < x.nbytes


def cosine_searches_at_once(searcher, q, threads=8):
    start = threading.Barrier(threads)

    def one(_):
        start.wait()
        return searcher.search(q, "trained", {}, "cosine", k=5).rows
    with ThreadPoolExecutor(threads) as ex:
        return list(ex.map(one, range(threads)))


def test_an_evicted_value_whose_finalizer_calls_the_cache_does_not_deadlock():
    """A value's last reference can go with its eviction, and its finalizer may call the cache
    (a searcher dropped with it forgets its entries): evictions release values outside the lock."""
    import weakref

    c = MemoryCache(budget=1000)

    class Owner:
        pass

    def put_owned(key):
        value = [np.zeros(100, np.uint8), Owner()]
        weakref.finalize(value[1], c.drop_owner, ("gone",))
        c.get_or_build(key, lambda: value)

    def run():
        put_owned("a")
        c.get_or_build("b", lambda: np.zeros(950, np.uint8))  # evicts "a": its finalizer calls the cache
        put_owned("c")
        c.set_budget(10)  # evicts by the budget
        put_owned("d")
        c.clear()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=20)
    assert not t.is_alive(), "the cache deadlocked releasing an evicted value"
    assert c.used == 0


def test_drop_owner_takes_no_lock_and_its_entries_go_at_the_next_call():
    """The garbage collector may run a searcher's finalizer (`drop_owner`) at any allocation,
    while the cache's own code holds its lock: the call only notes the owner."""
    c = MemoryCache(budget=1 << 20)
    owner = object()
    c.get_or_build((owner, "norms"), lambda: np.zeros(10))
    c.get_or_build("other", lambda: np.zeros(10))
    with c._lock:  # as if collected inside the cache's own critical section
        t = threading.Thread(target=c.drop_owner, args=(owner,), daemon=True)
        t.start()
        t.join(timeout=10)
        assert not t.is_alive(), "drop_owner waited for the cache's lock"
    assert c.peek((owner, "norms")) is None and c.peek("other") is not None
