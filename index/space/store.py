"""Where the re-rankers' offline parts (gallery–gallery neighbour lists, row minima, DBA's
augmented gallery) are kept between processes.

Location: `$XDG_CACHE_HOME/dml-retrieval/rerank/` (`~/.cache/…` when unset), or a folder the
caller names; never inside an index folder (the index's checksum verification reads every file
there) nor beside the user's images.  One sub-folder per metric space, named by its cache key:
a hash of (index content fingerprint, strategy and its parameters, mode); one file per artefact,
named by its digest (`MetricSpace.digest`: the space, the artefact's parameters and the digests of
the artefacts it was computed from).  Adding or removing items changes the fingerprint, so a
changed index never reads an old entry.  Files are `.npz` written atomically (core/atomic.py) and
read with `allow_pickle=False`.

Pruning: the folder is kept within a disk budget ($DML_CACHE_DISK, default DISK_DEFAULT).  After
each write, the least recently used files (a read touches its file) are deleted until the rest
fit; the file just written is kept.  Only the cache's own files are counted and deleted: the
artefacts (`*.npz`, and the `*.blocks/` folders of those built in blocks) and the Milvus backend's
copied vectors (`milvus-*/features.npy`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm import tqdm

from core.atomic import write_text, write_with
from core.errors import UserError
from core.flags import parse_size
from core.locks import exclusive_lock

FORMAT = 2  # bump when an artefact's layout changes: old entries are then never read (and pruned)
DISK_ENV, DISK_DEFAULT = "DML_CACHE_DISK", "32G"


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

    def path(self, name: str, digest: str) -> Path:
        return self.dir / f"{name}-{digest}.npz"

    def load(self, name: str, digest: str) -> dict[str, np.ndarray] | None:
        p = self.path(name, digest)
        if not p.is_file():
            return None
        try:
            with np.load(p, allow_pickle=False) as z:
                out = {k: z[k] for k in z.files}
            os.utime(p)  # used: the pruning deletes the least recently used first
            return out
        except (OSError, ValueError, EOFError):
            return None  # unreadable (another writer's leftover, a full disk once): recompute

    def part(self, name: str, digest: str) -> Path:
        """The folder an artefact built in blocks is written to until it is whole."""
        return self.dir / f"{name}-{digest}.part"

    def blocks(self, name: str, digest: str) -> Path:
        """The folder of a whole artefact built in blocks: one memory-mapped `.npy` per array."""
        return self.dir / f"{name}-{digest}.blocks"

    def save(self, name: str, digest: str, arrays: dict[str, np.ndarray]) -> None:
        p = self.path(name, digest)
        p.parent.mkdir(parents=True, exist_ok=True)
        if not (self.dir / "space.json").is_file():
            write_text(self.dir / "space.json", json.dumps(self.describe, indent=2, default=repr) + "\n")

        def writer(tmp: Path) -> None:
            with open(tmp, "wb") as f:  # a file object: np.savez would append .npz to a bare name
                np.savez(f, allow_pickle=False, **arrays)
        write_with(p, writer)
        shutil.rmtree(self.part(name, digest), ignore_errors=True)  # a build in blocks is whole now
        prune(self.dir.parent, keep=p)


def read_blocks(folder: Path, n: int, columns: dict[str, tuple[int, str]]) -> dict[str, np.ndarray] | None:
    """The arrays of a finished `build_in_blocks`, memory-mapped read-only (their pages are the
    kernel's page cache, not the process's own memory); None where the folder is absent,
    unreadable or of another layout."""
    try:
        out = {k: np.load(folder / f"{k}.npy", mmap_mode="r", allow_pickle=False) for k in columns}
    except (OSError, ValueError):
        return None
    if any(out[k].shape != (n, w) or out[k].dtype != np.dtype(t) for k, (w, t) in columns.items()):
        return None
    os.utime(folder)  # used: the pruning deletes the least recently used first
    return out


def build_in_blocks(part: Path, final: Path, n: int, columns: dict[str, tuple[int, str]],
                    fill: Callable[[int, int], dict[str, np.ndarray]], *, block: int,
                    progress: str | None = None) -> dict[str, np.ndarray]:
    """Arrays of n rows ({name: (width, dtype)}), rows start:stop filled by `fill(start, stop)`
    a block at a time into memory-mapped `.npy` files in the folder `part`.  `done.json` records
    the blocks written (after their rows are flushed), so a build cut short resumes after the
    last of them; a folder left by another layout (sizes, block) starts over.  Whole, the folder
    is renamed `final` (atomically: a reader sees no folder or a whole one).  One process builds
    at a time (the others wait for its lock, then read what it built).  Returns `read_blocks`."""
    layout = {"n": int(n), "block": int(block), "columns": {k: [int(w), str(np.dtype(t))] for k, (w, t) in
                                                          sorted(columns.items())}}
    part.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(part, "the neighbour-graph build", wait=True):
        got = read_blocks(final, n, columns)
        if got is not None:  # another process finished it while this one waited
            shutil.rmtree(part, ignore_errors=True)
            return got
        part.mkdir(parents=True, exist_ok=True)
        state = part / "done.json"
        done = 0
        try:
            saved = json.loads(state.read_text())
            if saved.get("layout") == layout:
                done = int(saved["blocks"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none yet, or unreadable: from the start
        arrays = {}
        for k, (w, t) in columns.items():
            path = part / f"{k}.npy"
            mode = "r+" if done and path.is_file() else "w+"
            arrays[k] = np.lib.format.open_memmap(path, mode=mode, dtype=np.dtype(t), shape=(n, w))
        starts = range(0, n, block)
        with tqdm(total=len(starts), initial=min(done, len(starts)), desc=progress, unit="block",
                  disable=progress is None) as bar:
            for i in range(done, len(starts)):
                a, b = starts[i], min(starts[i] + block, n)
                values = fill(a, b)
                for k, arr in arrays.items():
                    arr[a:b] = values[k]
                    arr.flush()
                write_text(state, json.dumps({"layout": layout, "blocks": i + 1}))
                bar.update(1)
        del arrays
        shutil.rmtree(final, ignore_errors=True)  # an unreadable leftover of another layout
        os.replace(part, final)
    got = read_blocks(final, n, columns)
    if got is None:
        raise UserError(f"cannot read the arrays just written to {final}")
    return got


def disk_budget() -> int:
    """The cache folder's disk budget: $DML_CACHE_DISK (a size such as 32G), else DISK_DEFAULT."""
    text = os.environ.get(DISK_ENV, "").strip() or DISK_DEFAULT
    try:
        return parse_size(text, DISK_ENV)
    except ValueError as e:
        raise UserError(str(e)) from None


def _own_entries(root: Path) -> list[tuple[float, int, Path]]:
    """(last use, bytes, path) of the cache's own files and block folders under `root`."""
    out = []
    for p in [*root.glob("*/*.npz"), *root.glob("milvus-*/features.npy"), *root.glob("*/*.blocks")]:
        try:
            files = [p] if p.is_file() else [f for f in p.iterdir() if f.is_file()]
            out.append((p.stat().st_mtime, sum(f.stat().st_size for f in files), p))
        except OSError:
            continue  # deleted meanwhile by another process's pruning
    return out


def prune(root: Path | None = None, budget: int | None = None, keep: Path | None = None) -> list[Path]:
    """Delete the cache's least recently used files under `root` until the rest take at most
    `budget` bytes (default `disk_budget()`), never `keep`; then the folders left empty of
    artefacts.  Returns the files deleted."""
    root = Path(root or cache_root())
    if not root.is_dir():
        return []
    budget = disk_budget() if budget is None else int(budget)
    files = _own_entries(root)
    total = sum(size for _, size, _ in files)
    gone = []
    for _, size, f in sorted(files, key=lambda t: t[0]):
        if total <= budget:
            break
        if keep is not None and f == keep:
            continue
        if f.is_dir():
            shutil.rmtree(f, ignore_errors=True)  # a process that has it memory-mapped keeps reading it
        else:
            f.unlink(missing_ok=True)
        total -= size
        gone.append(f)
    for folder in {f.parent for f in gone}:  # the folders left with no artefact and no build under way
        if not any(p.suffix in (".npz", ".npy", ".part", ".blocks") for p in folder.iterdir()):
            shutil.rmtree(folder, ignore_errors=True)
    return gone
