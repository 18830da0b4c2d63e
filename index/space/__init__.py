"""The metric-space layer, below every backend (index/backends) and every re-ranker
(index/rerankers): a gallery under one (strategy, params, mode) as a `MetricSpace`, its
result type `Hits`, and the state kept for it (the process's one memory cache with its byte
budget, and the offline artefacts on disk).  Backends return a space; re-rankers read one."""
from core.memory import CACHE, memory_budget, parse_bytes, set_memory_budget

from .hits import HIT_FIELDS, Hits
from .pages import SCAN_CELLS, read_rows
from .protocol import MetricSpace, as_rows, drop_rows
from .searcher_space import GATHER_CELLS, SearcherSpace
from .spaces import gallery_space
from .store import OfflineStore, cache_root, fingerprint, key_hash, prune

__all__ = ["CACHE", "GATHER_CELLS", "HIT_FIELDS", "Hits", "MetricSpace", "OfflineStore", "SCAN_CELLS", "SearcherSpace",
           "as_rows", "cache_root", "drop_rows", "fingerprint", "gallery_space", "key_hash", "memory_budget",
           "parse_bytes", "prune", "read_rows", "set_memory_budget"]
