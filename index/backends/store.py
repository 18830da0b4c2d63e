"""The index directory: one exact (or approximate) FAISS inner-product index over trunk features.

    DIR/
      manifest.json   format version, checkpoint checksum, backbone, dims, normalisation,
                      counts, created-at, index type, and a checksum of every file below
      index.faiss     FAISS index over φ(x) (inner product; rows = positions)
      features.npy    trunk features φ(x), float32 N × d, memory-mappable
      metadata.json   per item: id, label, path (relative to root), split; class names
      W.npy           the neck W (k × d), so M* = WᵀW

A directory is always written whole into a temporary sibling and renamed into
place: an interrupted build, add or remove leaves the previous index intact.
"""
from __future__ import annotations

import ctypes
import datetime as _dt
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from core.arrays import check_finite, check_labels, check_matrix, l2_normalize
from core.atomic import atomic_dir
from core.errors import UserError
from core.hashing import sha256_file
from core.manifest import read_manifest

FORMAT = "dml-retrieval-index"
VERSION = 1
FILES = ("index.faiss", "features.npy", "metadata.json", "W.npy")
FLAT_MAX = 100_000  # exact Flat up to here; HNSW above unless a factory string is given
# The manifest schema of format VERSION, checked on every read: field → type
MANIFEST_FIELDS = {"format": str, "version": int, "count": int, "trunk_dim": int, "embed_dim": int,
                   "normalize": bool, "factory": str, "files": dict}
FILE_FIELDS = {"bytes": int, "sha256": str}
METADATA_COLUMNS = {"ids": int, "labels": int, "paths": str, "splits": str}


@dataclass
class Items:
    ids: np.ndarray                 # int64
    labels: np.ndarray              # int64
    paths: list[str]
    splits: list[str]

    def __len__(self):
        return len(self.ids)

    def to_json(self) -> dict:
        return {"ids": self.ids.tolist(), "labels": self.labels.tolist(), "paths": self.paths,
                "splits": self.splits}

    @classmethod
    def from_json(cls, d, where: str = "index metadata") -> Items:
        """Items from metadata.json's columns, each checked: ids unique integers, labels integers."""
        if not isinstance(d, dict):
            raise UserError(f"{where} must be a JSON object, got {type(d).__name__}")
        for col, t in METADATA_COLUMNS.items():
            v = d.get(col)
            if not isinstance(v, list):
                raise UserError(f"{where}: {col!r} must be a list, got {type(v).__name__}")
            bad = next((x for x in v if not isinstance(x, t) or isinstance(x, bool)), None)
            if bad is not None:
                raise UserError(f"{where}: {col!r} must hold {t.__name__}s, found {bad!r}")
        n = len(d["ids"])
        if not (len(d["labels"]) == len(d["paths"]) == len(d["splits"]) == n):
            raise UserError(f"{where}: columns differ in length")
        ids = check_labels(np.asarray(d["ids"]), f"{where} ids")
        if len(np.unique(ids)) != n:
            raise UserError(f"{where}: ids are not unique (e.g. {int(_first_duplicate(ids))})")
        return cls(ids, check_labels(np.asarray(d["labels"]), f"{where} labels"), d["paths"], d["splits"])

    def subset(self, keep: np.ndarray) -> Items:
        return Items(self.ids[keep], self.labels[keep], [self.paths[i] for i in np.nonzero(keep)[0]],
                     [self.splits[i] for i in np.nonzero(keep)[0]])

    def concat(self, other: Items) -> Items:
        return Items(np.concatenate([self.ids, other.ids]), np.concatenate([self.labels, other.labels]),
                     self.paths + other.paths, self.splits + other.splits)


def class_sizes_in(classes: np.ndarray, counts: np.ndarray, labels) -> np.ndarray:
    """Each of `labels`' item count from (sorted labels `classes`, their `counts`); 0 for a label
    none has."""
    labels = np.asarray(labels, dtype=np.int64)
    at = np.searchsorted(classes, labels)
    out = np.zeros(labels.shape, dtype=np.int64)
    known = at < len(classes)
    out[known] = np.where(classes[at[known]] == labels[known], counts[at[known]], 0)
    return out


def _first_duplicate(a: np.ndarray):
    vals, counts = np.unique(a, return_counts=True)
    return vals[counts > 1][0]


@dataclass
class IndexData:
    """Everything in an index directory, loaded and validated."""
    path: Path | None
    manifest: dict
    features: np.ndarray            # N × d float32 (memory-mapped when loaded)
    items: Items
    W: np.ndarray                   # k × d
    faiss_index: faiss.Index
    class_names: dict = field(default_factory=dict)
    root: str = ""

    @property
    def dim(self) -> int:
        return int(self.features.shape[1])

    @property
    def M_star(self) -> np.ndarray:
        W = self.W.astype(np.float64)
        return W.T @ W


def in_memory_index(features: np.ndarray, labels: np.ndarray, W: np.ndarray, normalize: bool = True) -> IndexData:
    """An exact IndexData without a directory (for evaluating strategies on a split)."""
    x = np.ascontiguousarray(features, dtype=np.float32)
    if normalize:
        x = l2_normalize(x)
    n = len(x)
    items = Items(np.arange(n, dtype=np.int64), np.asarray(labels, dtype=np.int64), [""] * n, ["eval"] * n)
    man = {"normalize": normalize, "factory": "Flat", "count": n, "trunk_dim": x.shape[1],
           "embed_dim": W.shape[0]}
    index = make_faiss_index(x, "Flat")
    return IndexData(None, man, flat_storage(index), items, np.asarray(W, dtype=np.float32), index)


def flat_storage(index: faiss.Index) -> np.ndarray:
    """The vectors of a Flat index as a read-only (n, d) float32 array, without a copy: a gallery
    held once in RAM, not once beside FAISS and once in it (5 GB each at 10⁶ × 1,280).  The
    array's buffer keeps the index alive, and so does every view of it."""
    n, d = index.ntotal, index.d
    if not n:
        return np.zeros((0, d), np.float32)
    flat: Any = faiss.downcast_index(index)
    buf: Any = (ctypes.c_float * (n * d)).from_address(int(flat.get_xb()))
    buf.index = index
    out = np.frombuffer(buf, dtype=np.float32).reshape(n, d)
    out.flags.writeable = False
    return out


def choose_factory(n: int, factory: str | None) -> str:
    if factory:
        return factory
    return "Flat" if n <= FLAT_MAX else "HNSW32"


def make_faiss_index(features: np.ndarray, factory: str) -> faiss.Index:
    d = features.shape[1]
    try:
        index = faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as e:
        raise UserError(f"bad FAISS factory string {factory!r}: {e}") from None
    x = np.ascontiguousarray(features, dtype=np.float32)
    if not index.is_trained:
        if len(x) < 40:
            raise UserError(f"index type {factory} needs training data; {len(x)} vectors are too few")
        index.train(x)
    index.add(x)
    return index


def write_index(path, features: np.ndarray, items: Items, W: np.ndarray, *, normalize: bool, info: dict,
                factory: str | None = None, class_names: dict | None = None, root: str = "") -> Path:
    """Write a complete index directory atomically.

    With `normalize`, φ(x) is L2-normalised before it is stored and indexed (queries
    get the same treatment).  `info` holds the model facts for the manifest.
    """
    features = np.ascontiguousarray(features, dtype=np.float32)
    if normalize and len(features):
        features = l2_normalize(features)
    if features.ndim != 2 or len(features) != len(items):
        raise UserError(f"features ({features.shape}) and metadata ({len(items)} items) do not match")
    if W.ndim != 2 or W.shape[1] != features.shape[1]:
        raise UserError(f"neck W {W.shape} does not fit {features.shape[1]}-d features")
    if len(np.unique(items.ids)) != len(items.ids):
        raise UserError("index ids must be unique")
    fac = choose_factory(len(features), factory)
    index = make_faiss_index(features, fac)
    path = Path(path)
    with atomic_dir(path) as tmp:
        faiss.write_index(index, str(tmp / "index.faiss"))
        np.save(tmp / "features.npy", features)
        np.save(tmp / "W.npy", np.ascontiguousarray(W, dtype=np.float32))
        meta = items.to_json() | {"class_names": {str(k): v for k, v in (class_names or {}).items()},
                                  "root": str(root)}
        (tmp / "metadata.json").write_text(json.dumps(meta, ensure_ascii=False))
        manifest = {
            "format": FORMAT, "version": VERSION,
            "created_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "index_type": "exact" if fac == "Flat" else "approximate", "factory": fac,
            "count": int(len(items)), "trunk_dim": int(features.shape[1]), "embed_dim": int(W.shape[0]),
            "classes": int(len(np.unique(items.labels))), "normalize": bool(normalize),
            **info,
            "files": {f: {"sha256": sha256_file(tmp / f), "bytes": (tmp / f).stat().st_size} for f in FILES},
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False))
    return path


def _check_fields(d, fields: dict, what: str) -> None:
    """`d` is a dict holding every field of `fields` with its type (an int is not a bool)."""
    if not isinstance(d, dict):
        raise UserError(f"{what} must be a JSON object, got {type(d).__name__}")
    for key, t in fields.items():
        if key not in d:
            raise UserError(f"{what} has no field {key!r}")
        v = d[key]
        if not isinstance(v, t) or (t is int and isinstance(v, bool)):
            raise UserError(f"{what} field {key!r} must be {t.__name__}, got {type(v).__name__}")


def is_index(path) -> bool:
    """Whether `path` is an index directory of this project (its manifest names our format)."""
    try:
        man = json.loads((Path(path) / "manifest.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(man, dict) and man.get("format") == FORMAT


def read_index(path, verify: bool = True) -> IndexData:
    """Load and validate an index directory against the manifest schema of format VERSION;
    any inconsistency is refused with its reason.  With `verify`, every file's checksum is
    checked and every feature row is read once for NaN/inf."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"index directory not found: {path}")
    mpath = path / "manifest.json"
    if not mpath.is_file():
        raise UserError(f"{path} is not an index: manifest.json is missing")
    man = read_manifest(mpath, FORMAT, VERSION)
    _check_fields(man, MANIFEST_FIELDS, f"index {path}: manifest")
    for f in FILES:
        p = path / f
        want = man["files"].get(f)
        if not p.is_file() or want is None:
            raise UserError(f"index {path} lacks {f}")
        _check_fields(want, FILE_FIELDS, f"index {path}: manifest entry files[{f!r}]")
        size = p.stat().st_size
        if size != want["bytes"]:
            raise UserError(f"index file {p} is {size} bytes, the manifest says {want['bytes']} "
                            f"(truncated or replaced)")
        if verify and sha256_file(p) != want["sha256"]:
            raise UserError(f"index file {p} does not match its checksum in the manifest (corrupted)")
    try:
        features = np.load(path / "features.npy", mmap_mode="r", allow_pickle=False)
        W = np.load(path / "W.npy", allow_pickle=False)
        meta = json.loads((path / "metadata.json").read_text())
        index = faiss.read_index(str(path / "index.faiss"))
    except Exception as e:
        raise UserError(f"cannot read index {path}: {e}") from None
    items = Items.from_json(meta, f"index {path}: metadata.json")
    n, d = man["count"], man["trunk_dim"]
    if features.shape != (n, d):
        raise UserError(f"features.npy is {features.shape}, the manifest says ({n}, {d})")
    if W.shape != (man["embed_dim"], d):
        raise UserError(f"W.npy is {W.shape}, the manifest says ({man['embed_dim']}, {d})")
    if index.d != d or index.ntotal != n:
        raise UserError(f"index.faiss holds {index.ntotal} × {index.d}, the manifest says {n} × {d}")
    if len(items) != n:
        raise UserError(f"metadata has {len(items)} items, the manifest says {n}")
    check_matrix(W, f"index {path}: W.npy")
    if features.dtype != np.float32:
        raise UserError(f"index {path}: features.npy is {features.dtype}, float32 expected")
    if verify:  # the full read of the features goes with the checksum pass (--no-verify skips both)
        check_finite(features, f"index {path}: features.npy")
    try:
        names = {int(k): v for k, v in meta.get("class_names", {}).items()}
    except (AttributeError, TypeError, ValueError):
        raise UserError(f"index {path}: metadata.json 'class_names' must map integer labels to names") from None
    return IndexData(path, man, features, items, W, index, names, meta.get("root", ""))
