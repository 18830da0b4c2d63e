"""Refinement strategies: stopping rules, reproducibility, the custom-matrix checks."""
import numpy as np
import pytest

from core.errors import UserError
from index.metric import check_symmetric, matrix_report
from index.refinements import refine


@pytest.fixture
def M_star():
    W = np.random.default_rng(0).normal(size=(6, 30))
    return W.T @ W


def offdiag_fro(M):
    return np.linalg.norm(M - np.diag(np.diag(M)))


@pytest.mark.parametrize("r", [0.1, 0.35, 0.5, 0.9])
def test_diagonal_stops_at_the_first_draw_meeting_the_rule(M_star, r):
    M = refine("diagonal", M_star, {"r": r, "seed": 3})
    zeroed = np.nonzero(np.diag(M) == 0)[0]
    assert np.trace(M) <= (1 - r) * np.trace(M_star) + 1e-9
    np.testing.assert_array_equal(M - np.diag(np.diag(M)), M_star - np.diag(np.diag(M_star)))
    # minimal: replaying the same permutation, one draw fewer breaks the rule
    order = np.random.default_rng(3).permutation(np.nonzero(np.diag(M_star))[0])
    n = len(zeroed)
    assert 0 < n < 30 and set(order[:n]) == set(zeroed)
    assert np.trace(M_star) - np.diag(M_star)[order[: n - 1]].sum() > (1 - r) * np.trace(M_star)


@pytest.mark.parametrize("name", ["diagonal", "random"])
def test_restraint_ends_r0_is_M_star_r1_removes_everything(M_star, name):
    np.testing.assert_array_equal(refine(name, M_star, {"r": 0.0, "seed": 3}), M_star)
    M = refine(name, M_star, {"r": 1.0, "seed": 3})
    restrained = np.diag(M) if name == "diagonal" else M - np.diag(np.diag(M))  # the part it zeroes
    np.testing.assert_array_equal(restrained, 0)


@pytest.mark.parametrize("r", [0.0, 0.2, 0.5, 0.8, 1.0])
def test_random_restraint_rule_and_diagonal_untouched(M_star, r):
    M = refine("random", M_star, {"r": r, "seed": 5})
    assert offdiag_fro(M) <= (1 - r) * offdiag_fro(M_star) + 1e-9
    np.testing.assert_array_equal(np.diag(M), np.diag(M_star))
    np.testing.assert_array_equal(M, M.T)
    changed = (M != M_star)
    assert np.all(M[changed] == 0)  # only zeroing, in symmetric pairs


def test_random_strategies_reproducible_from_seed(M_star):
    for name in ("diagonal", "random"):
        a = refine(name, M_star, {"r": 0.4, "seed": 7})
        np.testing.assert_array_equal(a, refine(name, M_star, {"r": 0.4, "seed": 7}))
        assert not np.array_equal(a, refine(name, M_star, {"r": 0.4, "seed": 8}))


def test_reference_loop_matches_prefix_implementation(M_star):
    """The paper's loop (draw one entry at a time, check the rule) gives the same M′."""
    r, seed = 0.45, 11
    rng = np.random.default_rng(seed)
    order = rng.permutation(np.nonzero(np.diag(M_star))[0])
    M = M_star.copy()
    for i in order:
        if np.trace(M) <= (1 - r) * np.trace(M_star):
            break
        M[i, i] = 0
    np.testing.assert_array_equal(M, refine("diagonal", M_star, {"r": r, "seed": seed}))


def test_shrink_and_spectral(M_star):
    d = 30
    np.testing.assert_allclose(refine("shrink", M_star, {"alpha": 1.0}), np.eye(d) / d)
    np.testing.assert_allclose(refine("shrink", M_star, {"alpha": 0.0}), M_star / np.trace(M_star))
    np.testing.assert_allclose(np.trace(refine("shrink", M_star, {"alpha": 0.3})), 1.0)
    np.testing.assert_allclose(refine("spectral", M_star, {"p": 1.0}), M_star, atol=1e-9)
    P = refine("spectral", M_star, {"p": 0.0})
    np.testing.assert_allclose(P @ P, P, atol=1e-9)  # a projector
    assert round(np.trace(P)) == 6  # onto the rank-6 range of WᵀW
    H = refine("spectral", M_star, {"p": 0.5})
    np.testing.assert_allclose(H @ H, M_star, atol=1e-8)
    with pytest.raises(UserError, match="alpha"):
        refine("shrink", M_star, {"alpha": 2})
    with pytest.raises(UserError, match=r"r must be in \[0, 1\]"):
        refine("diagonal", M_star, {"r": -0.1})


def test_report_principles_and_psd(M_star):
    rep = matrix_report(M_star)
    assert rep["psd"] and rep["rank"] == 6
    assert rep["trace_over_frobenius"] == pytest.approx(np.trace(M_star) / np.linalg.norm(M_star))
    assert rep["frobenius_over_trace"] == pytest.approx(1 / rep["trace_over_frobenius"])
    assert not matrix_report(refine("diagonal", M_star, {"r": 1.0}))["psd"]


def test_custom_matrix_checks(tmp_path, M_star):
    ok = tmp_path / "ok.npy"
    np.save(ok, M_star)
    np.testing.assert_allclose(refine("custom", M_star, {"path": str(ok)}), M_star)
    bad_shape = tmp_path / "shape.npy"
    np.save(bad_shape, np.eye(5))
    with pytest.raises(UserError, match="5 × 5.*d = 30"):
        refine("custom", M_star, {"path": str(bad_shape)})
    asym = tmp_path / "asym.npy"
    A = M_star.copy()
    A[0, 1] += 1.0
    np.save(asym, A)
    with pytest.raises(UserError, match="not symmetric"):
        refine("custom", M_star, {"path": str(asym)})
    nan = tmp_path / "nan.npy"
    B = M_star.copy()
    B[2, 2] = np.nan
    np.save(nan, B)
    with pytest.raises(UserError, match="NaN"):
        refine("custom", M_star, {"path": str(nan)})
    pickled = tmp_path / "obj.npy"
    np.save(pickled, np.array([{"x": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(UserError, match="not a plain .npy"):
        refine("custom", M_star, {"path": str(pickled)})
    with pytest.raises(UserError, match="needs a matrix file"):
        refine("custom", M_star, {})
    with pytest.raises(UserError, match="square"):
        check_symmetric(np.ones((2, 3)))


@pytest.mark.parametrize("r", [0.15, 0.45, 0.8])
def test_random_restraint_matches_the_papers_loop(M_star, r):
    """Draw one off-diagonal pair at a time (the permutation of the non-zero upper-triangle
    entries, np.triu_indices order), zero it, stop once ‖M′_off‖_F ≤ (1 − r)·‖M*_off‖_F."""
    seed = 4
    iu, ju = np.triu_indices(len(M_star), k=1)
    nz = np.nonzero(M_star[iu, ju] != 0)[0]
    M = M_star.copy()
    for p in np.random.default_rng(seed).permutation(nz):
        if offdiag_fro(M) <= (1 - r) * offdiag_fro(M_star):
            break
        M[iu[p], ju[p]] = M[ju[p], iu[p]] = 0
    np.testing.assert_array_equal(M, refine("random", M_star, {"r": r, "seed": seed}))


def test_cut_bisection_equals_scanning_every_prefix():
    from index.refinements.paper import _cut

    def scan(amounts, total, target):
        for n in range(len(amounts) + 1):
            if total - amounts[:n].sum() <= target + 1e-12 * max(abs(total), 1.0):
                return n
        return len(amounts)

    rng = np.random.default_rng(0)
    for trial in range(200):
        a = rng.exponential(size=rng.integers(1, 40)) * (rng.random() < 0.8)  # some all-zero
        if trial % 3 == 0:
            a[rng.random(len(a)) < 0.3] = 0.0
        total = float(a.sum()) + (rng.random() if trial % 5 == 0 else 0.0)  # sometimes unreachable
        target = float(rng.uniform(-0.1, 1.1) * total)
        assert _cut(a, total, target) == scan(a, total, target)
    # signed amounts (not a PSD diagonal) take the scan: the prefix sums are not monotone, and
    # bisection would land on 4 here
    a = np.array([5.0, -5.0, 0.0, 0.0])
    assert _cut(a, 5.0, 1.0) == scan(a, 5.0, 1.0) == 1
    # in place: the same cut, the running sums left in the array
    a = rng.exponential(size=50)
    total, sums = float(a.sum()), np.cumsum(a)
    want = _cut(a.copy(), total, 0.3 * total)
    assert _cut(a, total, 0.3 * total, in_place=True) == want
    np.testing.assert_array_equal(a, sums)


def test_exact_symmetry_is_what_the_strategies_declare(M_star, tmp_path):
    """A strategy with `exact_symmetry` keeps an exactly symmetric M* exactly symmetric, so refine
    may skip re-averaging: the same M′ as with it.  (M* here is exactly symmetric.)"""
    from index.metric import symmetrized
    from index.refinements import REFINEMENTS, strategy_params

    M_sym = symmetrized(M_star + 1e-3 * np.random.default_rng(1).normal(size=M_star.shape))
    assert np.array_equal(M_sym, M_sym.T)
    np.save(tmp_path / "m.npy", M_sym)
    given = {"path": str(tmp_path / "m.npy"), "r": 0.5, "seed": 2, "alpha": 0.3, "p": 0.5}
    declared = [e.name for e in REFINEMENTS.entries() if e.spec.exact_symmetry]
    assert {"trained", "identity", "diagonal", "random"} <= set(declared)
    for name in declared:
        raw = REFINEMENTS.get(name).builder(M_sym, strategy_params(name, given))
        assert np.array_equal(raw, raw.T), name
        np.testing.assert_array_equal(refine(name, M_sym, given, symmetric=True), refine(name, M_sym, given))
    # an M* off by round-off from symmetric (BLAS's WᵀW need not be exact) is symmetrized first,
    # so every caller gets what the app's Searcher gets
    W = np.random.default_rng(3).normal(size=(5, 30))
    M_raw = W.T @ W
    M_raw[0, 1] = np.nextafter(M_raw[0, 1], np.inf)
    for name in declared:
        np.testing.assert_array_equal(refine(name, M_raw, given),
                                      refine(name, symmetrized(M_raw), given, symmetric=True))
        got = refine(name, M_raw, given)
        assert np.array_equal(got, got.T), name
