"""The backends' state in the one memory cache: each M′ built once however many requests ask,
the on-disk IVF's cosine lists opened safely under concurrent first requests, and the helpers
the backends share (re-scoring candidates, the PSD factor of M′)."""
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import index.backends.gallery as gallery_mod
import index.refinements.shrinkage_spectral as spectral_mod
from index.backends.gallery import refined_metric, rescore, strategy_metric
from index.backends.ondisk import OnDiskIVF, build_cosine_lists, build_ondisk_ivf
from index.backends.search import Searcher
from index.backends.store import in_memory_index
from index.metric import psd_factor
from index.refinements import refine
from index.space import CACHE

DIM = 16


def at_once(threads: int, work):
    """`work(i)` from `threads` threads started together (a barrier); the answers in order."""
    start = threading.Barrier(threads)

    def one(i):
        start.wait()
        return work(i)
    with ThreadPoolExecutor(threads) as ex:
        return list(ex.map(one, range(threads)))


def searcher(seed=0, n=200):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((5, DIM)).astype(np.float32)  # first: the same seed, the same neck at any n
    X = rng.standard_normal((n, DIM)).astype(np.float32)
    return Searcher(in_memory_index(X, rng.integers(0, 4, n), W)), W


# ---------------------------------------------------------------- M′ built once
def test_first_requests_from_many_threads_refine_once_and_every_backend_shares_it(monkeypatch):
    CACHE.clear()
    s, W = searcher(1)
    calls = []

    def counting(name, M_star, params=None, **kw):
        calls.append(name)
        threading.Event().wait(0.05)  # a slow eigendecomposition: the others arrive meanwhile
        return refine(name, M_star, params, **kw)
    monkeypatch.setattr(gallery_mod, "refine", counting)
    got = at_once(8, lambda _: s.metric("spectral", {"p": 0.5}))
    assert calls == ["spectral"] and all(rm is got[0] for rm in got)
    # the neck's values are the key: another searcher over them, and the on-disk/Milvus route, read the same M′
    other, _ = searcher(1, n=50)
    assert other.metric("spectral", {"p": 0.5}) is got[0]
    qm = strategy_metric(W.astype(np.float64), "spectral", {"p": 0.5}, "cosine")
    assert qm.M is got[0].M and calls == ["spectral"]
    # another parameter is another M′
    assert s.metric("spectral", {"p": 0.25}) is not got[0] and calls == ["spectral", "spectral"]


def test_a_sweep_over_the_spectral_power_decomposes_m_star_once(monkeypatch):
    CACHE.clear()
    rng = np.random.default_rng(2)
    W = rng.standard_normal((4, DIM))
    M = W.T @ W
    calls = []
    eigh = np.linalg.eigh

    def counting(A):
        calls.append(1)
        threading.Event().wait(0.05)  # slow: the other threads ask meanwhile
        return eigh(A)
    monkeypatch.setattr(spectral_mod.np.linalg, "eigh", counting)
    ps = [0.0, 0.25, 0.5, 1.5] * 2
    got = at_once(len(ps), lambda i: refine("spectral", M, {"p": ps[i]}))
    assert len(calls) == 1
    monkeypatch.undo()
    for p, Mp in zip(ps, got, strict=True):
        np.testing.assert_array_equal(Mp, refine("spectral", M, {"p": p}))


def test_an_evicted_metric_is_built_again_the_same(monkeypatch):
    s, _ = searcher(3)
    q = np.random.default_rng(4).standard_normal((3, DIM)).astype(np.float32)
    before = s.search(q, "shrink", {"alpha": 0.3}, "cosine", k=7)
    M = s.metric("shrink", {"alpha": 0.3}).M.copy()
    monkeypatch.setattr(CACHE, "budget", 0)  # nothing is kept: every request builds again
    CACHE.clear()
    a, b = s.metric("shrink", {"alpha": 0.3}), s.metric("shrink", {"alpha": 0.3})
    assert a is not b
    np.testing.assert_array_equal(a.M, M)
    np.testing.assert_array_equal(b.M, M)
    after = s.search(q, "shrink", {"alpha": 0.3}, "cosine", k=7)
    np.testing.assert_array_equal(after.rows, before.rows)
    np.testing.assert_array_equal(after.scores, before.scores)


def test_a_replaced_custom_matrix_file_makes_another_metric(tmp_path):
    s, _ = searcher(5)
    path = tmp_path / "M.npy"
    np.save(path, np.eye(DIM))
    first = s.metric("custom", {"path": str(path)}).M
    np.testing.assert_array_equal(first, np.eye(DIM))
    np.save(path, 2 * np.eye(DIM))
    os.utime(path, ns=(10**18, 10**18))  # a modification time surely not the first file's
    np.testing.assert_array_equal(s.metric("custom", {"path": str(path)}).M, 2 * np.eye(DIM))


def test_a_seed_sweep_keeps_the_other_strategies_metrics(tmp_path):
    """Many random seeds do not push the other strategies' M′ out of the memory cache: they are
    the same objects afterwards (not rebuilt)."""
    s, _ = searcher(6)
    q = np.random.default_rng(7).standard_normal((1, DIM)).astype(np.float32)
    kept = {}
    for name, params in (("trained", {}), ("identity", {}), ("shrink", {"alpha": 0.5}), ("spectral", {"p": 0.5})):
        s.search(q, name, params, mode="cosine", k=3)
        kept[name] = (params, s.metric(name, params))
    for seed in range(20):
        s.search(q, "random", {"r": 0.5, "seed": seed}, k=3)
    assert all(s.metric(n, p) is rm for n, (p, rm) in kept.items())


# ---------------------------------------------------------------- the shared helpers
def brute_top(qt, cand, X, norms, k):
    """Each query's top-k among its candidates, by a plain loop: score desc, then row asc."""
    R = np.full((len(qt), k), -1, dtype=np.int64)
    S = np.full((len(qt), k), -np.inf, dtype=np.float32)
    for i, c in enumerate(cand):
        scored = []
        for r in sorted(set(int(v) for v in c if v >= 0)):
            sc = float(X[r].astype(np.float64) @ qt[i].astype(np.float64))
            if norms is not None:
                sc = sc / norms[r] if norms[r] > 0 else -np.inf
            scored.append((-sc, r, sc))
        for j, (_, r, sc) in enumerate(sorted(scored)[:k]):
            R[i, j], S[i, j] = r, sc
    return R, S


@pytest.mark.parametrize("cosine", [False, True])
def test_rescore_gives_each_querys_exact_top_k_among_its_candidates(cosine):
    rng = np.random.default_rng(8)
    X = rng.standard_normal((60, DIM)).astype(np.float32)
    X[7] = X[3]      # a tie: the lower row ranks first
    X[11] = 0        # zero norm: no cosine
    qt = rng.standard_normal((5, DIM)).astype(np.float32)
    others = np.setdiff1d(np.arange(60), [3, 7, 11])
    cand = np.stack([np.r_[7, 3, 11, rng.permutation(others)[:17]] for _ in range(5)])  # no repeats, as FAISS gives
    cand[1, 5:] = -1  # a query with only 5 candidates
    norms = np.linalg.norm(X.astype(np.float64), axis=1) if cosine else None
    reads: list[np.ndarray] = []

    def read(rows):
        reads.append(rows)
        return X[rows]
    R, S = rescore(qt, cand, read, 8,
                   None if norms is None else lambda rows, _: norms[rows])
    want_R, want_S = brute_top(qt, cand, X, norms, 8)
    np.testing.assert_array_equal(R, want_R)
    np.testing.assert_allclose(S, want_S, rtol=1e-5, atol=1e-6)
    assert (R[1, 5:] == -1).all() and np.isneginf(S[1, 5:]).all()
    assert len(reads) == 1 and (np.diff(reads[0]) > 0).all()  # one sorted read of the block's rows
    # query 1 has 5 candidates, row 11 among them: zero norm has no cosine (−inf), a bilinear score of 0
    assert 11 in R[1] and bool(np.isneginf(S[1][R[1] == 11]).all()) == cosine


def test_psd_factor_reproduces_m_and_refuses_an_indefinite_one():
    rng = np.random.default_rng(9)
    W = rng.standard_normal((5, DIM))
    M = W.T @ W
    F = psd_factor(M)
    assert F is not None and F.shape == (DIM, 5) and F.dtype == np.float32
    np.testing.assert_allclose(F.astype(np.float64) @ F.T, M, atol=1e-5 * np.abs(M).max())
    # round-off below zero (−10⁻⁹ of the scale) is still PSD; a real negative direction is not
    v = rng.standard_normal(DIM)
    v /= np.linalg.norm(v)
    scale = np.linalg.eigvalsh(M).max()
    assert psd_factor(M - 1e-9 * scale * np.outer(v, v)) is not None
    assert psd_factor(M - 1e-3 * scale * np.eye(DIM)) is None
    assert psd_factor(refine("diagonal", M, {"r": 0.5, "seed": 1})) is None
    zero = psd_factor(np.zeros((DIM, DIM)))
    assert zero is not None and zero.shape == (DIM, 0)


# ---------------------------------------------------------------- on-disk IVF: concurrent first cosine requests
N_IVF, NLIST = 800, 4


@pytest.fixture(scope="module")
def ivf_with_cosine_lists(tmp_path_factory):
    t = tmp_path_factory.mktemp("ivf-race")
    rng = np.random.default_rng(10)
    X = rng.standard_normal((N_IVF, DIM)).astype(np.float32)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    np.save(t / "features.npy", X)
    W = rng.standard_normal((6, DIM)).astype(np.float32)
    build_ondisk_ivf(t / "features.npy", t / "ivf", W=W, nlist=NLIST, normalize=True)
    for name in ("trained", "identity", "shrink"):
        build_cosine_lists(t / "ivf", name)
    Q = rng.standard_normal((6, DIM)).astype(np.float32)
    return t / "ivf", Q


def test_first_cosine_requests_of_several_strategies_at_once_answer_as_one_at_a_time(ivf_with_cosine_lists):
    path, Q = ivf_with_cosine_lists
    names = ("trained", "identity", "shrink")
    serial = {n: OnDiskIVF(path, nprobe=NLIST).search(Q, n, {}, "cosine", k=10) for n in names}
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave at every few bytecodes: the race, if any, shows
    try:
        for _ in range(25):
            CACHE.clear()   # every round's requests are the first: the lists are opened again
            ivf = OnDiskIVF(path, nprobe=NLIST)
            got = at_once(9, lambda i, ivf=ivf: ivf.search(Q, names[i % 3], {}, "cosine", k=10))
            for i, h in enumerate(got):
                np.testing.assert_array_equal(h.rows, serial[names[i % 3]].rows)
                np.testing.assert_array_equal(h.scores, serial[names[i % 3]].scores)
    finally:
        sys.setswitchinterval(switch)


def test_the_on_disk_ivf_shares_the_searchers_metric(ivf_with_cosine_lists):
    path, _ = ivf_with_cosine_lists
    ivf = OnDiskIVF(path)
    assert ivf.strategy_metric("shrink", {"alpha": 0.2}).M is refined_metric(ivf.W, "shrink", {"alpha": 0.2}).M
