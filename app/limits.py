"""A server's bounds on one request's work, light enough for `python -m app --help` to import."""

# every re-ranker size parameter (neighbours expanded, k-reciprocal sets, a graph's k) of one
# request, in the panels, the Compare tab and both HTTP APIs (`--max-rerank-size`): the search's
# own cap on k, above every re-ranker's defaults and sweep grids (index.rerankers.SIZE_LIMIT,
# kept here as a number so `python -m app --help` stays light; a test holds the two equal)
DEFAULT_MAX_RERANK_SIZE = 200
