"""A Milvus search's hits (`Found`) and a query's entities (`query`) as columns, read from the
server's reply as it came.

pymilvus turns every hit and every entity into a dict of its fields: at 64 hits for each of
1,024 queries that took more of a 2-core machine than the server's search itself (a
neighbour-list block spent 55 % of its time there), and an ARRAY cell costs more again.  The
reply holds each field as one repeated column, which numpy reads whole.  pymilvus's own result
is the fallback where the pinned pymilvus's (requirements-milvus.txt) request-building calls are
not there.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np


class Found(NamedTuple):
    """Hits of one search, column by column: query i's are [at[i], at[i + 1]), best first;
    `fields` {output field: one value per hit} (vectors: hits × dim float32; strings: a list)."""
    at: np.ndarray
    ids: np.ndarray
    scores: np.ndarray
    fields: dict[str, Any]

    def __len__(self) -> int:
        return len(self.at) - 1

    def counts(self) -> np.ndarray:
        return np.diff(self.at)

    def padded(self, values: np.ndarray, k: int, fill) -> np.ndarray:
        """nq × k: each query's first k of `values` (one per hit), `fill` past its hits."""
        values = np.asarray(values)
        out = np.full((len(self), k), fill, dtype=values.dtype)
        counts = np.minimum(self.counts(), k)
        where = np.arange(k)[None, :] < counts[:, None]
        take = (self.at[:-1, None] + np.arange(k)[None, :])[where]
        out[where] = values[take]
        return out


def _column(fd) -> Any:
    """One output field of the reply as an array (a list for strings)."""
    kind = fd.WhichOneof("field")
    if kind == "vectors":
        v = fd.vectors
        if v.WhichOneof("data") != "float_vector":
            raise TypeError(f"field {fd.field_name!r}: only float vectors are read")
        return np.asarray(v.float_vector.data, dtype=np.float32).reshape(-1, v.dim)
    s = fd.scalars
    data = s.WhichOneof("data")
    if data == "array_data":  # one cell per entity: an array each
        return [_cell(c) for c in s.array_data.data]
    return _cell(s, fd.field_name)


def _cell(s, name: str = "") -> Any:
    """A ScalarField's values: an array (a list for strings)."""
    data = s.WhichOneof("data")
    if data is None:
        return np.zeros(0, dtype=np.int64)
    if data in ("long_data", "int_data"):
        return np.asarray(getattr(s, data).data, dtype=np.int64)
    if data in ("float_data", "double_data"):
        return np.asarray(getattr(s, data).data, dtype=np.float64 if data == "double_data" else np.float32)
    if data == "string_data":
        return list(s.string_data.data)
    if data == "bool_data":
        return np.asarray(s.bool_data.data, dtype=bool)
    raise TypeError(f"field {name!r}: {data} is not read")


def from_reply(results, output_fields: list[str]) -> Found:
    """`Found` from a SearchResultData message."""
    topks = np.asarray(results.topks, dtype=np.int64)
    at = np.concatenate([[0], np.cumsum(topks)]).astype(np.int64)
    ids = np.asarray(results.ids.int_id.data, dtype=np.int64)
    fields = {fd.field_name: _column(fd) for fd in results.fields_data if fd.field_name in output_fields}
    missing = sorted(set(output_fields) - set(fields))
    if missing and at[-1] > 0:
        raise TypeError(f"the reply holds no field {missing}")
    fields |= {f: np.zeros(0, dtype=np.int64) for f in missing}  # no hits at all
    return Found(at, ids, np.asarray(results.scores, dtype=np.float32), fields)


def from_hits(res, output_fields: list[str]) -> Found:
    """`Found` from pymilvus's own result (a list of lists of hit dicts)."""
    counts = [len(found) for found in res]
    at = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    hits = [h for found in res for h in found]
    fields: dict[str, Any] = {}
    for f in output_fields:
        values = [h["entity"][f] for h in hits]
        fields[f] = values if values and isinstance(values[0], str) else np.asarray(
            values, dtype=np.float32 if values and isinstance(values[0], list) else None)
    return Found(at, np.asarray([h["id"] for h in hits], dtype=np.int64),
                 np.asarray([h["distance"] for h in hits], dtype=np.float32), fields)


def search(client, collection: str, data: list, limit: int, anns_field: str, search_params: dict,
           output_fields: list[str]) -> Found:
    """client.search, its reply read as columns (raises pymilvus's MilvusException on an error)."""
    import grpc
    from pymilvus.client.utils import check_status
    from pymilvus.exceptions import MilvusException

    future = client.search(collection, data=data, limit=limit, anns_field=anns_field, search_params=search_params,
                           output_fields=output_fields, _async=True)
    reply = getattr(future, "_future", None)
    if reply is None:  # no raw reply to read: pymilvus's own result
        return from_hits(future.result(), output_fields)
    try:
        response = reply.result()
    except grpc.RpcError as e:  # as the blocking search reports it
        raise MilvusException(message=f"{e.code()}: {e.details()}") from None
    check_status(response.status)
    return from_reply(response.results, output_fields)


def _query_parts(client) -> tuple:
    """What sending MilvusClient.query's request takes, from the pinned pymilvus's modules and
    the client (AttributeError, ImportError: another pymilvus)."""
    from pymilvus.client import ts_utils
    from pymilvus.client.call_context import _api_level_md
    from pymilvus.client.prepare import Prepare
    from pymilvus.client.types import Status

    conn = client._get_connection()
    conn._stub  # noqa: B018  (there, or AttributeError)
    return ts_utils, _api_level_md, Prepare, Status, conn, client._generate_call_context(), client._with_cluster_id({})


def query(client, collection: str, expr: str, output_fields: list[str], limit: int) -> dict[str, Any]:
    """client.query's entities as columns {field: one value per entity} (vectors: n × dim float32;
    ARRAY fields: a list of arrays; strings: a list), in the reply's order."""
    import grpc
    from pymilvus.client.utils import check_status
    from pymilvus.exceptions import MilvusException

    try:
        ts_utils, _api_level_md, Prepare, Status, conn, context, kwargs = _query_parts(client)
    except (ImportError, AttributeError):
        return from_entities(client.query(collection, filter=expr, output_fields=output_fields, limit=limit),
                             output_fields)
    default = ts_utils.construct_guarantee_ts(collection, kwargs, conn.server_address, context.get_db_name())
    request = Prepare.query_request(collection, expr, output_fields, None, use_default_consistency=default,
                                    limit=limit, **kwargs)
    try:
        response = conn._stub.Query(request, metadata=_api_level_md(context))
    except grpc.RpcError as e:
        raise MilvusException(message=f"{e.code()}: {e.details()}") from None
    if Status.EMPTY_COLLECTION in {response.status.code, response.status.error_code}:
        return {f: np.zeros(0, dtype=np.int64) for f in output_fields}
    check_status(response.status)
    got = {fd.field_name: _column(fd) for fd in response.fields_data if fd.field_name in output_fields}
    n = len(next(iter(got.values()))) if got else 0
    return got | {f: np.zeros(0, dtype=np.int64) for f in output_fields if f not in got and n == 0}


def from_entities(rows: list[dict], output_fields: list[str]) -> dict[str, Any]:
    """`query`'s columns from pymilvus's own result (a dict per entity): vectors and ARRAY cells
    as a list of arrays."""
    out: dict[str, Any] = {}
    for f in output_fields:
        values = [r[f] for r in rows]
        if values and isinstance(values[0], str):
            out[f] = values
        elif values and not np.isscalar(values[0]):
            out[f] = [np.asarray(v) for v in values]
        else:
            out[f] = np.asarray(values) if values else np.zeros(0, dtype=np.int64)
    return out


def take(column: Any, at: np.ndarray) -> Any:
    """The entries of a column at the given positions."""
    return column[at] if isinstance(column, np.ndarray) else [column[i] for i in at.tolist()]


def concat(columns: list[Any]) -> Any:
    """Columns of the same field, one after the other."""
    if columns and all(isinstance(c, np.ndarray) for c in columns):
        return np.concatenate(columns)
    return [v for c in columns for v in c]
