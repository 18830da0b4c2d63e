"""Where the re-rankers' offline parts (gallery–gallery neighbour lists, row minima, DBA's
augmented gallery) are kept between processes.

Location: `$XDG_CACHE_HOME/dml-retrieval/rerank/` (`~/.cache/…` when unset), or a folder the
caller names; never inside an index folder (the index's checksum verification reads every file
there) nor beside the user's images.  One sub-folder per metric space, named by its cache key:
a hash of (index content fingerprint, strategy and its parameters, mode).  Adding or removing
items changes the fingerprint, so a changed index never reads an old entry; the old folder is
left for `prune` (or the user) to delete.  Files are `.npz` written atomically (core/atomic.py)
and read with `allow_pickle=False`.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np

from core.atomic import write_text, write_with
from core.errors import UserError

FORMAT = 1  # bump when an artefact's layout changes: old entries are then never read


def cache_root() -> Path:
    """The re-ranking cache folder: $XDG_CACHE_HOME/dml-retrieval/rerank (default ~/.cache/…)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "dml-retrieval" / "rerank"


def check_outside(cache: Path, index_dir: Path | None) -> None:
    """Refuse a cache folder inside the index folder: its files would not be in the manifest, and
    a cache there would be deleted with every rebuild of the index."""
    if index_dir is None:
        return
    c, i = Path(cache).resolve(), Path(index_dir).resolve()
    if c == i or i in c.parents:
        raise UserError(f"the re-ranking cache {cache} is inside the index folder {index_dir}; "
                        f"choose a cache folder elsewhere (XDG_CACHE_HOME)")


def fingerprint(data) -> str:
    """The index's content, as a hash: the manifest's per-file checksums for an index directory
    (already verified when it was read), else the features, neck and ids themselves."""
    files = data.manifest.get("files") if isinstance(data.manifest, dict) else None
    h = hashlib.sha256()
    if files:
        h.update(json.dumps({"files": files, "count": data.manifest.get("count")}, sort_keys=True).encode())
    else:
        for a in (np.ascontiguousarray(data.features), np.ascontiguousarray(data.W), data.items.ids):
            h.update(str((a.dtype.str, a.shape)).encode())
            h.update(np.ascontiguousarray(a).data.cast("B"))
    return h.hexdigest()


def key_hash(*parts) -> str:
    """A short stable hash of JSON-able parts (names, parameter dicts, numbers)."""
    return hashlib.sha256(json.dumps([FORMAT, *parts], sort_keys=True, default=repr).encode()).hexdigest()[:32]


class OfflineStore:
    """One metric space's artefacts on disk: `load(name, params)` the arrays stored under
    (name, params), None when absent or unreadable; `save` stores them atomically.  What is in
    memory is the layer's cache (memory.py), not this store's."""

    def __init__(self, root: Path, space_key: str, describe: dict | None = None):
        self.dir = Path(root) / space_key
        self.describe = describe or {}

    def path(self, name: str, params: dict | None = None) -> Path:
        return self.dir / f"{name}-{key_hash(name, params or {})}.npz"

    def load(self, name: str, params: dict | None = None) -> dict[str, np.ndarray] | None:
        p = self.path(name, params)
        if not p.is_file():
            return None
        try:
            with np.load(p, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError):
            return None  # unreadable (another writer's leftover, a full disk once): recompute

    def save(self, name: str, params: dict | None, arrays: dict[str, np.ndarray]) -> None:
        p = self.path(name, params)
        p.parent.mkdir(parents=True, exist_ok=True)
        if not (self.dir / "space.json").is_file():
            write_text(self.dir / "space.json", json.dumps(self.describe, indent=2, default=repr) + "\n")

        def writer(tmp: Path) -> None:
            with open(tmp, "wb") as f:  # a file object: np.savez would append .npz to a bare name
                np.savez(f, allow_pickle=False, **arrays)
        write_with(p, writer)


def prune(root: Path | None = None, keep: set[str] | None = None) -> list[Path]:
    """Delete every space folder under the cache root whose key is not in `keep`."""
    root = Path(root or cache_root())
    if not root.is_dir():
        return []
    gone = [p for p in root.iterdir() if p.is_dir() and p.name not in (keep or set())]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True)
    return gone
