"""A gallery in Milvus: φ(x) and its metadata in a collection searched by inner product with
the query M′φ(q), since φ(q)ᵀM′φ(x) = (M′φ(q))ᵀφ(x); the metric type is always IP, never
COSINE (cosine mode re-ranks IP candidates exactly).  A path URI is Milvus Lite, http(s)://
a server.  `MilvusGallery` is a `gallery.Gallery`; it does not re-rank (the vectors stay in
the database).  The collection layout and the reasons: docs/scale-out.md ("Milvus").
pymilvus and milvus-lite are an optional extra (requirements-milvus.txt), imported only here.
"""
from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import UserError

from ..metric import QueryMetric
from ..space import MetricSpace
from .gallery import Hits, NeckGallery, exact_top
from .store import Items

METRIC = "IP"            # never "COSINE": see the module docstring
EXACT_INDEX = "FLAT"     # exact: bilinear scores come straight from Milvus
MAX_TOPK = 16384         # Milvus's limit on one search's top-k
PATH_MAX, SPLIT_MAX = 4096, 256
OUTPUT = ["row", "label", "path", "split"]
INSTALL = "pip install -r requirements-milvus.txt"
RERANK_REFUSAL = ("the milvus backend does not re-rank: re-rankers read the gallery's vectors, which stay in Milvus; "
             "search the index directory (--backend faiss) or its on-disk IVF (--backend ondisk)")
# index-manifest keys that travel with the gallery: query images are embedded by the same model
MODEL_FACTS = ("checkpoint", "checkpoint_sha256", "backbone", "transform", "trunk_dim", "dataset", "split")


def _pymilvus():
    try:
        import pymilvus
    except ImportError:
        raise UserError(f"the Milvus backend needs the optional pymilvus package: {INSTALL}") from None
    return pymilvus


def connect(uri: str, token: str = ""):
    """A MilvusClient: PATH.db opens Milvus Lite in this process, http(s)://host:port a server."""
    pm = _pymilvus()
    uri = str(uri)
    if not uri.startswith(("http://", "https://", "tcp://", "unix:")):
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
                    index_type: str = EXACT_INDEX, index_params: dict | None = None, batch: int = 5000) -> int:
    """Store the rows of `features` (φ(x) as the index stores them) with `items`' metadata
    (ids, labels, paths, splits) in a new collection; returns the number of rows stored.

    `index_type` other than FLAT (e.g. HNSW on a server) makes search fetch candidates and
    re-rank them exactly.  An existing collection is refused unless `overwrite`."""
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
            client.drop_collection(collection)
        ip = client.prepare_index_params()
        ip.add_index("vector", index_type=index_type, metric_type=METRIC, params=index_params or {})
        client.create_collection(collection, schema=_schema(pm, d), index_params=ip)
        meta = {"dim": int(d), "count": int(n), "embed_dim": int(W.shape[0]), "normalize": bool(normalize),
                "index_type": index_type, **(info or {})}
        client.alter_collection_properties(collection, properties={
            "dml.info": json.dumps(meta),
            "dml.neck": base64.b64encode(np.ascontiguousarray(W, dtype="<f4").tobytes()).decode(),
            "dml.classes": json.dumps({str(k): v for k, v in (class_names or {}).items()})})
        for s in range(0, n, batch):
            x = np.asarray(features[s: s + batch], dtype=np.float32)
            client.insert(collection, [
                {"id": int(items.ids[i]), "row": i, "vector": x[i - s].tolist(), "label": int(items.labels[i]),
                 "path": items.paths[i], "split": items.splits[i]} for i in range(s, s + len(x))])
        client.flush(collection)
        return n
    except pm.exceptions.MilvusException as e:
        raise UserError(f"Milvus export to {collection!r} at {uri} failed: {e.message}") from None
    finally:
        client.close()


def export_index(index_dir, uri: str, collection: str, **kw) -> int:
    """Export an index directory (features, metadata, class names, neck W, model facts) to a collection."""
    from .store import read_index

    data = read_index(index_dir)
    m = data.manifest
    info = {k: m[k] for k in MODEL_FACTS if k in m}
    return export_features(uri, collection, data.features, data.items, data.W, normalize=bool(m["normalize"]),
                           info=info, class_names=data.class_names, **kw)


class MilvusGallery(NeckGallery):
    """A collection written by export_*, searched under any M′ (metric.QueryMetric).  `nprobe`
    (IVF_* collections; None: Milvus's own) and `rerank_factor` are the defaults of every
    search (each search may override them)."""

    def __init__(self, uri: str, collection: str, token: str = "", nprobe: int | None = None,
                 rerank_factor: int = 10):
        self.pm = _pymilvus()
        self.uri, self.collection = str(uri), collection
        self.nprobe, self.rerank_factor = nprobe, rerank_factor
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
            self.class_names = {int(k): v for k, v in json.loads(props.get("dml.classes", "{}")).items()}
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

    def metric_space(self, strategy: str, params: dict | None, mode: str) -> MetricSpace:
        raise UserError(RERANK_REFUSAL)

    def search_metric(self, feats: np.ndarray, metric: QueryMetric, k: int = 10, nprobe: int | None = None,
                      rerank_factor: int | None = None, what: str = "query features") -> Hits:
        """Top-k under `metric`.  Bilinear on a FLAT collection: Milvus's IP scores are exact.
        Otherwise candidates come back with their vectors and are re-ranked exactly
        (`nprobe`: lists probed in an IVF_* collection; HNSW searches with ef = the pool size)."""
        if not 1 <= k <= MAX_TOPK:
            raise UserError(f"k must be in [1, {MAX_TOPK}], got {k}")
        nprobe = self.nprobe if nprobe is None else nprobe
        rerank_factor = self.rerank_factor if rerank_factor is None else rerank_factor
        qt = metric.transform(self.prepare_queries(feats, what))
        index_type = self.info["index_type"]
        rerank = metric.mode == "cosine" or index_type != EXACT_INDEX
        limit = min(MAX_TOPK, metric.candidate_count(k, len(self), rerank_factor)) if rerank else min(k, len(self))
        params = {"ef": limit} if index_type == "HNSW" else {"nprobe": nprobe} if nprobe else {}
        try:
            res = self.client.search(self.collection, data=qt.tolist(), limit=limit, anns_field="vector",
                                     search_params={"metric_type": METRIC, "params": params},
                                     output_fields=OUTPUT + (["vector"] if rerank else []))
        except self.pm.exceptions.MilvusException as e:
            raise UserError(f"Milvus search in {self.collection!r} failed: {e.message}") from None
        R = np.full((len(qt), k), -1, dtype=np.int64)
        S = np.full((len(qt), k), -np.inf, dtype=np.float32)
        at = np.full((len(qt), k), -1, dtype=np.int64)
        # the metadata of every hit kept, in order: Hits.items, `at` points into it
        found_hits: list[dict[str, Any]] = []
        for i, found in enumerate(res):
            by_row = {h["entity"]["row"]: h for h in found}
            rows = np.fromiter(by_row, dtype=np.int64, count=len(by_row))
            if rerank and len(rows):
                X = np.asarray([by_row[r]["entity"]["vector"] for r in rows], dtype=np.float32)
                R[i], S[i] = exact_top(qt[i], rows, X, metric.norms(X), k)
            else:
                R[i, : len(rows)] = rows
                S[i, : len(rows)] = [by_row[r]["distance"] for r in rows]
            for j, r in enumerate(R[i]):
                if r >= 0:
                    at[i, j] = len(found_hits)
                    found_hits.append(by_row[r])
        items = Items(np.array([h["id"] for h in found_hits], dtype=np.int64),
                      np.array([h["entity"]["label"] for h in found_hits], dtype=np.int64),
                      [h["entity"]["path"] for h in found_hits], [h["entity"]["split"] for h in found_hits])
        return Hits(R, S, items, at, self.class_names)

    def close(self) -> None:
        self.client.close()
