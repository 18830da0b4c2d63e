"""PSD readings of the restraints (diagonal-psd, random-psd) against independent computations:
the matrices, their positive semi-definiteness, exact cosine search, the registry metadata, the
sweep, and the refusals.  The raw restraints stay as they were."""
import json

import numpy as np
import pytest

from core.errors import UserError
from core.params import check_fields
from index.backends.search import Searcher
from index.backends.store import Items, in_memory_index, write_index
from index.metric import COSINE_FALLBACK, MODES, symmetrized
from index.refinements import REFINEMENTS, refine, strategy_params
from index.refinements.paper import R_GRID
from index.refinements.psd import ReadingParams, psd_reading

D, K = 8, 3  # M* = WᵀW of rank 3 < d: zeroing a diagonal entry makes it indefinite
RAW = {"diagonal-psd": "diagonal", "random-psd": "random"}
PARAMS = {"diagonal-psd": {"r": 0.5, "seed": 1}, "random-psd": {"r": 0.6, "seed": 2}}


@pytest.fixture
def W():
    return np.random.default_rng(0).normal(size=(K, D)).astype(np.float32)


@pytest.fixture
def M_star(W):
    W64 = W.astype(np.float64)
    return symmetrized(W64.T @ W64)


def numpy_reading(A, how):
    """The reading from numpy's eigendecomposition of A."""
    mu, V = np.linalg.eigh(A)
    return V @ np.diag(np.abs(mu) if how == "abs" else np.maximum(mu, 0.0)) @ V.T


def polar_reading(A, how):
    """The same from the SVD instead: |A| = (AᵀA)^½ = VΣVᵀ for A = UΣVᵀ, and clip = (A + |A|)/2."""
    _, s, Vt = np.linalg.svd(A)
    absA = Vt.T @ np.diag(s) @ Vt
    return absA if how == "abs" else (A + absA) / 2


def scale(A):
    return max(float(np.abs(np.linalg.eigvalsh(A)).max()), 1e-300)


@pytest.mark.parametrize("name", ["diagonal-psd", "random-psd"])
@pytest.mark.parametrize("how", ["abs", "clip"])
def test_reading_equals_the_eigen_and_polar_forms_of_the_raw_restraint_and_is_psd(M_star, name, how):
    raw = refine(RAW[name], M_star, PARAMS[name])
    assert np.linalg.eigvalsh(raw).min() < -1e-6 * scale(raw)  # the raw M′ is indefinite here
    got = refine(name, M_star, PARAMS[name] | {"psd": how})
    tol = 1e-10 * scale(raw)
    np.testing.assert_allclose(got, numpy_reading(raw, how), rtol=0, atol=tol)
    np.testing.assert_allclose(got, polar_reading(raw, how), rtol=0, atol=tol)
    assert np.array_equal(got, got.T)
    assert np.linalg.eigvalsh(got).min() >= -1e-6 * scale(got)
    # the draws are the raw strategy's: exactly its M′, read
    np.testing.assert_array_equal(got, psd_reading(raw, how))


def test_the_raw_restraint_is_as_before(M_star):
    """The raw diagonal restraint (the paper's, no reading) is bit-identical to the paper's loop,
    and keeps its metadata: bilinear only, its low-rank operator, r alone in its grid."""
    r, seed = 0.5, 1
    want = M_star.copy()
    tr = np.trace(M_star)
    for i in np.random.default_rng(seed).permutation(np.nonzero(np.diag(M_star))[0]):
        if np.trace(want) <= (1 - r) * tr:
            break
        want[i, i] = 0.0
    np.testing.assert_array_equal(refine("diagonal", M_star, {"r": r, "seed": seed}), want)
    for name, op in (("diagonal", "lowrank-diag"), ("random", "dense")):
        spec = REFINEMENTS.get(name).spec
        assert spec.operator == op and spec.modes == ("bilinear",) and spec.grid == {"r": R_GRID}
        assert "psd" not in REFINEMENTS.get(name).param_defaults()


def test_metadata_of_the_readings():
    for name in ("diagonal-psd", "random-psd"):
        e = REFINEMENTS.get(name)
        assert e.spec.operator == "spectral" and e.spec.exact_symmetry is True
        assert e.spec.grid == {"r": R_GRID, "psd": ("abs", "clip")} and e.spec.modes == MODES  # both modes
        assert e.spec.trained_at == {"r": 0.0}
        assert e.param_defaults() == {"r": 0.5, "seed": 0, "psd": "abs"}


def test_at_r0_a_reading_is_M_star(M_star):
    for how in ("abs", "clip"):
        np.testing.assert_allclose(refine("diagonal-psd", M_star, {"r": 0.0, "psd": how}), M_star,
                                   rtol=0, atol=1e-10 * scale(M_star))


def cosine_ranking(Q, X, M):
    """Brute force in float64: φ_qᵀM′φ_x / sqrt(φ_qᵀM′φ_q · φ_xᵀM′φ_x), best first."""
    S = Q @ M @ X.T
    S = S / np.sqrt(np.einsum("ij,jk,ik->i", Q, M, Q))[:, None] / np.sqrt(np.einsum("ij,jk,ik->i", X, M, X))[None]
    return np.argsort(-S, axis=1, kind="stable"), S


@pytest.mark.parametrize("name", ["diagonal-psd", "random-psd"])
@pytest.mark.parametrize("how", ["abs", "clip"])
def test_cosine_search_ranks_as_brute_force(W, M_star, name, how):
    rng = np.random.default_rng(5)
    X = rng.normal(size=(40, D))
    Q = rng.normal(size=(6, D))
    s = Searcher(in_memory_index(X, np.arange(40) % 5, W, normalize=True))
    params = PARAMS[name] | {"psd": how}
    assert s.resolve_mode(name, params, "cosine") == ("cosine", "")  # scored as asked, no fallback
    rm = s.metric(name, params)
    assert rm.report["psd"]
    if (name, how) == ("diagonal-psd", "clip"):  # at most rank(M*) positive eigenvalues: a low-rank operator
        assert rm.op.kind == "spectral" and rm.op.spectral[0] == 0.0 and rm.op.spectral[2].shape[1] <= K
    # the reference: numpy's reading of the raw restraint, on the normalised features
    M = numpy_reading(refine(RAW[name], M_star, PARAMS[name]), how)
    Xn, Qn = (A / np.linalg.norm(A, axis=1, keepdims=True) for A in (X, Q))
    order, S = cosine_ranking(Qn, Xn, M)
    gaps = -np.diff(np.take_along_axis(S, order, 1), axis=1)
    assert gaps.min() > 1e-5  # no near-ties: the exact order is well defined in float32
    res = s.search(Q, name, params, "cosine", k=40)
    np.testing.assert_array_equal(res.rows, order)
    np.testing.assert_allclose(res.scores, np.take_along_axis(S, order, 1), rtol=0, atol=1e-5)


def test_raw_restraint_still_falls_back_to_bilinear(W):
    X = np.random.default_rng(6).normal(size=(30, D))
    s = Searcher(in_memory_index(X, np.arange(30) % 3, W))
    assert s.resolve_mode("diagonal", PARAMS["diagonal-psd"], "cosine") == ("bilinear", COSINE_FALLBACK)


def test_the_sweep_measures_both_readings_in_both_modes_and_the_table_reports_them(W):
    from index.analysis.strategy_eval import READING_ROWS, aggregate, evaluate_configs, summary_table, sweep_configs

    configs = sweep_configs(1, ("trained", "diagonal", "diagonal-psd"), "coarse")
    coarse_r = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    assert [c for c in configs if c[0] == "diagonal"] == [("diagonal", {"r": r, "seed": 0}, "bilinear")
                                                          for r in coarse_r]
    assert [c for c in configs if c[0] == "diagonal-psd"] == [
        ("diagonal-psd", {"r": r, "psd": how, "seed": 0}, mode)
        for r in coarse_r for how in ("abs", "clip") for mode in ("bilinear", "cosine")]
    rng = np.random.default_rng(7)
    y = np.repeat(np.arange(6), 5)
    X = np.abs(rng.normal(size=(6, D))[y] + 0.5 * rng.normal(size=(30, D)))
    rows = evaluate_configs(X, y, W, configs, progress=False)
    read = [r for r in rows if r["strategy"] == "diagonal-psd"]
    assert len(read) == 24 and all(r["M_psd"] for r in read)  # every cosine setting scored, none skipped
    # batched scores (index/analysis/sweep.py) rank as the search path does
    from evaluation.evaluator import evaluate_ranking

    s = Searcher(in_memory_index(X, y, W))
    for r in read[4:8]:
        t, index, _ = s.query_view("diagonal-psd", r["params"], r["mode"])
        ref = evaluate_ranking(index, t(np.asarray(s.data.features)), y, y, same_set=True)
        assert r["map@r"] == pytest.approx(ref["map@r"], abs=1e-9)
    table = summary_table(aggregate(rows), None)
    titles = [t["row"] for t in table]
    for _, _, title in READING_ROWS:
        assert title in titles
    abs_row = table[titles.index(READING_ROWS[1][2])]
    assert abs_row["choice"].startswith("diagonal-psd(") and "psd=abs" in abs_row["choice"]
    assert "r=0.0" not in abs_row["choice"]  # r = 0 is M* itself, not a refinement
    assert not any("the paper's)" in t or "|" in t for t in titles)  # a "|" would split a markdown cell


def test_a_bad_reading_is_refused_in_one_line(capsys):
    from index.cli import main

    with pytest.raises(UserError, match=r"psd: 'bogus' is not one of \['abs', 'clip'\]") as e:
        strategy_params("diagonal-psd", {"psd": "bogus"})
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="psd must be one of"):
        check_fields(ReadingParams(psd="bogus"), "diagonal-psd")
    with pytest.raises(SystemExit) as ex:
        main(["search", "--strategy", "diagonal-psd", "--psd", "bogus"])
    assert ex.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("argument --psd: value: 'bogus' is not one of ['abs', 'clip']")


@pytest.fixture
def index_dir(tmp_path, W):
    rng = np.random.default_rng(8)
    feats = rng.normal(size=(50, D)).astype(np.float32)
    items = Items(np.arange(50), rng.integers(0, 5, 50), [f"{i}.png" for i in range(50)], ["test"] * 50)
    write_index(tmp_path / "idx", feats, items, W, normalize=True,
                info={"backbone": "synthetic", "checkpoint_sha256": None})
    np.save(tmp_path / "q.npy", feats[:3])
    return tmp_path


def test_cli_searches_a_reading_in_cosine_and_refuses_it_on_the_raw_restraint(index_dir, capsys):
    from core.cli import run_cli
    from index.backends.store import read_index
    from index.cli import main

    t = index_dir
    argv = ["search", "--index", str(t / "idx"), "--features", str(t / "q.npy"), "--k", "5", "--mode", "cosine"]
    assert main(argv + ["--strategy", "diagonal-psd", "--r", "0.5", "--psd", "clip", "--json", str(t / "o.json")]) == 0
    res = json.loads((t / "o.json").read_text())
    assert res["mode"] == "cosine" and res["note"] == "" and res["params"] == {"r": 0.5, "psd": "clip"}
    data = read_index(t / "idx")
    want = Searcher(data).search(np.load(t / "q.npy"), "diagonal-psd", {"r": 0.5, "psd": "clip"}, "cosine", 5)
    assert [[x["id"] for x in q["results"]] for q in res["queries"]] == data.items.ids[want.rows].tolist()
    # --psd on the raw restraint would silently search the raw M′: refused instead
    assert run_cli(main, argv + ["--strategy", "diagonal", "--psd", "abs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: strategy diagonal takes no --psd; diagonal-psd, random-psd do"
