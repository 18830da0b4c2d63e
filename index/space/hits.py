"""The one result of every search and re-ranker, `Hits`: the top k rows per query, their
scores, and the gallery's item metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # only the type: the metadata's columns are read, never built, here
    from ..backends.store import Items

# one search result, the same in `index search --json` (every backend) and the app's API
HIT_FIELDS = ("rank", "id", "label", "class_name", "score", "relative_path")


@dataclass(eq=False)  # identity semantics: fields hold numpy arrays
class Hits:
    """The top k of each of n queries, best first, and the metadata of the items found."""
    rows: np.ndarray                 # n × k int64 positions in the gallery (−1 = no result)
    scores: np.ndarray               # n × k float32 similarities under M′ (higher is more similar)
    items: Items | None = None       # ids, labels, paths, splits; None: the gallery has none
    at: np.ndarray | None = None     # n × k positions of each hit in `items` (None: `rows`)
    class_names: dict[int, str] = field(default_factory=dict)

    @property
    def k(self) -> int:
        return int(self.rows.shape[1])

    def _column(self, values: np.ndarray) -> np.ndarray:
        pos = self.rows if self.at is None else self.at
        if len(values) == 0:
            return np.full(self.rows.shape, -1, dtype=np.int64)
        return np.where(self.rows >= 0, np.asarray(values)[np.maximum(pos, 0)], -1)

    @property
    def ids(self) -> np.ndarray | None:
        """n × k item ids (−1 = no result); None without metadata."""
        return None if self.items is None else self._column(self.items.ids)

    @property
    def labels(self) -> np.ndarray | None:
        """n × k class labels (−1 = no result, or unknown); None without metadata."""
        return None if self.items is None else self._column(self.items.labels)

    def results(self) -> list[list[dict]]:
        """Each query's hits as HIT_FIELDS dicts (the CLI's JSON and the app's API); a
        gallery without metadata (an on-disk IVF built from bare features) gives rank, row, score."""
        items, names = self.items, self.class_names
        out: list[list[dict]] = []
        for rows, at, scores in zip(self.rows, self.rows if self.at is None else self.at, self.scores, strict=True):
            kept = [(int(r), int(a), float(s)) for r, a, s in zip(rows, at, scores, strict=True) if r >= 0]
            if items is None:
                out.append([{"rank": i + 1, "row": r, "score": s} for i, (r, _, s) in enumerate(kept)])
                continue
            out.append([{"rank": i + 1, "id": int(items.ids[a]), "label": int(items.labels[a]),
                         "class_name": names.get(int(items.labels[a]), str(int(items.labels[a]))),
                         "score": s, "relative_path": items.paths[a]}
                        for i, (_, a, s) in enumerate(kept)])
        return out
