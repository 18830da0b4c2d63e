"""On-disk IVF (index/backends/ondisk.py): built from shards through merge_ondisk, exact re-rank under M′."""
import json
import mmap

import faiss
import numpy as np
import pytest
from dense_reference import m_norms

from core.errors import UserError
from index.backends.ondisk import OnDiskIVF, build_cosine_lists, build_for_index, build_ondisk_ivf
from index.backends.store import Items, write_index
from index.cli import main
from index.refinements import refine

N, DIM, NLIST, K = 3000, 24, 8, 10
STRATEGIES = [("trained", {}), ("identity", {}), ("diagonal", {"r": 0.5, "seed": 0}), ("random", {"r": 0.5, "seed": 1})]


def data(seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((12, DIM))
    X = (centres[rng.integers(0, 12, N)] + 0.8 * rng.standard_normal((N, DIM))).astype(np.float32)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    Q = X[rng.choice(N, 30, replace=False)] + 0.1 * rng.standard_normal((30, DIM)).astype(np.float32)
    W = rng.standard_normal((6, DIM))
    return X, Q, W.T @ W


def exact_scores(X, Q, M, cosine=False):
    Qn = Q / np.linalg.norm(Q, axis=1, keepdims=True)
    S = (Qn.astype(np.float64) @ M) @ X.T.astype(np.float64)
    if cosine:
        S = S / m_norms(X, M)[None] / m_norms(Qn, M)[:, None]
    return S


def recall_up_to_ties(S, rows):
    """Share of returned rows whose exact score reaches the exact k-th best (ties count as hits)."""
    kth = np.sort(S, axis=1)[:, -K]
    return float((np.take_along_axis(S, rows, 1) >= kth[:, None] - 1e-6).mean())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    t = tmp_path_factory.mktemp("ondisk")
    X, Q, M_star = data()
    np.save(t / "features.npy", X)
    build_ondisk_ivf(t / "features.npy", t / "ivf", nlist=NLIST, shard_rows=1100, normalize=True)
    return t, X, Q, M_star


def test_built_from_shards_into_one_ondisk_file(built):
    t, X, _, _ = built
    man = json.loads((t / "ivf" / "ondisk.json").read_text())
    assert man["shards"] == 3 and man["count"] == N and man["nlist"] == NLIST and man["codec"] == "SQ8"
    assert sorted(p.name for p in (t / "ivf").iterdir()) == ["W.npy", "ivf.index", "ivf.ivfdata", "ondisk.json"]
    ivf = OnDiskIVF(t / "ivf")
    base = ivf.features
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base.obj, mmap.mmap) and not ivf.features.flags.writeable  # memory-mapped, read-only
    np.testing.assert_array_equal(ivf.features, X)
    lists = faiss.downcast_InvertedLists(ivf.index.invlists)
    assert isinstance(lists, faiss.OnDiskInvertedLists) and lists.filename == str(t / "ivf" / "ivf.ivfdata")
    assert ivf.index.ntotal == N


@pytest.mark.parametrize("name,params", STRATEGIES)
def test_all_lists_probed_is_exact(built, name, params):
    t, X, Q, M_star = built
    ivf = OnDiskIVF(t / "ivf")
    M = refine(name, M_star, params)
    res = ivf.search_metric(Q, ivf.metric(M), K, nprobe=NLIST)
    S = exact_scores(X, Q, M)
    assert recall_up_to_ties(S, res.rows) == 1.0
    np.testing.assert_allclose(res.scores, np.take_along_axis(S, res.rows, 1), rtol=1e-4, atol=1e-5)
    assert (np.diff(res.scores, axis=1) <= 0).all()


def test_fewer_lists_probed_lose_some_recall_for_a_non_identity_metric(built):
    t, X, Q, M_star = built
    ivf = OnDiskIVF(t / "ivf", nprobe=1)
    M = refine("diagonal", M_star, {"r": 0.5, "seed": 0})
    assert recall_up_to_ties(exact_scores(X, Q, M), ivf.search_metric(Q, ivf.metric(M), K).rows) < 1.0


def spread_norms_data(seed=0):
    """A gallery whose ‖x‖_M′ spans four orders of magnitude under a rank-4 M′ = WᵀW (W reads
    the first 4 coordinates): every row is unit, with its share in W's row space drawn from
    10⁻⁴ … 1, so the rows nearest a query in cosine are mostly short under M′ and the inner
    product ranks them low; 5 rows have Wx = 0 (no cosine)."""
    rng = np.random.default_rng(seed)
    W = np.zeros((4, DIM))
    W[:, :4] = rng.standard_normal((4, 4))
    a, b = rng.standard_normal((N, 4)), rng.standard_normal((N, DIM - 4))
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    b /= np.linalg.norm(b, axis=1, keepdims=True)
    share = 10.0 ** rng.uniform(-4, 0, N)[:, None]
    share[:5] = 0
    X = np.hstack([share * a, np.sqrt(1 - share**2) * b]).astype(np.float32)
    Q = np.hstack([rng.standard_normal((20, 4)), 0.3 * rng.standard_normal((20, DIM - 4))]).astype(np.float32)
    return X, Q, W.astype(np.float32)


@pytest.fixture(scope="module")
def spread(tmp_path_factory):
    t = tmp_path_factory.mktemp("spread")
    X, Q, W = spread_norms_data()
    np.save(t / "features.npy", X)
    build_ondisk_ivf(t / "features.npy", t / "ivf", W=W, nlist=NLIST, shard_rows=1100, normalize=True)
    return t, X, Q, W.astype(np.float64).T @ W.astype(np.float64)


def test_cosine_lists_give_the_exact_cosine_top_k_where_inner_product_candidates_miss(spread):
    t, X, Q, M = spread
    ivf = OnDiskIVF(t / "ivf")
    qm = ivf.metric(M, "cosine")
    with np.errstate(invalid="ignore"):
        S = exact_scores(X, Q, M, cosine=True)
    S[:, :5] = -np.inf      # 0/0: Wx = 0, no cosine
    bilinear_before = ivf.search(Q, "trained", {}, "bilinear", K)
    # the inner product's own top 400 (the former pool) misses most of the exact cosine top k
    _, cand = ivf._search(qm.transform(ivf.prepare_queries(Q)), 400, params=faiss.SearchParametersIVF(nprobe=NLIST))
    truth = np.argsort(-S, axis=1)[:, :K]
    assert np.mean([np.isin(tr, c).mean() for tr, c in zip(truth, cand, strict=True)]) < 0.5
    with pytest.raises(UserError) as e:
        ivf.search(Q, "trained", {}, "cosine", K)
    msg = str(e.value)
    assert "\n" not in msg and f"python -m index ivf-build --ivf {t / 'ivf'} --cosine-for trained`" in msg
    out = build_cosine_lists(t / "ivf", "trained")
    man = json.loads((out / "cosine.json").read_text())
    assert out == t / "ivf" / "cosine" / "trained" and man["rank"] == 4 and man["nlist"] == NLIST
    # all lists probed, the default pool (k × 10 = 100 of 3000): the exact cosine top k
    res = ivf.search(Q, "trained", {}, "cosine", K)
    assert recall_up_to_ties(S, res.rows) == 1.0
    np.testing.assert_allclose(res.scores, np.take_along_axis(S, res.rows, 1), rtol=1e-4, atol=1e-5)
    assert not np.isin(res.rows, np.arange(5)).any()       # Wx = 0 has no cosine
    np.testing.assert_array_equal(ivf.search_metric(Q, qm, K).rows, res.rows)  # found by M′ alone
    # fewer lists probed still find it here; the bilinear search is untouched by the cosine lists
    assert recall_up_to_ties(S, ivf.search_metric(Q, qm, K, nprobe=NLIST // 2).rows) >= 0.9
    bilinear_after = OnDiskIVF(t / "ivf").search(Q, "trained", {}, "bilinear", K)
    np.testing.assert_array_equal(bilinear_after.rows, bilinear_before.rows)
    np.testing.assert_array_equal(bilinear_after.scores, bilinear_before.scores)


def test_cosine_lists_missing_or_stale_are_refused_in_one_line(spread, tmp_path):
    t, X, Q, M = spread
    ivf = OnDiskIVF(t / "ivf")
    with pytest.raises(UserError, match=r"needs cosine lists for this M′; build them with `python -m index "
                                        r"ivf-build --ivf .* --cosine-for random-psd --r 0.5 --seed 3`, "
                                        r"or search with --mode bilinear$"):
        ivf.search(Q, "random-psd", {"r": 0.5, "seed": 3}, "cosine", K)
    with pytest.raises(UserError, match="--cosine-for STRATEGY` with the strategy of this M′"):
        ivf.search_metric(Q, ivf.metric(np.eye(DIM), "cosine"), K)
    with pytest.raises(UserError, match="cosine mode needs a positive semi-definite M′"):
        build_cosine_lists(t / "ivf", "diagonal", {"r": 0.5})
    # lists of other features are refused, naming the rebuild
    import shutil

    np.save(tmp_path / "other.npy", X[::-1].copy())
    build_ondisk_ivf(tmp_path / "other.npy", tmp_path / "ivf", nlist=NLIST, normalize=True)
    if not (t / "ivf" / "cosine" / "trained").is_dir():  # another test of the module may have built them
        build_cosine_lists(t / "ivf", "trained")
    shutil.copytree(t / "ivf" / "cosine", tmp_path / "ivf" / "cosine")
    with pytest.raises(UserError, match=r"were built for another on-disk IVF: rebuild them with `python -m index "
                                        r"ivf-build --ivf .* --cosine-for trained`"):
        OnDiskIVF(tmp_path / "ivf").search_metric(Q, ivf.metric(M, "cosine"), K)
    (tmp_path / "ivf" / "cosine" / "trained" / "cosine.json").write_text("{")
    with pytest.raises(UserError, match="have no readable cosine.json: rebuild them with ivf-build --ivf"):
        OnDiskIVF(tmp_path / "ivf").search_metric(Q, ivf.metric(M, "cosine"), K)


def test_cosine_refuses_an_indefinite_metric(built):
    t, X, Q, M_star = built
    ivf = OnDiskIVF(t / "ivf")
    with pytest.raises(UserError, match="cosine mode needs a positive semi-definite M′"):
        ivf.metric(refine("diagonal", M_star, {"r": 0.5}), "cosine")


class CountingRows:
    """Stands in for the memory-mapped features and records every row read."""

    def __init__(self, mm):
        self.mm, self.reads = mm, []

    def __getitem__(self, rows):
        self.reads.append(np.asarray(rows))
        return self.mm[rows]


def test_rerank_reads_only_candidate_rows_in_order(built):
    t, X, Q, M_star = built
    ivf = OnDiskIVF(t / "ivf", nprobe=2)
    ivf.features = CountingRows(ivf.features)
    qm = ivf.metric(M_star)
    kc = qm.candidate_count(K, N, 10)
    _, cand = ivf._search(qm.transform(Q / np.linalg.norm(Q, axis=1, keepdims=True)), kc,
                               params=faiss.SearchParametersIVF(nprobe=2))
    res = ivf.search_metric(Q, qm, K)
    (read,) = ivf.features.reads   # one sorted read for the whole block of queries
    np.testing.assert_array_equal(read, np.unique(cand[cand >= 0]))
    assert len(read) < N / 2 and np.isin(res.rows, read).all()


def test_for_index_directory_and_refusals(tmp_path):
    X, Q, M_star = data(1)
    W = np.linalg.cholesky(M_star + 1e-6 * np.eye(DIM)).T[:6]
    items = Items(np.arange(N), np.zeros(N, np.int64), [""] * N, ["g"] * N)
    idx = write_index(tmp_path / "idx", X * 3, items, W, normalize=True, info={})
    out = build_for_index(idx, nlist=NLIST)
    ivf = OnDiskIVF(out)
    assert out == idx / "ivf_ondisk" and ivf.manifest["normalize"] is True
    # queries are L2-normalised like the stored features: a scaled query ranks the same
    M = np.eye(DIM)
    np.testing.assert_array_equal(ivf.search_metric(Q * 5, ivf.metric(M), K).rows,
                                  ivf.search_metric(Q, ivf.metric(M), K).rows)
    with pytest.raises(UserError, match="nprobe must be in"):
        ivf.search_metric(Q, ivf.metric(M), K, nprobe=NLIST + 1)
    with pytest.raises(UserError, match="query features have dimension 5"):
        ivf.search_metric(Q[:, :5], ivf.metric(M), K)
    np.save(tmp_path / "other.npy", X[::-1].copy())
    with pytest.raises(UserError, match="is not the one this on-disk index was built from"):
        OnDiskIVF(out, features=tmp_path / "other.npy")
    with pytest.raises(UserError, match="needs at least 64 training rows"):
        build_ondisk_ivf(tmp_path / "other.npy", tmp_path / "x", nlist=64, train_size=10)
    with pytest.raises(UserError, match="cannot make an on-disk IVF index"):
        build_ondisk_ivf(tmp_path / "other.npy", tmp_path / "x", nlist=4, codec="Bogus")


def test_cli_builds_from_an_index_and_searches_like_flat_under_every_strategy(tmp_path, capsys):
    X, Q, M_star = data(2)
    W = np.random.default_rng(2).standard_normal((6, DIM)).astype(np.float32)
    items = Items(np.arange(N) + 50, np.arange(N) % 7, [f"{i}.png" for i in range(N)], ["g"] * N)
    idx = write_index(tmp_path / "idx", X, items, W, normalize=True, info={})
    np.save(tmp_path / "q.npy", Q[:4])
    assert main(["ivf-build", "--index", str(idx), "--nlist", str(NLIST), "--shard-rows", "1000"]) == 0
    built = json.loads(capsys.readouterr().out)
    assert built["shards"] == 3 and built["ivf"] == str(idx / "ivf_ondisk")
    # the default's lists: the app's two default searches
    assert [(c["strategy"], c["rank"]) for c in built["cosine"]] == [("trained", 6), ("identity", DIM)]
    psd = ["--strategy", "random-psd", "--r", "0.5", "--seed", "2"]
    assert main(["ivf-build", "--ivf", str(idx / "ivf_ondisk"), "--cosine-for", *psd[1:]]) == 0
    [added] = json.loads(capsys.readouterr().out)
    assert added["params"] == {"r": 0.5, "seed": 2, "psd": "abs"} and added["rank"] == DIM
    runs = [(["--strategy", name, "--mode", "bilinear"]
             + [x for kv in params.items() for x in (f"--{kv[0]}", str(kv[1]))], [])
            for name, params in STRATEGIES]
    # cosine, from each strategy's cosine lists; a pool of every row makes the re-rank decide alone
    runs += [(["--mode", "cosine"], ["--rerank-factor", str(N // K)]), (psd + ["--mode", "cosine"], [])]
    for flags, pool in runs:
        flags = ["search", "--features", str(tmp_path / "q.npy"), "--k", str(K)] + flags
        assert main(flags + ["--index", str(idx)]) == 0
        want = json.loads(capsys.readouterr().out)["queries"]
        assert main(flags + pool + ["--backend", "ondisk", "--index", str(idx), "--nprobe", str(NLIST)]) == 0
        got = json.loads(capsys.readouterr().out)["queries"]
        for a, b in zip(got, want, strict=True):   # all lists probed: the exact top-k, with the index's metadata
            assert ([(r["id"], r["relative_path"]) for r in a["results"]]
                    == [(r["id"], r["relative_path"]) for r in b["results"]])
            np.testing.assert_allclose([r["score"] for r in a["results"]], [r["score"] for r in b["results"]],
                                       rtol=1e-4, atol=1e-5)
    search = ["search", "--features", str(tmp_path / "q.npy"), "--backend", "ondisk", "--index", str(idx)]
    want = f"--ivf {idx / 'ivf_ondisk'} --cosine-for random-psd --r 0.5 --seed 5 --psd abs`"
    with pytest.raises(UserError, match=want):
        main(search + ["--strategy", "random-psd", "--seed", "5"])     # no lists for this seed
    with pytest.raises(UserError, match="--ivf DIR adds cosine lists to an existing on-disk IVF"):
        main(["ivf-build", "--ivf", str(idx / "ivf_ondisk"), "--index", str(idx)])
    with pytest.raises(UserError, match="--cosine-for trained,identity takes no --r"):
        main(["ivf-build", "--ivf", str(idx / "ivf_ondisk"), "--r", "0.5"])
    # a flag goes to the listed strategies that take it
    assert main(["ivf-build", "--ivf", str(idx / "ivf_ondisk"), "--cosine-for", "identity,spectral", "--p", "0.5"]) == 0
    assert [(c["strategy"], c["params"]) for c in json.loads(capsys.readouterr().out)] == [
        ("identity", {}), ("spectral", {"p": 0.5})]
    with pytest.raises(UserError, match="unknown"):
        main(["ivf-build", "--ivf", str(idx / "ivf_ondisk"), "--cosine-for", "bogus"])


def test_cli_builds_from_bare_features_and_refuses_bad_input(tmp_path, capsys):
    X, Q, M_star = data(3)
    np.save(tmp_path / "F.npy", X)
    np.save(tmp_path / "raw.npy", X * 2)
    np.save(tmp_path / "q.npy", Q[:2])
    np.save(tmp_path / "W.npy", np.ones((3, DIM), np.float32))
    out = tmp_path / "ivf"
    assert main(["ivf-build", "--features", str(tmp_path / "F.npy"), "--neck", str(tmp_path / "W.npy"),
                 "--normalized", "--out", str(out), "--nlist", str(NLIST)]) == 0
    capsys.readouterr()
    np.testing.assert_array_equal(OnDiskIVF(out).W, np.ones((3, DIM)))
    assert main(["search", "--backend", "ondisk", "--ivf", str(out), "--features", str(tmp_path / "q.npy")]) == 0
    hits = json.loads(capsys.readouterr().out)["queries"][0]["results"]
    assert len(hits) == 10 and set(hits[0]) == {"rank", "row", "score"}   # no index directory: rows only
    with pytest.raises(UserError, match="does not hold L2-normalised rows"):
        main(["ivf-build", "--features", str(tmp_path / "raw.npy"), "--normalized", "--out", str(tmp_path / "x")])
    with pytest.raises(UserError, match="--features needs --out"):
        main(["ivf-build", "--features", str(tmp_path / "F.npy")])
    with pytest.raises(UserError, match="give one of --index IDX"):
        main(["ivf-build"])
    with pytest.raises(UserError, match="--backend ondisk needs --ivf DIR"):
        main(["search", "--backend", "ondisk", "--features", str(tmp_path / "q.npy")])


def test_search_works_after_faiss_torch_utils_patched_index_search(built):
    import faiss.contrib.torch_utils  # noqa: F401  (pytorch-metric-learning imports it: Index.search loses `params`)

    t, X, Q, M_star = built
    ivf = OnDiskIVF(t / "ivf")
    res = ivf.search_metric(Q, ivf.metric(M_star), K, nprobe=NLIST)
    assert recall_up_to_ties(exact_scores(X, Q, M_star), res.rows) == 1.0
