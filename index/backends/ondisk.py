"""IVF indexes whose inverted lists live on disk, for galleries larger than RAM, built through
FAISS's merge_ondisk route (train on a sample, one shard per chunk of rows, lists merged into
one memory-mapped `ivf.ivfdata`).  The lists (SQ8 by default) only propose candidates; every
score is recomputed exactly under M′ from the memory-mapped float32 features.  `OnDiskIVF` is
a `gallery.Gallery`; re-rankers run in the `MetricSpace` of a `Searcher` over the same
features and lists.  Cosine mode takes its candidates from the strategy's own cosine lists
(`cosine/SLUG/`: an IVF over Lx/‖Lx‖, M′ = LᵀL).  What is computed from the files (M′, the
opened cosine lists, the source index's items) is kept in the process's memory cache, keyed by
what it was made from; the object keeps only its file handles.  The folder layout, the codec choice and why
recall at a given nprobe differs per strategy: docs/scale-out.md ("Indexes larger than RAM").
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime as _dt
import hashlib
import json
import logging
import mmap
import os
import sys
import threading
import time
from pathlib import Path

import faiss
import numpy as np
from faiss.contrib.ondisk import merge_ondisk

from core.arrays import load_npy
from core.atomic import atomic_dir
from core.errors import UserError
from core.manifest import read_manifest

from ..metric import QueryMetric, psd_factor
from ..operator import apply_norms
from ..refinements import shared_params, strategy_params
from ..space import CACHE, Hits, key_hash
from .gallery import NeckGallery, neck_digest, rescore
from .search import Searcher
from .store import IndexData, Items

log = logging.getLogger("index")

FORMAT = "dml-ondisk-ivf"
VERSION = 1
INDEX_FILE, DATA_FILE, NECK_FILE, MANIFEST = "ivf.index", "ivf.ivfdata", "W.npy", "ondisk.json"
COSINE_DIR, COSINE_MANIFEST, FACTOR_FILE = "cosine", "cosine.json", "L.npy"   # PATH/cosine/SLUG/…
DEFAULT_NPROBE = 32
_QUERY_BLOCK = 256  # queries re-ranked together: one sorted read of their candidates' rows


# ---------------------------------------------------------------- helpers
@contextlib.contextmanager
def _c_stdout_to_stderr():
    """FAISS's C++ code printf()s progress ("resizing …", "updating ondisk filename …") to
    stdout; a CLI whose stdout is JSON must not get it.  Send fd 1 to stderr meanwhile."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        libc.fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


class _RowFile:
    """Rows of a float32 N × d .npy read by plain file reads: unlike a memory map, nothing
    read stays counted in the process's RSS once the caller drops it."""

    def __init__(self, path):
        m = load_npy(path, "features", mmap=True)
        assert isinstance(m, np.memmap)  # a .npy loaded with mmap=True
        if m.ndim != 2 or m.dtype != np.dtype("<f4") or not m.flags.c_contiguous:
            raise UserError(f"features file {path} must be a C-ordered float32 N × d array, "
                            f"got {m.dtype} {m.shape}")
        self.path, self.shape, self.offset = Path(path), m.shape, m.offset
        self.row_bytes = m.shape[1] * 4
        del m

    def read(self, start: int, stop: int) -> np.ndarray:
        with open(self.path, "rb") as f:
            f.seek(self.offset + start * self.row_bytes)
            x = np.fromfile(f, dtype="<f4", count=(stop - start) * self.shape[1])
        return x.reshape(stop - start, self.shape[1])

    def take(self, rows: np.ndarray) -> np.ndarray:
        out = np.empty((len(rows), self.shape[1]), dtype=np.float32)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for i, r in enumerate(rows):
                out[i] = np.frombuffer(os.pread(fd, self.row_bytes, self.offset + int(r) * self.row_bytes), "<f4")
        finally:
            os.close(fd)
        return out


def _map_rows(rows: _RowFile) -> np.ndarray:
    """The features memory-mapped read-only, with read-ahead off (MADV_RANDOM): a page fault
    on one candidate's row then reads that page, not the ~128 KiB around it."""
    with open(rows.path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    mm.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mm, dtype="<f4", count=rows.shape[0] * rows.shape[1], offset=rows.offset).reshape(rows.shape)


def _fingerprint(rows: _RowFile) -> str:
    """Checksum of the shape and 256 evenly spaced rows: catches a replaced or regenerated
    features file without hashing gigabytes."""
    n = rows.shape[0]
    h = hashlib.sha256(repr(tuple(rows.shape)).encode())
    h.update(rows.take(np.unique(np.linspace(0, n - 1, min(n, 256)).astype(np.int64))).tobytes())
    return h.hexdigest()


def default_nlist(n: int) -> int:
    """A power of two near √N (FAISS's guidance is 1–16 × √N; the low end keeps the
    coarse assignment cheap on a small machine), with ≥ 39 training rows per list."""
    nl = 2 ** int(round(np.log2(max(np.sqrt(n), 1))))
    return int(max(1, min(nl, n // 39)))


def _write_lists(index, rows: _RowFile, tmp: Path, shard_rows: int, batch_rows: int, transform=None) -> int:
    """Fill the trained `index` with every row (through `transform`, if given), one shard of
    `shard_rows` at a time, and merge the shards' lists into tmp/DATA_FILE; writes tmp/INDEX_FILE.
    Returns the number of shards."""
    n = rows.shape[0]
    shard_files: list[str] = []
    for s0 in range(0, n, shard_rows):
        s1 = min(n, s0 + shard_rows)
        shard = faiss.clone_index(index)
        for b0 in range(s0, s1, batch_rows):
            b1 = min(s1, b0 + batch_rows)
            x = rows.read(b0, b1)
            shard.add_with_ids(x if transform is None else transform(x), np.arange(b0, b1, dtype=np.int64))
        shard_files.append(str(tmp / f"shard{len(shard_files):04d}.index"))
        faiss.write_index(shard, shard_files[-1])
        del shard
        log.info("shard %d: rows %d–%d", len(shard_files), s0, s1)
    # merge_ondisk maps the shards and keeps their lists mapped until the process ends;
    # the shard files are deleted here (their space returns when the process exits)
    with _c_stdout_to_stderr():
        merge_ondisk(index, shard_files, str(tmp / DATA_FILE))
    faiss.write_index(index, str(tmp / INDEX_FILE))
    for f in shard_files:
        os.unlink(f)
    return len(shard_files)


# ---------------------------------------------------------------- build
def build_ondisk_ivf(features, out, *, W: np.ndarray | None = None, nlist: int | None = None, codec: str = "SQ8",
                     shard_rows: int = 1_000_000, train_size: int | None = None, normalize: bool = False,
                     seed: int = 0, batch_rows: int = 65536, source_index=None) -> Path:
    """Build DIR `out` over the float32 N × d `features` .npy (as stored: not re-normalised).

    `W`: the neck (k × d; None: the identity, M* = I).  `normalize` records that the
    features are L2-normalised (the index manifest's `normalize`), so queries get the same;
    it is checked on the training sample.  `train_size` rows (default 64 × nlist) train the
    quantiser.  `source_index`: the index directory whose features these are (search then
    reports its ids, labels and paths).  Written atomically: an interrupted build leaves
    the previous DIR.
    """
    rows = _RowFile(features)
    n, d = rows.shape
    W = np.eye(d, dtype=np.float32) if W is None else np.ascontiguousarray(W, dtype="<f4")
    if W.ndim != 2 or W.shape[1] != d:
        raise UserError(f"neck W must be k × {d} for {d}-d features, got shape {W.shape}")
    nlist = nlist or default_nlist(n)
    train_size = min(n, train_size or 64 * nlist)
    if n == 0 or nlist < 1 or train_size < nlist:
        raise UserError(f"an IVF index with {nlist} lists needs at least {nlist} training rows; "
                        f"have {min(n, train_size)} of {n}")
    if shard_rows < 1 or batch_rows < 1:
        raise UserError("shard_rows and batch_rows must be ≥ 1")
    factory = f"IVF{nlist},{codec}"
    try:
        index = faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT)
        ivf = faiss.extract_index_ivf(index)
    except RuntimeError as e:
        raise UserError(f"cannot make an on-disk IVF index {factory!r}: {e}") from None
    lists = None if ivf.invlists is None else faiss.downcast_InvertedLists(ivf.invlists)  # None: refused below
    if isinstance(index, faiss.IndexIVFPQR) or not isinstance(lists, faiss.ArrayInvertedLists):
        raise UserError(f"codec {codec!r} gives {type(index).__name__}; on-disk lists need a plain IVF codec")
    sample = np.sort(np.random.default_rng(seed).choice(n, train_size, replace=False))
    log.info("training %s on %d of %d rows", factory, train_size, n)
    train = rows.take(sample)
    if normalize and not np.allclose(np.linalg.norm(train, axis=1), 1, atol=1e-3):
        raise UserError(f"features file {rows.path} does not hold L2-normalised rows; build without "
                        f"normalisation or normalise the file first")
    index.train(train)
    del train
    out = Path(out)
    features_abs = rows.path.resolve()
    with atomic_dir(out) as tmp:
        shards = _write_lists(index, rows, tmp, shard_rows, batch_rows)
        del index, ivf, lists
        np.save(tmp / NECK_FILE, W)
        manifest = {
            "format": FORMAT, "version": VERSION,
            "created_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "count": int(n), "dim": int(d), "embed_dim": int(W.shape[0]), "nlist": int(nlist), "codec": codec,
            "factory": factory,
            "normalize": bool(normalize), "shards": shards, "train_size": int(train_size),
            "features": {"path": os.path.relpath(features_abs, out.resolve()), "shape": [int(n), int(d)],
                         "fingerprint": _fingerprint(rows)},
            "files": {f: {"bytes": (tmp / f).stat().st_size} for f in (INDEX_FILE, DATA_FILE, NECK_FILE)},
        }
        if source_index is not None:
            manifest["source_index"] = os.path.relpath(Path(source_index).resolve(), out.resolve())
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return out


# the cosine lists an on-disk IVF gets by default: those of the app's two default searches
DEFAULT_COSINE_FOR: tuple[tuple[str, dict], ...] = (("trained", {}), ("identity", {}))


def build_for_index(index_dir, out=None, cosine_for: tuple[tuple[str, dict], ...] = DEFAULT_COSINE_FOR,
                    **kw) -> Path:
    """An on-disk IVF over an index directory's features.npy (default DIR: INDEX/ivf_ondisk,
    dropped with the directory whenever `add`/`remove` rewrite it), with the cosine lists of
    `cosine_for` ((strategy, parameters) pairs; default trained and identity, the app's two default
    searches; (): none)."""
    index_dir = Path(index_dir)
    try:
        man = json.loads((index_dir / "manifest.json").read_text())
        normalize = bool(man["normalize"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{index_dir} is not a readable index directory: {e}") from None
    out = build_ondisk_ivf(index_dir / "features.npy", out or index_dir / "ivf_ondisk", normalize=normalize,
                           W=load_npy(index_dir / "W.npy", "neck W"), source_index=index_dir, **kw)
    for strategy, params in cosine_for:
        build_cosine_lists(out, strategy, params, shard_rows=kw.get("shard_rows", 1_000_000), seed=kw.get("seed", 0))
    return out


# ---------------------------------------------------------------- cosine lists
def _unit_rows(L: np.ndarray):
    """x ↦ Lx/‖Lx‖ in float32.  A row with Lx = 0 has no cosine and stays 0, as does one whose
    ‖Lx‖ is within float32 rounding of 0 (≤ 10⁻⁵ ‖L‖₂ ‖x‖): its direction would be noise."""
    Lt = np.ascontiguousarray(L.T, dtype=np.float32)
    floor = 1e-5 * float(np.linalg.norm(L, 2)) if L.size else 0.0

    def f(x: np.ndarray) -> np.ndarray:
        z = x @ Lt
        nz = np.linalg.norm(z, axis=1, keepdims=True)
        keep = nz > floor * np.linalg.norm(x, axis=1, keepdims=True)
        return np.ascontiguousarray(np.where(keep, z / np.maximum(nz, 1e-30), 0), dtype=np.float32)
    return f


def cosine_slug(strategy: str, params: dict) -> str:
    """The folder name of a strategy's cosine lists: its name, and a hash of its parameters."""
    if not params:
        return strategy
    return f"{strategy}-{hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]}"


def cosine_command(path, strategy: str, params: dict) -> str:
    """The command that builds a strategy's cosine lists for the on-disk IVF at `path`."""
    flags = {sp.name: sp.flag for sp in shared_params()}
    given = "".join(f" {flags.get(k, '--' + k)} {v}" for k, v in params.items())
    return f"python -m index ivf-build --ivf {path} --cosine-for {strategy}{given}"


def build_cosine_lists(path, strategy: str = "trained", params: dict | None = None, *, M: np.ndarray | None = None,
                       shard_rows: int = 1_000_000, batch_rows: int = 65536, seed: int = 0) -> Path:
    """Cosine lists of one strategy beside the on-disk IVF at `path` (PATH/cosine/SLUG): an IVF,
    with the base lists' nlist and codec, over z = Lx/‖Lx‖ (M′ = LᵀL, L = `metric.psd_factor(M′)`ᵀ,
    r = rank M′: ‖x‖_M′ = ‖Lx‖), so cosine under M′ is the inner product of unit r-vectors and the
    lists propose candidates by the score itself.
    `M`: M′ itself (default: the strategy's, from the IVF's neck W), any PSD matrix, recorded
    under the strategy's name.  Written atomically; rebuilding replaces them."""
    ivf = OnDiskIVF(path)
    params = dataclasses.asdict(strategy_params(strategy, params))  # every parameter, defaults filled
    # cosine's QueryMetric refuses an indefinite M′ in one line
    M = (ivf.strategy_metric(strategy, params, "cosine") if M is None else ivf.metric(M, "cosine")).M
    F = psd_factor(M)
    if F is None:  # the cosine QueryMetric above refuses a clearly indefinite M′ first
        raise UserError(f"cosine mode needs a positive semi-definite M′; that of {strategy} is indefinite")
    L = np.ascontiguousarray(F.T)
    if L.shape[0] == 0:
        raise UserError(f"M′ of {strategy} is zero: cosine is undefined")
    man = ivf.manifest
    rows = _RowFile(ivf.path / man["features"]["path"])
    n, nlist = len(ivf), int(man["nlist"])
    unit = _unit_rows(L)
    try:
        index = faiss.index_factory(L.shape[0], f"IVF{nlist},{man['codec']}", faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as e:
        raise UserError(f"cannot make cosine lists IVF{nlist},{man['codec']} in rank M′ = {L.shape[0]} "
                        f"dimensions: {e}") from None
    sample = np.sort(np.random.default_rng(seed).choice(n, min(n, int(man["train_size"])), replace=False))
    t0 = time.perf_counter()
    index.train(unit(rows.take(sample)))
    out = ivf.path / COSINE_DIR / cosine_slug(strategy, params)
    with atomic_dir(out) as tmp:
        _write_lists(index, rows, tmp, shard_rows, batch_rows, transform=unit)
        del index
        np.save(tmp / FACTOR_FILE, L)
        (tmp / COSINE_MANIFEST).write_text(json.dumps({
            "format": FORMAT + "-cosine", "version": VERSION, "strategy": strategy, "params": params,
            "rank": int(L.shape[0]), "nlist": nlist, "codec": man["codec"],
            "features_fingerprint": man["features"]["fingerprint"],
            "build_s": round(time.perf_counter() - t0, 1),
            "files": {f: {"bytes": (tmp / f).stat().st_size} for f in (INDEX_FILE, DATA_FILE, FACTOR_FILE)},
        }, indent=2))
    return out


class _CosineLists:
    """One strategy's cosine lists, opened: the IVF over Lx/‖Lx‖ and the factor L."""

    def __init__(self, path: Path, base: dict):
        self.path = path
        try:
            man = json.loads((path / COSINE_MANIFEST).read_text())
        except (OSError, ValueError) as e:
            man = {"error": str(e)}
        if not isinstance(man, dict) or not isinstance(man.get("files"), dict):
            raise UserError(f"cosine lists {path} have no readable {COSINE_MANIFEST}: rebuild them with "
                            f"ivf-build --ivf {path.parent.parent} --cosine-for STRATEGY")
        self.manifest = man
        # the lists depend on the features and M′ alone (and share the base lists' nlist, so nprobe)
        if man.get("features_fingerprint") != base["features"]["fingerprint"] or man.get("nlist") != base["nlist"]:
            cmd = cosine_command(path.parent.parent, man.get("strategy", "STRATEGY"), man.get("params", {}))
            raise UserError(f"cosine lists {path} were built for another on-disk IVF: rebuild them with `{cmd}`")
        for f, want in man["files"].items():
            if not (path / f).is_file() or (path / f).stat().st_size != want["bytes"]:
                raise UserError(f"cosine list file {path / f} is missing or not {want['bytes']} bytes")
        self.L = load_npy(path / FACTOR_FILE, "cosine factor L")
        L64 = self.L.astype(np.float64)  # float32 (or float64, as earlier builds wrote it)
        self.M = L64.T @ L64
        self.unit = _unit_rows(self.L)
        with _c_stdout_to_stderr():
            index = faiss.read_index(str(path / INDEX_FILE), faiss.IO_FLAG_ONDISK_SAME_DIR | faiss.IO_FLAG_READ_ONLY)
        self.index = index
        self.search = getattr(index, "search_numpy", index.search)

    def matches(self, M: np.ndarray) -> bool:
        return self.M.shape == M.shape and bool(
            np.linalg.norm(self.M - M) <= 1e-6 * max(float(np.linalg.norm(M)), 1e-300))


# ---------------------------------------------------------------- search
class OnDiskIVF(NeckGallery):
    """An on-disk IVF index plus its memory-mapped features; search(…) re-ranks exactly under M′.
    `nprobe` and `rerank_factor` are the defaults of every search (each search may override them)."""

    def __init__(self, path, features=None, nprobe: int | None = None, rerank_factor: int = 10):
        self.path = Path(path)
        self.rerank_factor = rerank_factor
        # the re-rankers' Searcher (`_in_memory`) is made once, whoever asks first
        self._space_lock = threading.Lock()
        self._searcher: Searcher | None = None
        man = read_manifest(self.path / MANIFEST, FORMAT, VERSION, f"{self.path} (an on-disk IVF index?)")
        for f, want in man["files"].items():
            p = self.path / f
            if not p.is_file() or p.stat().st_size != want["bytes"]:
                raise UserError(f"on-disk index file {p} is missing or not {want['bytes']} bytes "
                                f"(truncated or replaced)")
        fpath = Path(features) if features else self.path / man["features"]["path"]
        rows = _RowFile(fpath)
        if list(rows.shape) != man["features"]["shape"] or _fingerprint(rows) != man["features"]["fingerprint"]:
            raise UserError(f"features file {fpath} ({rows.shape[0]} × {rows.shape[1]}) is not the one "
                            f"this on-disk index was built from")
        self.manifest = man
        self.features = _map_rows(rows)   # re-rank reads candidates' rows only
        with _c_stdout_to_stderr():
            self.index = faiss.read_index(str(self.path / INDEX_FILE),
                                          faiss.IO_FLAG_ONDISK_SAME_DIR | faiss.IO_FLAG_READ_ONLY)
        # faiss.contrib.torch_utils (imported by pytorch-metric-learning) replaces Index.search with a
        # torch-aware one that drops `params`; it keeps FAISS's own as search_numpy
        self._search = getattr(self.index, "search_numpy", self.index.search)
        if self.index.ntotal != man["count"]:
            raise UserError(f"{INDEX_FILE} holds {self.index.ntotal} rows, the manifest says {man['count']}")
        self.nprobe = nprobe or min(DEFAULT_NPROBE, man["nlist"])
        self.W = load_npy(self.path / NECK_FILE, "neck W")
        if self.W.shape != (man["embed_dim"], man["dim"]):
            raise UserError(f"{NECK_FILE} is {self.W.shape}, the manifest says ({man['embed_dim']}, {man['dim']})")
        self.neck = neck_digest(self.W)   # the key of every M′ this gallery reads (gallery.refined_metric)

    def _source(self, name: str) -> dict:
        """A JSON file of the index directory this was built from ({} when built from bare features)."""
        src = self.manifest.get("source_index")
        if src is None:
            return {}
        p = self.path / src / name
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"cannot read the source index's {p}: {e}") from None

    @property
    def info(self) -> dict:
        """The source index's manifest (model facts for embedding query images), or {}."""
        return self._source("manifest.json")

    def _metadata_key(self) -> str | None:
        """What the source index's metadata.json is, as a digest (its path, size and modification
        time: a rewritten file has another); None when there is none (bare features) or it cannot
        be read (`_source` then refuses it)."""
        src = self.manifest.get("source_index")
        if src is None:
            return None
        p = (self.path / src / "metadata.json").resolve()
        try:
            st = p.stat()
        except OSError:
            return None
        return key_hash(str(p), st.st_size, st.st_mtime_ns)

    @property
    def source_metadata(self) -> dict:
        """The source index's metadata.json ({} when built from bare features), read once per
        version of the file (kept in the memory cache)."""
        key = self._metadata_key()
        if key is None:
            return self._source("metadata.json")
        return CACHE.get_or_build(("ondisk-source-metadata", key), lambda: self._source("metadata.json"))

    @property
    def metadata(self) -> tuple[Items | None, dict[int, str]]:
        """The source index's items (id, label, path, split per row) and class names; (None, {})
        when built from bare features.  Parsed once per version of metadata.json (kept in the
        memory cache), at the first search or by a caller that needs them first (the app)."""
        def build():
            meta = self.source_metadata
            items = Items.from_json(meta) if meta else None
            if items is not None and len(items) != len(self):
                raise UserError(f"the source index now has {len(items)} items, this on-disk index {len(self)}: "
                                f"rebuild it")
            names = {int(k): v for k, v in meta.get("class_names", {}).items()}
            return items, names, [] if items is None else [items.ids, items.labels]  # the arrays: its weight
        key = self._metadata_key()
        got = build() if key is None else CACHE.get_or_build(("ondisk-items", key, len(self)), build)
        return got[0], got[1]

    @property
    def nprobe(self) -> int:
        return self._nprobe

    @nprobe.setter
    def nprobe(self, value: int) -> None:
        nprobe = self._checked_nprobe(value)
        with self._space_lock:
            self._nprobe = nprobe
            # the re-rankers' Searcher reads the index's own nprobe (its searches pass no parameters)
            faiss.extract_index_ivf(self.index).nprobe = nprobe
            self._searcher = None   # its caches are keyed by the candidate settings

    def _checked_nprobe(self, value) -> int:
        if not 1 <= int(value) <= self.manifest["nlist"]:
            raise UserError(f"nprobe must be in [1, {self.manifest['nlist']}] (the number of lists), got {value}")
        return int(value)

    @property
    def dim(self) -> int:
        return int(self.manifest["dim"])

    @property
    def normalize(self) -> bool:
        return bool(self.manifest["normalize"])

    def __len__(self) -> int:
        return int(self.manifest["count"])

    def _in_memory(self) -> Searcher:
        """This gallery as a `Searcher`, for re-rankers: the memory-mapped features, candidates from
        the IVF lists (`nprobe` of them), re-ranked exactly, as `search_metric` does.  Kept on this
        object (`metric_space`): a view over its own handles (the memory map, the index), whose
        computed state (M′, cosine norms) lives in the memory cache and goes with it."""
        items, names = self.metadata
        if items is None:
            raise UserError(f"the on-disk IVF at {self.path} was built from bare features: re-ranked results "
                            "need its items; build it from an index directory (ivf-build --index)")
        man = self.manifest
        # what re-rankers' offline caches are keyed by (space.store.fingerprint): the features'
        # checksum, the neck, and the candidate settings their neighbour lists were searched with
        content = {"features": man["features"]["fingerprint"], "files": man["files"],
                   "W": hashlib.sha256(np.ascontiguousarray(self.W).tobytes()).hexdigest(),
                   "nprobe": self._nprobe, "rerank_factor": self.rerank_factor}
        data = IndexData(self.path, {"normalize": self.normalize, "factory": man["factory"], "count": len(self),
                                     "files": content}, self.features, items, self.W, self.index, names)
        return Searcher(data, rerank_factor=self.rerank_factor)

    def cosine_lists(self, M: np.ndarray, strategy: tuple[str, dict | None] | None = None) -> _CosineLists:
        """The cosine lists built for M′ (matched by LᵀL = M′); refused in one line, naming the
        command that builds them, when there are none (`strategy`: what the search was asked for).
        The folders are listed per request (lists built since are found); each is opened once per
        version of its manifest, in the memory cache, however many requests ask at once."""
        for man in sorted((self.path / COSINE_DIR).glob(f"*/{COSINE_MANIFEST}")):
            lists = self._open_cosine(man)
            if lists.matches(M):
                return lists
        if strategy is None:
            how = f"`{cosine_command(self.path, 'STRATEGY', {})}` with the strategy of this M′"
        else:
            how = f"`{cosine_command(self.path, strategy[0], dict(strategy[1] or {}))}`"
        raise UserError(f"cosine mode on the on-disk IVF {self.path} needs cosine lists for this M′; "
                        f"build them with {how}, or search with --mode bilinear")

    def _open_cosine(self, man: Path) -> _CosineLists:
        """The cosine lists of folder man.parent, opened once per (folder, version of its manifest,
        this IVF's features and nlist, which they are checked against)."""
        try:
            st = man.stat()
        except OSError:  # removed since it was listed: refused, naming the rebuild
            return _CosineLists(man.parent, self.manifest)
        key = key_hash(str(man.parent.resolve()), st.st_size, st.st_mtime_ns, st.st_ino,
                       self.manifest["features"]["fingerprint"], self.manifest["nlist"])

        def build():
            lists = _CosineLists(man.parent, self.manifest)
            # L and M′ weigh in the budget; the lists themselves are read from disk, not held
            return lists, [lists.L, lists.M]
        return CACHE.get_or_build(("ondisk-cosine-lists", key), build)[0]

    def search(self, queries: np.ndarray, strategy: str = "trained", params: dict | None = None,
               mode: str = "bilinear", k: int = 10, what: str = "query features") -> Hits:
        if k < 1:
            raise UserError(f"k must be ≥ 1, got {k}")
        return self.search_metric(queries, self.strategy_metric(strategy, params, mode), min(k, len(self)),
                                  what=what, strategy=(strategy, params))

    def search_metric(self, feats: np.ndarray, metric: QueryMetric, k: int = 10, nprobe: int | None = None,
                      rerank_factor: int | None = None, what: str = "query features",
                      strategy: tuple[str, dict | None] | None = None) -> Hits:
        """Top-k rows under `metric` with exact scores.  Bilinear: candidates from the `nprobe`
        lists whose centroids score highest against M′q.  Cosine: from the cosine lists built for
        M′ (`strategy`, when given, names it in the refusal where there are none), by the cosine
        itself; the pool is k × rerank_factor in both modes."""
        if k < 1:
            raise UserError(f"k must be ≥ 1, got {k}")
        # per-call parameters, not index.nprobe: concurrent searches may probe differently
        params = faiss.SearchParametersIVF()
        params.nprobe = self._nprobe if nprobe is None else self._checked_nprobe(nprobe)
        Q = self.prepare_queries(feats, what)
        qt = metric.transform(Q)
        rf = self.rerank_factor if rerank_factor is None else rerank_factor
        if metric.mode == "cosine":
            lists = self.cosine_lists(metric.M, strategy)
            search, qc = lists.search, lists.unit(Q)
            kc = min(len(self), max(k * rf, 64))
        else:
            search, qc = self._search, qt
            kc = metric.candidate_count(k, len(self), rf)
        R = np.full((len(qt), k), -1, dtype=np.int64)
        S = np.full((len(qt), k), -np.inf, dtype=np.float32)
        for b in range(0, len(qt), _QUERY_BLOCK):
            _, cand = search(qc[b: b + _QUERY_BLOCK], kc, params=params)
            # the block's candidate rows read once, sorted: the memmap is read front to back
            R[b: b + _QUERY_BLOCK], S[b: b + _QUERY_BLOCK] = rescore(
                qt[b: b + _QUERY_BLOCK], cand, lambda rows: self.features[rows], k,
                None if metric.mode == "bilinear" else lambda _, X: apply_norms(metric.apply, X))
        items, names = self.metadata
        return Hits(R, S, items, class_names=names)
