"""A server's bounds on one request's work, light enough for `python -m app --help` to import
(what the process keeps in memory is bounded by `--cache-memory`: app/cache.py)."""

# every re-ranker size parameter (neighbours expanded, k-reciprocal sets, a graph's k) of one
# request, in the panels, the Compare tab and both HTTP APIs (`--max-rerank-size`): the search's
# own cap on k, above every re-ranker's defaults and sweep grids (index.rerankers.SIZE_LIMIT,
# kept here as a number so `python -m app --help` stays light; a test holds the two equal)
DEFAULT_MAX_RERANK_SIZE = 200

# the Compare tab: every leave-one-out query of a gallery up to this many items; above, a seeded
# random sample of COMPARE_SAMPLE queries (app/sampled.py; ~0.1 s a query and side on a 10⁶ on-disk
# IVF with classes of 1,000: docs/app-and-compare.md)
COMPARE_ALL_UP_TO = 10_000
COMPARE_SAMPLE = 200
