"""A server's bounds on one request's work, light enough for `python -m app --help` to import."""

# every re-ranker size parameter (candidates read, neighbours expanded, a graph's pool) of one
# request, in the panels, the Compare tab and both HTTP APIs: above every registered re-ranker's
# defaults, far below the sizes that take a server seconds per request (`--max-rerank-size`)
DEFAULT_MAX_RERANK_SIZE = 10_000
