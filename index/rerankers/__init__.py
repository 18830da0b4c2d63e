"""Query-time re-ranking on top of any refined metric M′ and mode.  Adding one: a module with
`@RERANKERS.register`, one import line below."""
from ..space import MetricSpace, SearcherSpace
from . import aqe, dba, diffusion, diffusion_offline, kreciprocal, none  # noqa: F401  (registration: one line per re-ranker)
from .registry import (
    AUTO,
    DEFAULT,
    RERANKERS,
    SIZE_LIMIT,
    WHOLE_GALLERY,
    RerankerSpec,
    candidates,
    check_size_limit,
    clipped,
    first_depth,
    gallery_counts,
    ranked_pool,
    reads_by_row,
    rerank,
    reranker_params,
    resolved,
    size_params,
)

__all__ = ["AUTO", "DEFAULT", "RERANKERS", "SIZE_LIMIT", "WHOLE_GALLERY", "MetricSpace", "RerankerSpec",
           "SearcherSpace", "candidates", "check_size_limit", "clipped", "first_depth", "gallery_counts",
           "ranked_pool", "reads_by_row", "rerank", "reranker_params", "resolved", "size_params"]
