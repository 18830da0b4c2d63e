"""Why a result moved between two configurations: its rank and score under each, and the score
difference split over the eigen-directions of D = M_B − M_A:

    s_B − s_A = qᵀDx / n_B  +  qᵀM_A x · (1/n_B − 1/n_A),   qᵀDx = Σᵢ μᵢ (vᵢᵀq)(vᵢᵀx)

(n: the cosine's norm factor ‖q‖_M ‖x‖_M, 1 for a bilinear side; an eigenspace of equal μ once,
along P q / ‖P q‖).  A re-ranked side gets its placement and the neighbourhood its re-ranker
reads instead (`SUPPORT`, `FULL_DEPTH`).  The derivation and the panel: docs/app-and-compare.md.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from ..backends.search import Searcher
from ..refinements import strategy_key
from ..rerankers import RERANKERS, ranked_pool
from ..search_config import NO_RERANK, SearchConfig
from ..space import CACHE, key_hash
from .compare import data_digest

EIG_TOL = 1e-9  # eigenvalues within this × max |μ| of their neighbour share an eigenspace
STRIP = 8       # gallery items shown per direction
SUPPORT = 8     # neighbours shown per side of a re-ranked configuration (the query's, x's)
FULL_DEPTH = 1000  # how far a re-ranked list that covers the whole gallery is read to place x


@dataclass
class Direction:
    """One eigenspace of D = M_B − M_A and its part of the score difference."""
    eigenvalue: float    # μ (an eigenspace's mean)
    dim: int             # 1, or the eigenspace's dimension
    vector: np.ndarray   # unit vector in trunk-feature space (d,)
    q_proj: float        # vᵀq
    x_proj: float        # vᵀx
    term: float          # Σ μᵢ (vᵢᵀq)(vᵢᵀx) / n_B over the eigenspace


@dataclass
class ScoreChange:
    mode_a: str
    mode_b: str
    score_a: float
    score_b: float
    bilinear_a: float    # qᵀM_A x
    bilinear_b: float
    norm_a: float        # ‖q‖_M_A ‖x‖_M_A in cosine mode, 1 in bilinear
    norm_b: float
    norm_term: float     # qᵀM_A x · (1/n_B − 1/n_A): the norms' part of the difference
    directions: list[Direction] = field(default_factory=list)  # every eigenspace, largest |term| first

    @property
    def delta(self) -> float:
        return self.score_b - self.score_a

    @property
    def bilinear_term(self) -> float:
        """qᵀDx / n_B: the directions' terms together."""
        return float(sum(d.term for d in self.directions))

    @property
    def parts_sum(self) -> float:
        return self.bilinear_term + self.norm_term

    def top(self, n: int) -> tuple[list[Direction], float]:
        """The n directions that carry most of the move, and the sum of the others' terms."""
        return self.directions[:n], float(sum(d.term for d in self.directions[n:]))


@dataclass
class Eigenspaces:
    """D = M_B − M_A = V diag(μ) Vᵀ, its eigenvalues grouped into eigenspaces (`starts`: the
    first column of each group in V's ascending order)."""
    mu: np.ndarray
    V: np.ndarray
    starts: np.ndarray

    @classmethod
    def of(cls, M_a: np.ndarray, M_b: np.ndarray, tol: float = EIG_TOL) -> Eigenspaces:
        D = np.asarray(M_b, dtype=np.float64) - np.asarray(M_a, dtype=np.float64)
        mu, V = np.linalg.eigh((D + D.T) / 2)
        scale = max(float(np.abs(mu).max(initial=0.0)), 1e-300)
        gaps = np.diff(mu) > tol * scale
        return cls(mu, V, np.concatenate([[0], np.nonzero(gaps)[0] + 1]).astype(np.int64))


def _arrays(sp: Eigenspaces) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return sp.mu, sp.V, sp.starts


def side_score(q: np.ndarray, x: np.ndarray, M: np.ndarray, mode: str) -> tuple[float, float, float]:
    """(score, qᵀMx, n) of one configuration: n = ‖q‖_M ‖x‖_M in cosine mode (PSD M), else 1;
    score = qᵀMx / n, as the search ranks (a zero norm scores 0, as the cosine index does)."""
    bil = float(q @ M @ x)
    if mode != "cosine":
        return bil, bil, 1.0
    n = float(np.sqrt(max(float(q @ M @ q), 0.0)) * np.sqrt(max(float(x @ M @ x), 0.0)))
    return (bil / n if n > 0 else 0.0), bil, n


def explain_change(q: np.ndarray, x: np.ndarray, M_a: np.ndarray, mode_a: str, M_b: np.ndarray, mode_b: str,
                   spaces: Eigenspaces | None = None) -> ScoreChange:
    """The score of x for the query q under A = (M_a, mode_a) and B = (M_b, mode_b), and their
    difference split into a term per eigenspace of M_b − M_a plus the norms' term (module doc).
    `spaces`: the eigendecomposition of M_b − M_a, where already computed."""
    q = np.asarray(q, dtype=np.float64).reshape(-1)
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    sa, ba, na = side_score(q, x, M_a, mode_a)
    sb, bb, nb = side_score(q, x, M_b, mode_b)
    inv_a = 1.0 / na if na > 0 else 0.0
    inv_b = 1.0 / nb if nb > 0 else 0.0
    sp = spaces or Eigenspaces.of(M_a, M_b)
    pq, px = sp.V.T @ q, sp.V.T @ x
    terms = sp.mu * pq * px * inv_b
    ends = np.append(sp.starts[1:], len(sp.mu))
    dirs = []
    for s, e in zip(sp.starts, ends, strict=True):
        term = float(terms[s:e].sum())
        if e - s == 1:
            v, a, b = sp.V[:, s], float(pq[s]), float(px[s])
            if a < 0:  # an eigenvector's sign is arbitrary: show the query on the positive side
                v, a, b = -v, -a, -b
        else:
            a = float(np.linalg.norm(pq[s:e]))
            v = sp.V[:, s:e] @ (pq[s:e] / a) if a > 0 else sp.V[:, s]
            b = float(v @ x)
        dirs.append(Direction(float(sp.mu[s:e].mean()), int(e - s), v, a, b, term))
    dirs.sort(key=lambda d: -abs(d.term))
    return ScoreChange(mode_a, mode_b, sa, sb, ba, bb, na if mode_a == "cosine" else 1.0,
                       nb if mode_b == "cosine" else 1.0, ba * (inv_b - inv_a), dirs)


@dataclass
class Placement:
    """Where the item sits under one configuration."""
    label: str
    score: float
    rank: int        # 1-based, in the exact full ranking (the query's own item left out); with a
    #                  re-ranker: in the re-ranked list, or where x is beyond it, under the strategy alone
    in_top_k: bool
    reranked: bool = False  # the configuration has a re-ranker: `score` is the re-ranker's own
    beyond: int = 0         # > 0: x is not among the first `beyond` of the re-ranked list
    pool: bool = False      # `beyond` is the re-ranker's candidate pool (not only how far it was read)

    def rank_text(self) -> str:
        """'12', or where x is beyond the re-ranked list, where it is instead."""
        if not self.beyond:
            return str(self.rank)
        where = ("beyond the re-ranker's candidate pool" if self.pool else
                 f"beyond the first {self.beyond:,} of the re-ranked list")
        return f"{where} (rank under the strategy alone: {self.rank})"


@dataclass
class Link:
    """One neighbour y of the query (or of x) under a side's strategy alone, and how y sees the
    other one (x, or the query)."""
    row: int
    near_rank: int      # y's rank in the list it was taken from (the query's, or x's)
    near_score: float   # s(query, y), or s(x, y)
    far_rank: int       # x's rank in y's own list, or y's rank in the query's list
    far_score: float    # s(y, x), or s(query, y)


@dataclass
class Support:
    """The neighbourhood a re-ranked side reads, under its strategy alone (module doc)."""
    side: str            # "left" or "right"
    label: str           # the configuration's label, re-ranker included
    rerank: str
    rerank_doc: str
    of_query: list[Link]  # the query's nearest items; far: x's rank in each one's list
    of_item: list[Link]   # x's nearest items; far: each one's rank in the query's list

    def shared(self, k: int) -> tuple[int, int]:
        """(of the query's neighbours, those that rank x in their top k; of x's, those in the
        query's top k)."""
        return sum(n.far_rank <= k for n in self.of_query), sum(n.far_rank <= k for n in self.of_item)


@dataclass
class Why:
    item_row: int
    k: int
    left: Placement
    right: Placement
    change: ScoreChange | None  # None: a side has a re-ranker, the decomposition does not apply
    shown: list[Direction]   # the directions that carry most of the move
    rest: float              # the other directions' terms together
    strips: list[list[tuple[int, float]]]  # per shown direction: gallery rows with the largest |vᵀx|, and vᵀx
    support: list[Support] = field(default_factory=list)  # per re-ranked side
    note: str = ""           # why the decomposition is not shown


class Explainer:
    """`why` for the app and the tests.  The eigendecomposition of M_B − M_A (per pair of metrics)
    and each direction's gallery strip are kept in the process's memory cache
    (core.memory.CACHE), keyed by a digest of the gallery and what made them."""

    def __init__(self, searcher: Searcher, key: str | None = None):
        """`key`: the gallery's digest where the caller has it (default: `compare.data_digest`
        of the searcher's data, computed when first needed)."""
        self.searcher = searcher
        self.data = searcher.data
        self._key = key

    @property
    def key(self) -> str:
        if self._key is None:  # two threads may both compute it: the same string
            self._key = data_digest(self.data)
        return self._key

    def resolved(self, cfg: SearchConfig) -> SearchConfig:
        cfg.check_searchable()
        return cfg.with_mode(self.searcher.resolve_mode(cfg.strategy, cfg.params, cfg.mode)[0])

    def spaces(self, a: SearchConfig, b: SearchConfig) -> Eigenspaces:
        ma, mb = self.searcher.metric(a.strategy, a.params), self.searcher.metric(b.strategy, b.params)
        key = ("analysis.explain", key_hash(self.key, "eigenspaces", strategy_key(a.strategy, ma.params),
                                            strategy_key(b.strategy, mb.params)))
        # a d × d eigendecomposition: once per pair of metrics, kept as arrays (what the cache measures)
        mu, V, starts = CACHE.get_or_build(key, lambda: _arrays(Eigenspaces.of(ma.M, mb.M)))
        return Eigenspaces(mu, V, starts)

    def scores(self, q: np.ndarray, cfg: SearchConfig) -> np.ndarray:
        """The query's score against every gallery item under `cfg` (mode as given), as the
        exact search ranks them (float32)."""
        return self.scores_of(np.asarray(q, dtype=np.float32).reshape(1, -1), cfg)[0]

    def scores_of(self, Q: np.ndarray, cfg: SearchConfig) -> np.ndarray:
        """`scores` of each row of Q (prepared queries, m × d): m × n, the gallery read once."""
        transform, _, norms = self.searcher.query_view(cfg.strategy, cfg.params, cfg.mode)
        qt = transform(np.asarray(Q, dtype=np.float32))
        feats = self.data.features
        out = np.empty((len(qt), len(self.data.items)), dtype=np.float32)
        for s in range(0, out.shape[1], 65536):
            out[:, s: s + 65536] = qt @ np.asarray(feats[s: s + 65536], dtype=np.float32).T
        if norms is not None:
            out *= np.where(norms > 0, 1.0 / np.maximum(norms, 1e-30), 0.0).astype(np.float32)[None, :]
        return out

    def rank(self, q: np.ndarray, row: int, cfg: SearchConfig, self_row: int | None = None) -> int:
        """1-based rank of gallery row `row` in the full ranking under `cfg`, `self_row` left out."""
        s = self.scores(q, cfg)
        if self_row is not None and self_row >= 0:
            s[self_row] = -np.inf
        return int((s > s[row]).sum()) + 1

    def strip(self, v: np.ndarray, n: int = STRIP) -> list[tuple[int, float]]:
        """The n gallery rows that project most strongly onto the direction v (largest |vᵀx|),
        with vᵀx."""
        v = np.asarray(v, dtype=np.float64)
        canon = v * (1.0 if v[int(np.argmax(np.abs(v)))] >= 0 else -1.0)  # ±v: the same strip
        key = ("analysis.explain", key_hash(self.key, "strip", int(n),
                                            hashlib.blake2b(canon.tobytes(), digest_size=16).hexdigest()))

        def build() -> tuple[np.ndarray, np.ndarray]:
            v32 = canon.astype(np.float32)
            feats = self.data.features
            proj = np.concatenate([np.asarray(feats[s: s + 65536], dtype=np.float32) @ v32
                                   for s in range(0, len(self.data.items), 65536)])
            rows = np.argsort(-np.abs(proj), kind="stable")[:n]
            return rows.astype(np.int64), proj[rows].astype(np.float64)
        rows, proj = CACHE.get_or_build(key, build)
        sign = 1.0 if np.dot(v, canon) >= 0 else -1.0
        return [(int(r), sign * float(p)) for r, p in zip(rows, proj, strict=True)]

    def why(self, q_feats: np.ndarray, row: int, left: SearchConfig, right: SearchConfig,
            self_row: int | None = None, k: int = 12, top: int = 5, n_strip: int = STRIP) -> Why:
        """Gallery row `row` as a result of the query `q_feats` (trunk features, 1 × d) under
        `left` (A) and `right` (B): rank and score under each, the score difference split over
        the `top` directions that carry most of it (the rest summed), a strip per direction.
        Where a side has a re-ranker: its placement in the re-ranked list and, instead of the
        decomposition, the neighbourhood it reads (`Support`, module doc)."""
        q = self.searcher.prepare_queries(q_feats)
        a, b = self.resolved(left), self.resolved(right)
        if a.rerank != NO_RERANK or b.rerank != NO_RERANK:
            return self._why_reranked(q_feats, q, row, a, b, self_row, k)
        Ma, Mb = self.searcher.metric(a.strategy, a.params).M, self.searcher.metric(b.strategy, b.params).M
        x = np.asarray(self.data.features[row], dtype=np.float32)
        change = explain_change(q[0], x, Ma, a.mode, Mb, b.mode, self.spaces(a, b))
        ranks = [self.rank(q, row, c, self_row) for c in (a, b)]
        places = [Placement(c.label(), s, r, r <= k)
                  for c, s, r in zip((a, b), (change.score_a, change.score_b), ranks, strict=True)]
        shown, rest = change.top(top)
        return Why(int(row), int(k), places[0], places[1], change, shown, rest,
                   [self.strip(d.vector, n_strip) for d in shown])

    # ------------------------------------------------------------ configurations with a re-ranker
    def _why_reranked(self, q_feats, q, row: int, a: SearchConfig, b: SearchConfig, self_row: int | None,
                      k: int) -> Why:
        places = [self.placement(q_feats, q, row, c, self_row, k) for c in (a, b)]
        support = [self.support(side, q, row, c, self_row) for side, c in (("left", a), ("right", b))
                   if c.rerank != NO_RERANK]
        named = " and ".join(f"the {s.side} side's ({s.rerank})" for s in support)
        note = (f"{named[0].upper()}{named[1:]} re-ranker changes the ranking, not the metric: its score is "
                "not qᵀM′x, so the split over the eigen-directions of M_right − M_left does not apply. "
                "Shown instead: the neighbourhood the re-ranker reads, under its strategy alone.")
        return Why(int(row), int(k), places[0], places[1], None, [], 0.0, [], support, note)

    def placement(self, q_feats, q, row: int, cfg: SearchConfig, self_row: int | None, k: int) -> Placement:
        """x's rank and score under `cfg` (mode resolved): the exact full ranking without a
        re-ranker; with one, its position in the re-ranked list read to the re-ranker's pool
        (FULL_DEPTH where it ranks the whole gallery), else the strategy alone's, marked beyond."""
        loo = self_row is not None and self_row >= 0
        plain = cfg.without_rerank()
        if cfg.rerank == NO_RERANK:
            r = self.rank(q, row, plain, self_row)
            return Placement(cfg.label(), float(self.scores(q, plain)[row]), r, r <= k)
        pool = ranked_pool(cfg.rerank, cfg.rerank_params, k, len(self.data.items))
        avail = len(self.data.items) - int(loo)
        depth = min(avail, pool if pool is not None else max(k, FULL_DEPTH))
        hits = cfg.search(self.searcher, q_feats, depth, self_ids=[self_row] if loo else None)
        at = np.nonzero(hits.rows[0] == row)[0]
        if len(at):
            r = int(at[0]) + 1
            return Placement(cfg.label(), float(hits.scores[0][at[0]]), r, r <= k, reranked=True)
        r = self.rank(q, row, plain, self_row)
        return Placement(cfg.label(), float(self.scores(q, plain)[row]), r, False, reranked=True, beyond=depth,
                         pool=pool is not None and depth < avail)

    def support(self, side: str, q, row: int, cfg: SearchConfig, self_row: int | None, m: int = SUPPORT) -> Support:
        """The query's m nearest items and x's rank in each one's list; x's m nearest and each
        one's rank in the query's list; under `cfg`'s strategy alone, the query's own row left
        out of every list (and x of the query's neighbours, the neighbour itself of its own)."""
        plain = cfg.without_rerank()
        s_q = self.scores(q, plain).astype(np.float64)  # s(q, ·), as the search ranks
        gone = [r for r in (self_row,) if r is not None and r >= 0]
        s_q[gone] = -np.inf

        def rank_in(scores: np.ndarray, r: int) -> int:
            return int((scores > scores[r]).sum()) + 1

        def nearest(scores: np.ndarray, leave: list[int]) -> np.ndarray:
            s = scores.copy()
            s[leave] = -np.inf
            return np.argsort(-s, kind="stable")[: min(m, int(np.isfinite(s).sum()))]

        q_order = nearest(s_q, [row])
        feats = self.searcher.prepare_queries(np.asarray(self.data.features[np.append(q_order, row)]))
        S_all = self.scores_of(feats, plain).astype(np.float64)  # s(y, ·) for each neighbour y, then x: one pass
        S = S_all[:-1]
        S[:, gone] = -np.inf
        S[np.arange(len(q_order)), q_order] = -np.inf  # y is not in its own list
        of_query = [Link(int(y), rank_in(s_q, int(y)), float(s_q[y]), rank_in(S[j], row), float(S[j, row]))
                    for j, y in enumerate(q_order)]
        s_x = S_all[-1].copy()  # s(x, ·)
        s_x[gone] = -np.inf
        s_x[row] = -np.inf
        of_item = [Link(int(y), rank_in(s_x, int(y)), float(s_x[y]), rank_in(s_q, int(y)), float(s_q[y]))
                   for y in nearest(s_x, [row])]
        return Support(side, cfg.label(), cfg.rerank, RERANKERS.get(cfg.rerank).doc, of_query, of_item)
