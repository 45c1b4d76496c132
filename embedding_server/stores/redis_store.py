"""``redis://[:password@]host:port/db``: the cluster serving store (HugeCTR's in-memory tier).

Keys (``P`` is the prefix, default ``dlrm``):

    P:current                      name of the current version
    P:versions                     sorted set of complete versions by publish time
    P:incomplete                   set of versions being written; P:writing:<v> is the writer's lease
    P:v:<v>:meta                   ModelVersion (JSON)
    P:v:<v>:dense                  dense weights (torch.save bytes, loaded with weights_only)
    P:v:<v>:t:<table>:<part>       hash: row id (decimal) -> row bytes (fp32/fp16), 1M rows a part
    P:v:<v>:updates                stream of live updates: {t: table, ids: int64 bytes} or {dense: 1}

Lookups of all tables of a request go out as one pipeline of HMGETs (one round trip); hiredis
parses the replies. Every call has a socket timeout: an unreachable Redis raises
:class:`StoreUnavailable` quickly instead of hanging a request.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import numpy as np
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from dlrm_core.errors import ConfigError
from embedding_server.stores.base import (
    ServingStore,
    StoreUnavailable,
    UpdateBatch,
    VersionNotFound,
    VersionWriter,
)
from embedding_server.stores.file_store import check_version_name
from embedding_server.wire import (
    NUMPY_DTYPE,
    ModelVersion,
    decode_ids,
    decode_state,
    encode_ids,
    encode_rows,
    encode_state,
)

log = logging.getLogger(__name__)

PART_BITS = 20
"""Rows per hash key: 2^20 (bounds the size of any one key)."""
PIPELINE_BYTES = 4 << 20
"""Flush a write pipeline after this many bytes of rows (bounds publisher memory)."""
LEASE_S = 600
UPDATES_MAXLEN = 20_000
"""Live-update stream entries kept; a reader further behind drops its whole cache."""

REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


def rows_by_part(ids: np.ndarray, rows: np.ndarray, dtype) -> dict[int, dict[bytes, bytes]]:
    """Hash part -> {row id (decimal) -> encoded row}: the HSET mappings for some rows."""
    enc = encode_rows(rows, dtype)
    stride = enc.shape[1] * enc.itemsize
    raw = enc.tobytes()
    by_part: dict[int, dict[bytes, bytes]] = defaultdict(dict)
    for i, row in enumerate(ids.tolist()):
        by_part[row >> PART_BITS][b"%d" % row] = raw[i * stride : (i + 1) * stride]
    return by_part


class RedisVersionWriter(VersionWriter):
    def __init__(self, store: RedisStore, meta: ModelVersion) -> None:
        self.store = store
        self.meta = meta
        self._pipe = store.client.pipeline(transaction=False)
        self._bytes = 0
        v = meta.version
        with store.errors():  # the lease first: a concurrent collector must not take it for dead
            store.client.set(store.key("writing", v), "1", ex=LEASE_S)
            store.client.sadd(store.key("incomplete"), v)

    def _flush(self) -> None:
        with self.store.errors():
            self._pipe.set(self.store.key("writing", self.meta.version), "1", ex=LEASE_S)
            self._pipe.execute()
        self._bytes = 0

    def write_rows(self, table: str, start: int, rows: np.ndarray) -> None:
        ids = np.arange(start, start + len(rows), dtype=np.int64)
        for part, mapping in rows_by_part(ids, rows, self.meta.row_dtype).items():
            self._pipe.hset(self.store.rows_key(self.meta.version, table, part), mapping=mapping)
        self._bytes += rows.shape[0] * rows.shape[1] * NUMPY_DTYPE[self.meta.row_dtype].itemsize
        if self._bytes >= PIPELINE_BYTES:
            self._flush()

    def write_dense(self, state: dict[str, torch.Tensor]) -> None:
        self._pipe.set(self.store.key("v", self.meta.version, "dense"), encode_state(state))

    def commit(self) -> None:
        s, v = self.store, self.meta.version
        self._pipe.set(s.key("v", v, "meta"), self.meta.model_dump_json())
        self._flush()
        with s.errors():
            pipe = s.client.pipeline(transaction=True)
            pipe.zadd(s.key("versions"), {v: time.time()})
            pipe.srem(s.key("incomplete"), v)
            pipe.delete(s.key("writing", v))
            pipe.set(s.key("current"), v)  # the version is complete: readers may switch
            pipe.execute()
        s.collect_garbage(v)

    def abort(self) -> None:
        self._pipe.reset()
        try:
            self.store.delete_version(self.meta.version)
        except StoreUnavailable:
            log.warning("could not clean up version %s after an aborted publish", self.meta.version)


class RedisStore(ServingStore):
    remote = True

    def __init__(
        self, url: str, keep_versions: int = 3, prefix: str = "dlrm", timeout_s: float = 1.0
    ) -> None:
        super().__init__(keep_versions)
        # An optional ?prefix=NAME keeps several models (or tests) apart in one database.
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        prefix = query.pop("prefix", [prefix])[0]
        url = urlunsplit(parts._replace(query=urlencode(query, doseq=True)))
        self.url = url
        self.prefix = prefix
        try:
            # No client-side retries: a failed call fails fast (the API answers 503 at once and
            # the next call reconnects), instead of stalling requests for seconds of backoff.
            self.client = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                health_check_interval=30, decode_responses=False, retry=Retry(NoBackoff(), 0),
            )
        except ValueError as exc:
            raise ConfigError(f"store URL {url!r}: {exc}") from None
        self._meta_cache: dict[str, ModelVersion] = {}

    # -- helpers ------------------------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def rows_key(self, version: str, table: str, part: int) -> str:
        return self.key("v", version, "t", table, str(part))

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Turn connection failures into :class:`StoreUnavailable`."""
        try:
            yield
        except redis.exceptions.AuthenticationError as exc:
            raise StoreUnavailable(f"redis store {self.url}: authentication failed ({exc})") from exc
        except REDIS_ERRORS as exc:
            raise StoreUnavailable(f"redis store {self.url} unavailable: {exc}") from exc

    def ping(self) -> None:
        with self.errors():
            self.client.ping()

    # -- registry ------------------------------------------------------------------------------------
    def current_version(self) -> str | None:
        with self.errors():
            v = self.client.get(self.key("current"))
        return v.decode() if v else None

    def read_meta(self, version: str) -> ModelVersion:
        cached = self._meta_cache.get(version)
        if cached is not None:
            return cached
        with self.errors():
            raw = self.client.get(self.key("v", version, "meta"))
        if raw is None:
            raise VersionNotFound(f"{self.url} has no version {version!r}")
        meta = ModelVersion.model_validate_json(raw)
        self._meta_cache[version] = meta
        return meta

    def list_versions(self) -> list[str]:
        with self.errors():
            return [v.decode() for v in self.client.zrange(self.key("versions"), 0, -1)]

    def delete_version(self, version: str) -> None:
        with self.errors():
            batch = []
            for key in self.client.scan_iter(match=self.key("v", version, "*"), count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    self.client.unlink(*batch)
                    batch = []
            if batch:
                self.client.unlink(*batch)
            self.client.zrem(self.key("versions"), version)
            self.client.srem(self.key("incomplete"), version)
        self._meta_cache.pop(version, None)

    def collect_garbage(self, current: str) -> list[str]:
        removed = super().collect_garbage(current)
        with self.errors():
            stale = [v.decode() for v in self.client.smembers(self.key("incomplete"))]
            stale = [v for v in stale if not self.client.exists(self.key("writing", v))]
        for v in stale:  # publishers that died mid-write: their lease expired
            self.delete_version(v)
        return removed + stale

    # -- reading -------------------------------------------------------------------------------------
    def read_dense(self, version: str) -> dict[str, torch.Tensor]:
        with self.errors():
            raw = self.client.get(self.key("v", version, "dense"))
        if raw is None:
            raise VersionNotFound(f"{self.url}: version {version!r} has no dense weights")
        return decode_state(raw)

    def get_rows(self, version: str, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.get_rows_many(version, {table: ids})[table]

    def get_rows_many(
        self, version: str, requests: dict[str, np.ndarray]
    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Rows of several tables in one pipelined round trip."""
        meta = self.read_meta(version)
        dims = {t.name: t.dim for t in meta.spec.tables}
        pipe = self.client.pipeline(transaction=False)
        plan = []
        for table, ids in requests.items():
            parts = ids >> PART_BITS
            for part in np.unique(parts):
                sel = np.flatnonzero(parts == part)
                pipe.hmget(self.rows_key(version, table, int(part)), [b"%d" % i for i in ids[sel]])
                plan.append((table, sel))
        with self.errors():
            replies = pipe.execute()
        out = {}
        dtype = NUMPY_DTYPE[meta.row_dtype]
        for table, ids in requests.items():
            out[table] = (np.zeros((len(ids), dims[table]), np.float32), np.zeros(len(ids), bool))
        for (table, sel), reply in zip(plan, replies, strict=True):
            rows, present = out[table]
            hit = [i for i, blob in enumerate(reply) if blob is not None]
            if hit:
                blob = b"".join(reply[i] for i in hit)
                rows[sel[hit]] = np.frombuffer(blob, dtype=dtype).reshape(len(hit), -1)
                present[sel[hit]] = True
        return out

    # -- writing -------------------------------------------------------------------------------------
    def begin(self, meta: ModelVersion) -> VersionWriter:
        check_version_name(meta.version)
        with self.errors():
            taken = self.client.exists(self.key("v", meta.version, "meta")) or self.client.zscore(self.key("versions"), meta.version) is not None
        if taken:
            raise ConfigError(f"{self.url} already has a version {meta.version!r}: publish under a new name")
        return RedisVersionWriter(self, meta)

    # -- live updates --------------------------------------------------------------------------------
    def update_rows(self, version: str, updates: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        meta = self.read_meta(version)
        pipe = self.client.pipeline(transaction=False)
        stream = self.key("v", version, "updates")
        for table, (ids, rows) in updates.items():
            for part, mapping in rows_by_part(ids, rows, meta.row_dtype).items():
                pipe.hset(self.rows_key(version, table, part), mapping=mapping)
            pipe.xadd(stream, {b"t": table.encode(), b"ids": encode_ids(ids)}, maxlen=UPDATES_MAXLEN, approximate=True)
        with self.errors():
            pipe.execute()

    def update_dense(self, version: str, state: dict[str, torch.Tensor]) -> None:
        with self.errors():
            pipe = self.client.pipeline(transaction=True)
            pipe.set(self.key("v", version, "dense"), encode_state(state))
            pipe.xadd(self.key("v", version, "updates"), {b"dense": b"1"}, maxlen=UPDATES_MAXLEN, approximate=True)
            pipe.execute()

    def poll_updates(self, version: str, cursor: str | None) -> UpdateBatch:
        stream = self.key("v", version, "updates")
        with self.errors():
            if cursor is None:
                last = self.client.xrevrange(stream, count=1)
                return UpdateBatch(cursor=last[0][0].decode() if last else "0-0")
            first = self.client.xrange(stream, count=1)
            reset = bool(first) and cursor != "0-0" and _stream_id(first[0][0].decode()) > _stream_id(cursor)
            entries = self.client.xread({stream: cursor}, count=10_000) or []
        batch = UpdateBatch(cursor=cursor, reset=reset)
        rows: dict[str, list[np.ndarray]] = defaultdict(list)
        for _name, items in entries:
            for entry_id, fields in items:
                batch.cursor = entry_id.decode()
                if b"dense" in fields:
                    batch.dense_changed = True
                else:
                    rows[fields[b"t"].decode()].append(decode_ids(fields[b"ids"]))
        batch.rows = {t: np.unique(np.concatenate(v)) for t, v in rows.items()}
        return batch

    def close(self) -> None:
        self.client.close()


def _stream_id(text: str) -> tuple[int, int]:
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)
