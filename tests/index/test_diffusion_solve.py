"""Diffusion's solve and ranking against the official code's (dfs.m: MATLAB's pcg; run_test.m: a
stable descending sort): a dense solve, a one-column pcg written here from MATLAB's algorithm,
and the ranking of items the diffusion does not reach."""
import numpy as np
import pytest
from scipy import sparse

from index.backends.search import Searcher
from index.backends.store import Items, read_index, write_index
from index.rerankers import SearcherSpace, rerank
from index.rerankers.diffusion import conjugate_gradient


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def pcg(A: np.ndarray, b: np.ndarray, tol: float, maxit: int) -> tuple[np.ndarray, int, int]:
    """MATLAB's pcg(A, b, tol, maxit) with no preconditioner, x0 = 0, one column, step by step:
    (x, flag, iteration of x)."""
    n = len(b)
    eps = np.finfo(float).eps
    n2b = np.linalg.norm(b)
    if n2b == 0:
        return np.zeros(n), 0, 0
    tolb = tol * n2b
    x = np.zeros(n)
    r = b - A @ x
    normr = normr_act = normrmin = np.linalg.norm(r)
    xmin, imin, flag, rho, stag, moresteps = x.copy(), 0, 1, 1.0, 0, 0
    maxmsteps = min(n // 50, 5, n - maxit)
    p = np.zeros(n)
    ii = 0
    for ii in range(1, maxit + 1):
        rho1, rho = rho, float(r @ r)
        if rho == 0 or np.isinf(rho):
            flag = 4
            break
        if ii == 1:
            p = r.copy()
        else:
            beta = rho / rho1
            if beta == 0 or np.isinf(beta):
                flag = 4
                break
            p = r + beta * p
        q = A @ p
        pq = p @ q
        if pq <= 0 or np.isinf(pq):
            flag = 4
            break
        alpha = rho / pq
        stag = stag + 1 if np.linalg.norm(p) * abs(alpha) < eps * np.linalg.norm(x) else 0
        x = x + alpha * p
        r = r - alpha * q
        normr = normr_act = np.linalg.norm(r)
        if normr <= tolb or stag >= 3 or moresteps:
            r = b - A @ x
            normr_act = np.linalg.norm(r)
            if normr_act <= tolb:
                return x, 0, ii
            if stag >= 3 and moresteps == 0:
                stag = 0
            moresteps += 1
            if moresteps >= maxmsteps:
                flag = 3
                break
        if normr_act < normrmin:
            normrmin, xmin, imin = normr_act, x.copy(), ii
        if stag >= 3:
            flag = 3
            break
    if np.linalg.norm(b - A @ xmin) <= normr_act:
        return xmin, flag, imin
    return x, flag, ii


def diffusion_system(n=300, k=10, alpha=0.99, gamma=3.0, seed=0):
    """I − αS of a random clustered gallery's mutual kNN graph (knngraph.m, transition_matrix.m),
    dense, and a few seed vectors y (ymake.m, kq = 5)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(20, 8))[rng.integers(0, 20, n)] + 0.6 * rng.normal(size=(n, 8))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    S = X @ X.T
    knn = np.argsort(-S, axis=1, kind="stable")[:, :k]
    member = np.zeros((n, n), dtype=bool)
    member[np.repeat(np.arange(n), k), knn.ravel()] = True
    A = np.where(member & member.T, np.maximum(S, 0) ** gamma, 0.0)
    np.fill_diagonal(A, 0.0)
    d = A.sum(1)
    inv = np.where(d > 0, 1 / np.sqrt(np.where(d > 0, d, 1)), 0)
    L = np.eye(n) - alpha * inv[:, None] * A * inv[None, :]
    Y = np.zeros((n, 6))
    for j in range(6):
        top = rng.choice(n, 5, replace=False)
        Y[top, j] = rng.uniform(0.1, 1, 5) ** gamma
    return L, Y


def test_enough_iterations_give_the_dense_solve():
    L, Y = diffusion_system()
    exact = np.linalg.solve(L, Y)
    for A in (L, sparse.csr_matrix(L), lambda U: L @ U):
        got = conjugate_gradient(A, Y, 1e-12, 1000)
        np.testing.assert_allclose(got, exact, rtol=0, atol=1e-10 * np.abs(exact).max())
    np.testing.assert_allclose(conjugate_gradient(L, Y[:, 2], 1e-12, 1000), exact[:, 2], atol=1e-10)


@pytest.mark.parametrize("tol,maxit", [(1e-6, 20), (1e-6, 7), (1e-2, 20), (1e-3, 60)])
def test_few_iterations_give_pcgs_answer_column_by_column(tol, maxit):
    """Each column as MATLAB's pcg returns it: the converged iterate, or the one of smallest
    residual, whichever iteration that was; a zero column is 0."""
    L, Y = diffusion_system()
    Y[:, 3] = 0.0
    got = conjugate_gradient(L, Y, tol, maxit)
    for j in range(Y.shape[1]):
        want, _, _ = pcg(L, Y[:, j], tol, maxit)
        np.testing.assert_allclose(got[:, j], want, rtol=0, atol=1e-12 * max(np.abs(want).max(), 1e-300))
    assert not got[:, 3].any()


def last_iterate(A: np.ndarray, b: np.ndarray, steps: int) -> np.ndarray:
    """Plain conjugate gradients from 0, `steps` steps, whatever their residuals."""
    x, r = np.zeros_like(b), b.copy()
    p = r.copy()
    for _ in range(steps):
        q = A @ p
        a = (r @ r) / (p @ q)
        x, r_new = x + a * p, r - a * q
        p = r_new + (r_new @ r_new) / (r @ r) * p
        r = r_new
    return x


def test_the_official_settings_do_not_return_the_last_iterate():
    """At run_test.m's α = 0.99, tol 1e-6 and 20 iterations pcg does not converge here, and for
    some seeds its answer is an earlier iterate than the 20th: the case that tells the two apart."""
    L, Y = diffusion_system()
    runs = [pcg(L, Y[:, j], 1e-6, 20) for j in range(Y.shape[1])]
    assert all(flag == 1 for _, flag, _ in runs)
    earlier = [j for j, (_, _, at) in enumerate(runs) if at < 20]
    assert earlier
    got = conjugate_gradient(L, Y, 1e-6, 20)
    for j in earlier:
        np.testing.assert_allclose(got[:, j], runs[j][0], rtol=0, atol=1e-12)
        assert np.abs(got[:, j] - last_iterate(L, Y[:, j], 20)).max() > 1e-6 * np.abs(got[:, j]).max()


@pytest.mark.parametrize("tol,maxit,flag", [(1e-15, 250, 3), (1e-17, 400, 3), (1e-14, 250, 0)])
def test_a_tolerance_near_eps_ends_as_pcgs_does(tol, maxit, flag):
    """A tolerance the recurrence's residual reaches before the true one can: pcg's further steps
    and their stop (flag 3, maxmsteps 5, or below 0 with maxit > n), a tolerance under eps
    raised to eps; or convergence (flag 0) checked on the true residual."""
    L, Y = diffusion_system()
    got = conjugate_gradient(L, Y, tol, maxit)
    for j in range(Y.shape[1]):
        want, f, _ = pcg(L, Y[:, j], max(tol, np.finfo(float).eps), maxit)
        assert f == flag
        np.testing.assert_allclose(got[:, j], want, rtol=0, atol=1e-12 * np.abs(want).max())


# ---------------------------------------------------------------- the ranking
def test_items_the_diffusion_does_not_reach_are_ranked_by_index(tmp_path):
    """Three far-apart clusters: a query's diffusion reaches its own cluster's items only; the rest
    (f = 0) follow in gallery order, as run_test.m's stable descending sort leaves them, whatever
    their plain scores; the reached ones in the order of f from a dense system solved by pcg."""
    rng = np.random.default_rng(0)
    n, d, k, kq = 150, 16, 8, 4
    centres = 10 * np.eye(d)[:3]
    x = (centres[np.arange(n) % 3] + rng.normal(size=(n, d))).astype(np.float32)
    items = Items(np.arange(n), (np.arange(n) % 3).astype(np.int64), [f"{i}.png" for i in range(n)], ["test"] * n)
    write_index(tmp_path / "idx", x, items, np.eye(d, dtype=np.float32), normalize=True, info={"backbone": "t"})
    searcher = Searcher(read_index(tmp_path / "idx"))
    space = SearcherSpace(searcher, "identity", {}, "bilinear")
    q = (centres[1] + rng.normal(size=d)).astype(np.float32)[None]
    got = rerank("diffusion", space, q, n, params={"k": k, "kq": kq})

    G = np.asarray(searcher.data.features, dtype=np.float64)
    S = G @ G.T
    knn = np.argsort(-S, axis=1, kind="stable")[:, :k]
    member = np.zeros((n, n), dtype=bool)
    member[np.repeat(np.arange(n), k), knn.ravel()] = True
    A = np.where(member & member.T, np.maximum(S, 0) ** 3, 0.0)
    np.fill_diagonal(A, 0.0)
    deg = A.sum(1)
    inv = np.where(deg > 0, 1 / np.sqrt(np.where(deg > 0, deg, 1)), 0)  # an isolated item: 0
    qn = q[0].astype(np.float64) / np.linalg.norm(q[0])
    s = G @ qn
    y = np.zeros(n)
    top = np.argsort(-s, kind="stable")[:kq]
    y[top] = np.maximum(s[top], 0) ** 3
    f, _, _ = pcg(np.eye(n) - 0.99 * inv[:, None] * A * inv[None, :], y, 1e-6, 20)
    unreached = np.flatnonzero(f == 0)
    assert np.isin(np.flatnonzero(np.arange(n) % 3 != 1), unreached).all()  # the other clusters
    by_score = np.argsort(-s[unreached], kind="stable")
    assert not np.array_equal(by_score, np.arange(len(unreached)))  # the plain order is another
    np.testing.assert_array_equal(got.rows[0], np.argsort(-f, kind="stable"))
    np.testing.assert_array_equal(got.rows[0][-len(unreached):], unreached)
    np.testing.assert_allclose(got.scores[0], f[got.rows[0]], rtol=1e-6, atol=1e-12)
    # the variant: equal f by the plain score (float32, as the search scores), then by index
    s32 = space.score(space.prepare(q))[0].astype(np.float64)
    variant = rerank("diffusion", space, q, n, params={"k": k, "kq": kq, "ties": "score"})
    np.testing.assert_array_equal(variant.rows[0], np.lexsort((np.arange(n), -s32, -f)))
    assert not np.array_equal(variant.rows[0][-len(unreached):], unreached)
