"""A gallery in Milvus: φ(x) and its metadata in a collection searched by inner product with
the query M′φ(q), since φ(q)ᵀM′φ(x) = (M′φ(q))ᵀφ(x); the metric type is always IP, never
COSINE (cosine mode re-ranks IP candidates exactly).  A path URI is Milvus Lite, http(s)://
a server.  `MilvusGallery` is a `gallery.Gallery`; re-rankers run in the `MetricSpace` of a
`Searcher` whose candidates come from the collection and whose vectors are memory-mapped: the
source index directory's features.npy where it still holds the collection's vectors, else a
copy read from the collection once into the re-ranking cache folder.  What is computed from the
collection (M′, its items) is kept in the process's memory cache, keyed by the collection's
content.  The collection layout and the reasons: docs/scale-out.md ("Milvus").
pymilvus and milvus-lite are an optional extra (requirements-milvus.txt), imported only here.
"""
from __future__ import annotations

import base64
import hashlib
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from tqdm import tqdm

from core.arrays import load_npy
from core.atomic import write_with
from core.errors import UserError

from ..metric import QueryMetric
from ..space import CACHE, Hits, cache_root, key_hash, read_rows
from . import milvus_found
from .gallery import NeckGallery, exact_top, neck_digest
from .milvus_found import Found
from .ondisk import default_nlist
from .search import Searcher
from .store import IndexData, Items, class_sizes_in

METRIC = "IP"            # never "COSINE": see the module docstring
EXACT_INDEX = "FLAT"     # exact: bilinear scores come straight from Milvus
# index types whose scores are the stored float vectors' inner products (no quantisation): their
# bilinear hits need no re-scoring, only a search as wide as the candidates (HNSW's ef)
EXACT_SCORES = ("FLAT", "HNSW", "IVF_FLAT")
# the build parameters an index type gets unless given (a server asks for them): HNSW as the
# scale-out measurements ran it; IVF_FLAT's lists as the on-disk IVF's (a power of two near √N)
HNSW_BUILD = {"M": 16, "efConstruction": 100}
MAX_TOPK = 16384         # Milvus's limit on one search's top-k
PATH_MAX, SPLIT_MAX = 4096, 256
OUTPUT = ["row", "label", "path", "split"]
FETCH = 16384            # rows per query by row (Milvus's largest result window)
ITEM_FIELDS = ["id", "row", "label", "path", "split"]
# per-class counts are stored with the collection up to this many classes: its properties live in
# Milvus's metadata store, whose requests are bounded (etcd: 1.5 MiB by default); above, a class's
# size is counted in the collection when first asked
CLASS_COUNTS_MAX = 50_000
SCAN_ROWS = 65536        # rows of a FLAT collection's vectors scored at once for re-rankers' candidates
SAMPLE_ROWS = 64         # rows of a source feature store compared with the collection before it is used
INSTALL = "pip install -r requirements-milvus.txt"
# index-manifest keys that travel with the gallery: query images are embedded by the same model
MODEL_FACTS = ("checkpoint", "checkpoint_sha256", "backbone", "transform", "trunk_dim", "dataset", "split")


def export_build_params(index_type: str, n: int, given: dict | None = None) -> dict:
    """`given` over the index type's defaults (HNSW_BUILD; IVF_FLAT: nlist `default_nlist(n)`)."""
    base = {"HNSW": dict(HNSW_BUILD), "IVF_FLAT": {"nlist": default_nlist(n)}}.get(index_type, {})
    return base | dict(given or {})


def _pymilvus():
    try:
        import pymilvus
    except ImportError:
        raise UserError(f"the Milvus backend needs the optional pymilvus package: {INSTALL}") from None
    return pymilvus


def is_server_uri(uri: str) -> bool:
    """Whether `uri` names a Milvus server (or cluster), not a Milvus Lite file."""
    return str(uri).startswith(("http://", "https://", "tcp://", "unix:"))


def connect(uri: str, token: str = ""):
    """A MilvusClient: PATH.db opens Milvus Lite in this process, http(s)://host:port a server."""
    pm = _pymilvus()
    uri = str(uri)
    if not is_server_uri(uri):
        p = Path(uri)
        if p.suffix != ".db":
            raise UserError(f"Milvus URI {uri!r}: give http(s)://host:port for a server, or a file path "
                            f"ending in .db for Milvus Lite")
        if not p.parent.is_dir():
            raise UserError(f"Milvus Lite: folder {p.parent} does not exist")
        try:
            import milvus_lite  # noqa: F401  (only whether it is installed)
        except ImportError:
            raise UserError(f"a .db URI needs Milvus Lite (the milvus-lite package): {INSTALL}") from None
        uri = str(p.resolve())
    try:
        return pm.MilvusClient(uri=uri, token=token)
    except pm.exceptions.MilvusException as e:
        raise UserError(f"cannot connect to Milvus at {uri}: {e.message}") from None


def _schema(pm, dim: int):
    s = pm.MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
    s.add_field("id", pm.DataType.INT64, is_primary=True)
    s.add_field("row", pm.DataType.INT64)
    s.add_field("vector", pm.DataType.FLOAT_VECTOR, dim=dim)
    s.add_field("label", pm.DataType.INT64)
    s.add_field("path", pm.DataType.VARCHAR, max_length=PATH_MAX)
    s.add_field("split", pm.DataType.VARCHAR, max_length=SPLIT_MAX)
    return s


def export_features(uri: str, collection: str, features: np.ndarray, items, W: np.ndarray, *, normalize: bool,
                    info: dict | None = None, class_names: dict | None = None, overwrite: bool = False,
                    token: str = "",
                    index_type: str = EXACT_INDEX, index_params: dict | None = None, batch: int = 5000,
                    progress: bool = False) -> int:
    """Store the rows of `features` (φ(x) as the index stores them) with `items`' metadata
    (ids, labels, paths, splits) in a new collection; returns the number of rows stored.
    `info` (model facts, the source index) and the checksum of the rows stored
    (`content_sha256`, what re-rankers' caches are keyed by) go into the `dml.info` property.

    `index_type` other than FLAT (e.g. HNSW on a server) makes search widen its candidates, and
    re-rank them exactly where Milvus's scores are not (cosine mode, quantised indexes).  An
    existing collection is refused unless `overwrite`.  It returns once the server has indexed
    every row (`wait_indexed`): until then a search scans the rows not yet indexed."""
    pm = _pymilvus()
    n, d = features.shape
    if len(items) != n or W.ndim != 2 or W.shape[1] != d:
        raise UserError(f"features {features.shape}, {len(items)} items and neck W {W.shape} do not fit together")
    too_long = [p for p in items.paths if len(p.encode()) > PATH_MAX]
    if too_long:
        raise UserError(f"{len(too_long)} paths are longer than Milvus's {PATH_MAX}-byte field, "
                        f"e.g. {too_long[0][:80]}…")
    client = connect(uri, token)
    try:
        if client.has_collection(collection):
            if not overwrite:
                raise UserError(f"Milvus collection {collection!r} already exists at {uri} (--overwrite replaces it)")
            from .milvus_space import artefacts_of

            for stale in artefacts_of(client, collection):  # built from the gallery being replaced
                client.drop_collection(stale)
            client.drop_collection(collection)
        index_params = export_build_params(index_type, n, index_params)
        ip = client.prepare_index_params()
        ip.add_index("vector", index_type=index_type, metric_type=METRIC, params=index_params)
        client.create_collection(collection, schema=_schema(pm, d), index_params=ip)
        content = hashlib.sha256(repr((int(n), int(d))).encode())
        for s in tqdm(range(0, n, batch), desc=f"export to {collection}", unit="batch", disable=not progress):
            x = np.ascontiguousarray(features[s: s + batch], dtype="<f4")
            content.update(x.tobytes())
            client.insert(collection, [
                {"id": int(items.ids[i]), "row": i, "vector": x[i - s].tolist(), "label": int(items.labels[i]),
                 "path": items.paths[i], "split": items.splits[i]} for i in range(s, s + len(x))])
        client.flush(collection)
        classes, counts = np.unique(np.asarray(items.labels, dtype=np.int64), return_counts=True)
        # written last: a collection whose export was interrupted has no dml.info and is refused
        meta = {"dim": int(d), "count": int(n), "embed_dim": int(W.shape[0]), "normalize": bool(normalize),
                "index_type": index_type, "index_params": dict(index_params or {}),
                "content_sha256": content.hexdigest(), "classes": int(len(classes)),
                **(info or {})}
        props = {"dml.info": json.dumps(meta),
                 "dml.neck": base64.b64encode(np.ascontiguousarray(W, dtype="<f4").tobytes()).decode(),
                 "dml.classes": json.dumps({str(k): v for k, v in (class_names or {}).items()})}
        if len(classes) <= CLASS_COUNTS_MAX:   # the app's AP and samples read class sizes without a scan
            props["dml.class_counts"] = json.dumps({"labels": classes.tolist(), "counts": counts.tolist()})
        from .milvus_space import set_properties

        set_properties(client, collection, props)
        wait_indexed(client, collection, "vector", progress)
        return n
    except pm.exceptions.MilvusException as e:
        raise UserError(f"Milvus export to {collection!r} at {uri} failed: {e.message}") from None
    finally:
        client.close()


def wait_indexed(client, collection: str, field: str, progress: bool = False, poll_s: float = 1.0) -> None:
    """Return once the server has indexed every row of `field` (it builds indexes after a flush,
    in the background: until then, searches scan the rows not yet indexed, and an offline pass
    through them would run on brute force)."""
    wait = 0.05
    with tqdm(desc=f"index of {collection}", unit="row", disable=not progress) as bar:
        while True:
            got = client.describe_index(collection, field)
            total, done = int(got.get("total_rows", 0)), int(got.get("indexed_rows", 0))
            bar.total = total
            bar.update(max(0, min(done, total) - bar.n))
            # rows in segments the server compacts are indexed again: pending until then
            if done >= total and int(got.get("pending_index_rows", 0)) == 0:
                return
            time.sleep(wait)
            wait = min(poll_s, 2 * wait)  # a small collection is indexed in a moment: asked again soon


def export_index(index_dir, uri: str, collection: str, **kw) -> int:
    """Export an index directory (features, metadata, class names, neck W, model facts) to a collection."""
    from .store import read_index

    data = read_index(index_dir)
    m = data.manifest
    info = {k: m[k] for k in MODEL_FACTS if k in m}
    # where re-rankers may memory-map the same vectors instead of reading them from the collection
    info["source_index"] = {"path": str(Path(index_dir).resolve()),
                            "features_sha256": m["files"]["features.npy"]["sha256"]}
    return export_features(uri, collection, data.features, data.items, data.W, normalize=bool(m["normalize"]),
                           info=info, class_names=data.class_names, **kw)


def _class_counts(text: str | None) -> tuple[np.ndarray, np.ndarray] | None:
    """(sorted labels, their item counts) from the `dml.class_counts` property; None without one
    (a collection exported before it was written, or with more than CLASS_COUNTS_MAX classes)."""
    if not text:
        return None
    d = json.loads(text)
    return np.asarray(d["labels"], dtype=np.int64), np.asarray(d["counts"], dtype=np.int64)


class _Candidates:
    """The collection as the candidate index of a `Searcher` (search.Searcher._rerank): FAISS's
    `ntotal` and `search(qt, k)` → (scores, rows), by inner product with qt (M′φ(q) or its
    cosine scaling, which ranks alike), −1 past the gallery.  A FLAT collection's top k is the
    exact one: it is scanned from the memory-mapped `features` (a block of rows at a time), the
    same rows Milvus would return, without a database round trip per candidate (Milvus Lite
    spends tens of µs on each).  Other index types ask Milvus (at most its top-k limit)."""

    def __init__(self, gallery: MilvusGallery, features: np.ndarray):
        self.gallery, self.features = gallery, features
        self.exact = gallery.info["index_type"] == EXACT_INDEX

    @property
    def ntotal(self) -> int:
        return len(self.gallery)

    def search(self, qt: np.ndarray, k: int):
        qt = np.ascontiguousarray(qt, dtype=np.float32)
        if self.exact:
            return self._scan(qt, min(k, self.ntotal))
        D = np.full((len(qt), k), -np.inf, dtype=np.float32)
        rows = np.full((len(qt), k), -1, dtype=np.int64)
        found = self.gallery.search_ip(qt, min(k, MAX_TOPK), ["row"])
        kk = min(k, MAX_TOPK)
        rows[:, :kk], D[:, :kk] = found.padded(found.fields["row"], kk, -1), found.padded(found.scores, kk, -np.inf)
        return D, rows

    def _scan(self, qt: np.ndarray, k: int):
        heap = faiss.ResultHeap(len(qt), k, keep_max=True)
        for s in range(0, self.ntotal, SCAN_ROWS):
            x = read_rows(self.features, s, s + SCAN_ROWS)  # the map's pages released after
            D, rows = faiss.knn(qt, x, min(k, len(x)), metric=faiss.METRIC_INNER_PRODUCT)
            heap.add_result(np.ascontiguousarray(D, dtype=np.float32), np.ascontiguousarray(rows + s, dtype=np.int64))
        heap.finalize()
        return heap.D, heap.I


class MilvusGallery(NeckGallery):
    """A collection written by export_*, searched under any M′ (metric.QueryMetric).  `nprobe`
    (IVF_* collections; None: Milvus's own) and `rerank_factor` are the defaults of every
    search (each search may override them)."""

    def __init__(self, uri: str, collection: str, token: str = "", nprobe: int | None = None,
                 rerank_factor: int = 10):
        self.pm = _pymilvus()
        self.uri, self.collection = str(uri), collection
        self.rerank_factor = rerank_factor
        self._nprobe = nprobe
        self._space_lock = threading.Lock()   # the vectors are found (or copied) once, whoever asks first
        self._searcher: Searcher | None = None
        self._key_lock = threading.Lock()
        self._content_key: str | None = None
        self.client = connect(uri, token)
        try:
            if not self.client.has_collection(collection):
                raise UserError(f"no Milvus collection {collection!r} at {uri}")
            props = self.client.describe_collection(collection).get("properties", {})
            if "dml.info" not in props or "dml.neck" not in props:
                raise UserError(f"Milvus collection {collection!r} was not written by this project's export")
            self.info = json.loads(props["dml.info"])
            self.W = np.frombuffer(base64.b64decode(props["dml.neck"]), dtype="<f4").reshape(
                self.info["embed_dim"], self.info["dim"])
            self.neck = neck_digest(self.W)   # the key of every M′ this gallery reads (gallery.refined_metric)
            self.class_names = {int(k): v for k, v in json.loads(props.get("dml.classes", "{}")).items()}
            self.class_counts = _class_counts(props.get("dml.class_counts"))
            metric = self.client.describe_index(collection, "vector").get("metric_type")
            if metric != METRIC:
                raise UserError(f"Milvus collection {collection!r} indexes with metric {metric}; "
                                f"searching under M′ needs {METRIC}")
            self.client.load_collection(collection)
        except self.pm.exceptions.MilvusException as e:
            raise UserError(f"cannot open Milvus collection {collection!r} at {uri}: {e.message}") from None

    @property
    def dim(self) -> int:
        return int(self.info["dim"])

    @property
    def normalize(self) -> bool:
        return bool(self.info["normalize"])

    def __len__(self) -> int:
        return int(self.info["count"])

    @property
    def nprobe(self) -> int | None:
        return self._nprobe

    @nprobe.setter
    def nprobe(self, value: int | None) -> None:
        with self._space_lock:
            self._nprobe = value
            self._searcher = None   # its caches are keyed by the candidate settings

    # ------------------------------------------------------------ rows, items, vectors
    def query_rows(self, uniq: np.ndarray, fields: list[str], collection: str | None = None) -> dict[str, Any]:
        """The given fields of the sorted distinct rows `uniq`, as columns in their order
        (`milvus_found.query`), FETCH rows at a time, from this gallery's collection or one of its
        artefacts' (`collection`, keyed by row as well)."""
        collection = collection or self.collection
        fields = list(dict.fromkeys(["row", *fields]))
        parts: list[dict[str, Any]] = []
        for s in range(0, len(uniq), FETCH):
            part = np.asarray(uniq[s: s + FETCH], dtype=np.int64)
            if len(part) and part[-1] - part[0] + 1 == len(part):
                expr = f"row >= {int(part[0])} and row <= {int(part[-1])}"
            else:
                expr = f"row in [{','.join(str(int(r)) for r in part)}]"
            try:
                got = milvus_found.query(self.client, collection, expr, fields, len(part))
            except self.pm.exceptions.MilvusException as e:
                raise UserError(f"Milvus query in {collection!r} failed: {e.message}") from None
            found, first = np.unique(np.asarray(got["row"], dtype=np.int64), return_index=True)
            if not np.array_equal(found, part):
                raise UserError(f"Milvus collection {collection!r} has no row {np.setdiff1d(part, found)[0]}")
            parts.append({f: milvus_found.take(got[f], first) for f in fields})
        if not parts:
            return {f: np.zeros(0, dtype=np.int64) for f in fields}
        return {f: milvus_found.concat([p[f] for p in parts]) for f in fields}

    def fetch_rows(self, rows: np.ndarray) -> np.ndarray:
        """The vectors of the given rows (any order, repeats allowed), float32, by the `row` field."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        uniq, back = np.unique(rows, return_inverse=True)
        got = self.query_rows(uniq, ["vector"])
        vecs = np.asarray(got["vector"], dtype=np.float32).reshape(len(uniq), self.dim)
        return vecs[back.reshape(-1)]

    def fetch_items(self, rows: np.ndarray) -> Items:
        """The id, label, path and split of the given rows (any order, repeats allowed), by the
        `row` field: what the app shows of the items it shows, never the whole collection's."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        uniq, back = np.unique(rows, return_inverse=True)
        got = self.query_rows(uniq, ITEM_FIELDS)
        back = back.reshape(-1)
        at = back.tolist()
        return Items(np.asarray(got["id"], dtype=np.int64)[back], np.asarray(got["label"], dtype=np.int64)[back],
                     [got["path"][i] for i in at], [got["split"][i] for i in at])

    def rows_of_ids(self, ids) -> np.ndarray:
        """The row of each item id (any order, repeats allowed); an id not in the collection is refused."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        uniq, back = np.unique(ids, return_inverse=True)
        got: dict[int, int] = {}
        for s in range(0, len(uniq), FETCH):
            part = uniq[s: s + FETCH]
            try:
                res = self.client.query(self.collection, filter=f"id in [{','.join(str(int(i)) for i in part)}]",
                                        output_fields=["id", "row"], limit=len(part))
            except self.pm.exceptions.MilvusException as e:
                raise UserError(f"Milvus query in {self.collection!r} failed: {e.message}") from None
            got.update({int(h["id"]): int(h["row"]) for h in res})
        missing = next((int(i) for i in uniq if int(i) not in got), None)
        if missing is not None:
            raise UserError(f"no item with id {missing} in this index")
        return np.array([got[int(i)] for i in uniq], dtype=np.int64)[back.reshape(-1)]

    def class_sizes(self, labels) -> np.ndarray:
        """How many items have each of `labels` (0 for a label no item has): from the counts stored
        at export, else counted in the collection, once per class (kept in the memory cache)."""
        labels = np.asarray(labels, dtype=np.int64)
        if self.class_counts is not None:
            return class_sizes_in(*self.class_counts, labels)
        key = key_hash(self.uri, self.collection, self.content_key)
        sizes = {int(c): int(self._count(key, int(c))[0]) for c in np.unique(labels)}
        return np.array([sizes[int(c)] for c in labels.reshape(-1)], dtype=np.int64).reshape(labels.shape)

    def _count(self, key: str, label: int) -> np.ndarray:
        """The number of items of class `label`, counted in the collection once (an array: what
        the memory cache measures)."""
        return CACHE.get_or_build(("milvus-class-size", key, label), lambda: self._query_count(label))

    def _query_count(self, label: int) -> np.ndarray:
        try:
            res = self.client.query(self.collection, filter=f"label == {int(label)}", output_fields=["count(*)"])
        except self.pm.exceptions.MilvusException as e:
            raise UserError(f"Milvus query in {self.collection!r} failed: {e.message}") from None
        return np.array([int(res[0]["count(*)"]) if res else 0], dtype=np.int64)

    @property
    def items(self) -> Items:
        """Every item's id, label, path and split, in row order (no vectors); read once per
        collection content (kept in the memory cache).  Re-rankers' metric space reads it; the
        app reads items by row (`fetch_items`)."""
        key = key_hash(self.uri, self.collection, self.content_key)
        return CACHE.get_or_build(("milvus-items", key), self._read_items)[0]

    def _read_items(self) -> tuple[Items, list[np.ndarray]]:
        n = len(self)
        ids, labels = np.full(n, -1, dtype=np.int64), np.full(n, -1, dtype=np.int64)
        paths, splits = [""] * n, [""] * n
        try:
            # pages of rows by the `row` field, as fetch_rows reads vectors (a query iterator asks a
            # 2.3 server for a snapshot timestamp it does not give, and pymilvus warns)
            for start in range(0, n, FETCH):
                page = self.client.query(self.collection, filter=f"row >= {start} and row < {start + FETCH}",
                                         output_fields=["id", "row", "label", "path", "split"], limit=FETCH)
                for h in page:
                    r = int(h["row"])
                    ids[r], labels[r], paths[r], splits[r] = int(h["id"]), int(h["label"]), h["path"], h["split"]
        except self.pm.exceptions.MilvusException as e:
            raise UserError(f"cannot read Milvus collection {self.collection!r}'s items: {e.message}") from None
        return Items(ids, labels, paths, splits), [ids, labels]  # the arrays: what it weighs in the budget

    @property
    def content_key(self) -> str:
        """The checksum of the collection's vectors recorded at export (`content_sha256`); for a
        collection without one, a checksum of its facts, neck and 256 evenly spaced rows.  The
        identity of the collection as opened (as `info` and W are), read once: every key of its
        state in the memory cache and on disk derives from it."""
        with self._key_lock:
            if self._content_key is None:
                self._content_key = self._checksum()
            return self._content_key

    def _checksum(self) -> str:
        if self.info.get("content_sha256"):
            return str(self.info["content_sha256"])
        n = len(self)
        h = hashlib.sha256(json.dumps(self.info, sort_keys=True).encode())
        h.update(np.ascontiguousarray(self.W, dtype="<f4").tobytes())
        h.update(self.fetch_rows(np.unique(np.linspace(0, n - 1, min(n, 256)).astype(np.int64))).tobytes())
        return h.hexdigest()

    def _source_features(self) -> tuple[np.ndarray, Path] | None:
        """The source index's features.npy, memory-mapped, where it still holds this collection's
        vectors (its manifest's checksum as at export, its shape, and SAMPLE_ROWS rows equal to
        the collection's); None otherwise."""
        src = self.info.get("source_index")
        if not isinstance(src, dict) or not src.get("path"):
            return None
        path = Path(src["path"])
        try:
            man = json.loads((path / "manifest.json").read_text())
            if man["files"]["features.npy"]["sha256"] != src.get("features_sha256"):
                return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        try:
            x = load_npy(path / "features.npy", "features", mmap=True)
        except UserError:
            return None
        n = len(self)
        if x.shape != (n, self.dim) or x.dtype != np.dtype("<f4"):
            return None
        sample = np.unique(np.linspace(0, n - 1, min(n, SAMPLE_ROWS)).astype(np.int64))
        if not np.array_equal(np.asarray(x[sample]), self.fetch_rows(sample)):
            return None
        return x, path

    def _copied_features(self) -> tuple[np.ndarray, Path]:
        """The collection's vectors copied once, FETCH rows at a time, into a .npy under the
        re-ranking cache folder (space.cache_root(), beside the offline caches; named by
        `content_key`), memory-mapped."""
        n, d = len(self), self.dim
        folder = cache_root() / f"milvus-{self.content_key[:32]}"
        path = folder / "features.npy"
        if path.is_file():
            try:
                x = load_npy(path, "features", mmap=True)
                if x.shape == (n, d) and x.dtype == np.dtype("<f4"):
                    return x, folder
            except UserError:
                pass  # unreadable (a full disk once): copied again
        folder.mkdir(parents=True, exist_ok=True)
        need = n * d * 4 + 4096
        free = shutil.disk_usage(folder).free
        if free < need:
            raise UserError(f"re-ranking on Milvus collection {self.collection!r} copies its vectors "
                            f"({need / 2**30:.2f} GiB) to {folder}, which has {free / 2**30:.2f} GiB free; free space "
                            f"there or set XDG_CACHE_HOME to a larger disk")

        def write(tmp: Path) -> None:
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype="<f4", shape=(n, d))
            for s in range(0, n, FETCH):
                out[s: s + FETCH] = self.fetch_rows(np.arange(s, min(n, s + FETCH)))
            out.flush()
            del out
        write_with(path, write)
        return load_npy(path, "features", mmap=True), folder

    def _in_memory(self) -> Searcher:
        """This gallery as a `Searcher`, for re-rankers: candidates from the collection, re-ranked
        exactly over the memory-mapped vectors (the source index's, else the copied ones).  Kept on
        this object (`metric_space`): a view over its handles (the memory map, the client), whose
        computed state (M′, cosine norms) lives in the memory cache and goes with it."""
        features, where = self._source_features() or self._copied_features()
        # what re-rankers' offline caches are keyed by (space.store.fingerprint): the collection's
        # content, the neck, and the candidate settings their neighbour lists were searched with
        content = {"milvus": self.content_key, "index_type": self.info["index_type"],
                   "W": hashlib.sha256(np.ascontiguousarray(self.W).tobytes()).hexdigest(),
                   "nprobe": self.nprobe, "rerank_factor": self.rerank_factor}
        data = IndexData(where, {"normalize": self.normalize, "factory": f"milvus {self.info['index_type']}",
                                 "count": len(self), "files": content},
                         features, self.items, np.asarray(self.W, dtype=np.float32),
                         _Candidates(self, features), dict(self.class_names))  # type: ignore[arg-type]
        return Searcher(data, rerank_factor=self.rerank_factor)

    def metric_space(self, strategy: str, params: dict | None, mode: str, by_row: bool = False):
        """By row (`by_row`): the collection read by row, its artefacts in collections beside it
        (milvus_space.MilvusSpace); otherwise the space over a copy of its vectors (`_in_memory`)."""
        if by_row:
            from .milvus_space import MilvusSpace

            return MilvusSpace(self, strategy, params, mode)
        return super().metric_space(strategy, params, mode)

    # ------------------------------------------------------------ search
    max_topk = MAX_TOPK

    def wait_indexed(self, collection: str, field: str, progress: bool = False) -> None:
        """`wait_indexed` on one of this gallery's collections (its own, or an artefact's)."""
        wait_indexed(self.client, collection, field, progress)

    def scores_exact(self, mode: str) -> bool:
        """Whether Milvus's own scores are the similarity under M′ in `mode`: bilinear, on an index
        of the stored float vectors (FLAT, HNSW, IVF_FLAT: no quantisation)."""
        return mode == "bilinear" and self.info["index_type"] in EXACT_SCORES

    def search_width(self, pool: int) -> int | None:
        """How wide a search proposing `pool` candidates walks (HNSW's ef); None on FLAT (exact)."""
        return None if self.info["index_type"] == EXACT_INDEX else pool

    def index_build_params(self) -> dict:
        """The parameters the collection's vector index was built with (as exported; {}: Milvus's)."""
        return dict(self.info.get("index_params") or {})

    def search_params(self, limit: int, nprobe: int | None, width: int | None = None) -> dict:
        """Milvus's search parameters for a search of `limit` hits at most `width` wide."""
        index_type = self.info["index_type"]
        params = {"ef": max(limit, width or 0)} if index_type == "HNSW" else {"nprobe": nprobe} if nprobe else {}
        return {"metric_type": METRIC, "params": params}

    def search_ip(self, qt: np.ndarray, limit: int, output_fields: list[str], nprobe: int | None = None,
                  width: int | None = None, collection: str | None = None, field: str = "vector") -> Found:
        """Milvus's top-`limit` hits per row of qt by inner product with the stored φ(x) (or with
        `field` of one of its artefacts' `collection`, indexed alike), as columns; `width`: the
        candidates an HNSW search keeps while it walks the graph (its ef; default `limit`)."""
        nprobe = self.nprobe if nprobe is None else nprobe
        collection = collection or self.collection
        try:
            return milvus_found.search(self.client, collection, np.asarray(qt, dtype=np.float32).tolist(), limit,
                                       field, self.search_params(limit, nprobe, width), output_fields)
        except self.pm.exceptions.MilvusException as e:
            raise UserError(f"Milvus search in {collection!r} failed: {e.message}") from None

    def top_rows(self, qt: np.ndarray, k: int, width: int | None, collection: str | None = None, field: str = "vector",
                 cells: int = 1 << 16) -> tuple[np.ndarray, np.ndarray]:
        """Each row of qt's top-k `row`s by inner product (`search_ip`, only each hit's row coming
        back), `cells` queries × k asked at once: (rows int64, scores float32), −1 and −inf where
        fewer came back."""
        rows = np.full((len(qt), k), -1, dtype=np.int64)
        scores = np.full((len(qt), k), -np.inf, dtype=np.float32)
        step = max(1, cells // k)
        for a in range(0, len(qt), step):
            res = self.search_ip(qt[a: a + step], k, ["row"], None, width, collection, field)
            rows[a: a + step] = res.padded(res.fields["row"], k, -1)
            scores[a: a + step] = res.padded(res.scores, k, -np.inf)
        return rows, scores

    def search_metric(self, feats: np.ndarray, metric: QueryMetric, k: int = 10, nprobe: int | None = None,
                      rerank_factor: int | None = None, what: str = "query features") -> Hits:
        """Top-k under `metric`.  Bilinear on a FLAT, HNSW or IVF_FLAT collection: Milvus's IP
        scores are exact (an HNSW search as wide as the candidate pool: ef = the pool size).
        Otherwise (cosine mode, quantised indexes) the pool comes back with its vectors and is
        re-ranked exactly (`nprobe`: lists probed in an IVF_* collection)."""
        if not 1 <= k <= MAX_TOPK:
            raise UserError(f"k must be in [1, {MAX_TOPK}], got {k}")
        rerank_factor = self.rerank_factor if rerank_factor is None else rerank_factor
        qt = metric.transform(self.prepare_queries(feats, what))
        # HNSW and IVF_FLAT score the stored float vectors, so Milvus's bilinear scores are exact: the
        # candidates widen its search (HNSW's ef) and its top k is the exact top k of what it found,
        # as re-scoring them would make it, without their vectors coming back
        rerank = not self.scores_exact(metric.mode)
        pool = min(MAX_TOPK, metric.candidate_count(k, len(self), rerank_factor))
        limit = pool if rerank else min(k, len(self))
        res = self.search_ip(qt, limit, OUTPUT + (["vector"] if rerank else []), nprobe, self.search_width(pool))
        R = np.full((len(qt), k), -1, dtype=np.int64)
        S = np.full((len(qt), k), -np.inf, dtype=np.float32)
        at = np.full((len(qt), k), -1, dtype=np.int64)
        kept: list[np.ndarray] = []  # each query's kept hits (positions in res): Hits.items, `at` points there
        for i in range(len(qt)):
            a, b = int(res.at[i]), int(res.at[i + 1])
            _, first = np.unique(res.fields["row"][a:b], return_index=True)
            pos = a + np.sort(first)  # each row once, in Milvus's order
            rows = res.fields["row"][pos]
            if rerank and len(rows):
                X = res.fields["vector"][pos]
                R[i], S[i] = exact_top(qt[i], rows, X, metric.norms(X), k)
                where = dict(zip(rows.tolist(), pos.tolist(), strict=True))
                pos = np.array([where[r] for r in R[i].tolist() if r >= 0], dtype=np.int64)
            else:
                pos = pos[:k]
                R[i, : len(pos)] = rows[: len(pos)]
                S[i, : len(pos)] = res.scores[pos]
            offset = sum(len(p) for p in kept)
            at[i, : len(pos)] = offset + np.arange(len(pos))
            kept.append(pos)
        pos = np.concatenate(kept) if kept else np.zeros(0, dtype=np.int64)
        at_list = pos.tolist()
        items = Items(res.ids[pos], np.asarray(res.fields["label"], dtype=np.int64)[pos],
                      [res.fields["path"][p] for p in at_list], [res.fields["split"][p] for p in at_list])
        return Hits(R, S, items, at, self.class_names)

    def close(self) -> None:
        self.client.close()
