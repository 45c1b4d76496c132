"""``redis://[user:password@]host:port/db`` (``rediss://`` for TLS): the cluster serving store
(HugeCTR's in-memory tier).

Keys (``P`` is the prefix, default ``dlrm``):

    P:current                      name of the current version
    P:versions                     sorted set of complete versions by publish time
    P:incomplete                   set of versions being written; P:writing:<v> is the writer's lease
    P:v:<v>:meta                   ModelVersion (JSON)
    P:v:<v>:dense                  dense weights (torch.save bytes, loaded with weights_only)
    P:v:<v>:t:<table>:<part>       hash: row id (decimal) -> row bytes (fp32/fp16, or int8/int4 in
                                   fbgemm's row-wise layout), 1M rows a part
    P:v:<v>:idmap:<table>          dynamic tables: int64 [2, n] bytes, admitted ids (sorted) over
                                   their rows (read once per loaded version)
    P:v:<v>:gen                    live updates written to the version so far (its generation)
    P:v:<v>:updates                stream of live updates: {g: generation, t:<table>: int64 ids
                                   bytes, ...} or {g, dense: 1}

Lookups of all tables of a request go out as one pipeline of HMGETs (one round trip) that ends
by checking the version still exists; hiredis parses the replies. Promotion, deletion and live
updates are server-side scripts (``redis_scripts.py``). Every call has a socket timeout: an
unreachable Redis raises :class:`StoreUnavailable` quickly instead of hanging a request. Only
the redacted URL ever appears in a message.

Serving replicas need read commands only (GET, HMGET, EXISTS, ZRANGE, XREAD, XRANGE,
XREVRANGE, MULTI/EXEC): give them an ACL user without write access (docker/compose.yaml).
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
from dlrm_core.secrets import redact_url, scrub, url_password
from embedding_server.stores.base import (
    ServingStore,
    StoreUnavailable,
    UpdateBatch,
    VersionNotFound,
    VersionWriter,
)
from embedding_server.stores.file_store import check_version_name
from embedding_server.stores.redis_scripts import FORGET, PROMOTE, UPDATE_DENSE, UPDATE_ROWS
from embedding_server.wire import (
    NUMPY_DTYPE,
    ModelVersion,
    decode_ids,
    decode_state,
    encode_ids,
    encode_rows,
    encode_state,
    row_bytes,
    row_width,
)

log = logging.getLogger(__name__)

PART_BITS = 20
"""Rows per hash key: 2^20 (bounds the size of any one key)."""
PIPELINE_BYTES = 4 << 20
"""Flush a write pipeline after this many bytes of rows (bounds publisher memory)."""
LEASE_S = 600
BULK_TIMEOUT_S = 30.0
"""Socket timeout of bulk writes (a 4 MB pipeline to a busy server); reads keep the store's own."""
UPDATES_MAXLEN = 20_000
"""Live-update stream entries kept; a reader further behind reloads its version."""

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
        self._pipe = store.bulk.pipeline(transaction=False)
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
        self._bytes += rows.shape[0] * row_bytes(rows.shape[1], self.meta.row_dtype)
        if self._bytes >= PIPELINE_BYTES:
            self._flush()

    def write_dense(self, state: dict[str, torch.Tensor]) -> None:
        self._pipe.set(self.store.key("v", self.meta.version, "dense"), encode_state(state))

    def write_id_map(self, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        pair = np.stack([ids, rows]).astype("<i8")
        self._pipe.set(self.store.key("v", self.meta.version, "idmap", table), pair.tobytes())

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
        self, url: str, keep_versions: int = 3, prefix: str = "dlrm", timeout_s: float = 1.0,
        password: str | None = None,
    ) -> None:
        super().__init__(keep_versions)
        # An optional ?prefix=NAME keeps several models (or tests) apart in one database.
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        prefix = query.pop("prefix", [prefix])[0]
        url = urlunsplit(parts._replace(query=urlencode(query, doseq=True)))
        self.url = redact_url(url)
        self.prefix = prefix
        self._secrets = [url_password(url), password]
        if password is not None and url_password(url):
            raise ConfigError(f"store URL {self.url}: a password is in the URL and in a password file; give it once")
        extra = {"password": password} if password is not None else {}
        try:
            # No client-side retries: a failed call fails fast (the API answers 503 at once and
            # the next call reconnects), instead of stalling requests for seconds of backoff.
            # Bulk writes (publishing, live updates, deleting a version) move megabytes per round
            # trip: their own connections wait up to BULK_TIMEOUT_S.
            self.client, self.bulk = (redis.Redis.from_url(
                url, socket_timeout=t, socket_connect_timeout=timeout_s,
                health_check_interval=30, decode_responses=False, retry=Retry(NoBackoff(), 0), **extra,
            ) for t in (timeout_s, max(timeout_s, BULK_TIMEOUT_S)))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"store URL {self.url}: {scrub(str(exc), self._secrets)}") from None
        self._meta_cache: dict[str, ModelVersion] = {}
        self._scripts = {name: client.register_script(src) for name, src, client in (
            ("PROMOTE", PROMOTE, self.client), ("FORGET", FORGET, self.client),
            ("UPDATE_ROWS", UPDATE_ROWS, self.bulk), ("UPDATE_DENSE", UPDATE_DENSE, self.bulk))}

    # -- helpers ------------------------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def rows_key(self, version: str, table: str, part: int) -> str:
        return self.key("v", version, "t", table, str(part))

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Turn connection failures into :class:`StoreUnavailable` (messages redacted)."""
        try:
            yield
        except redis.exceptions.AuthenticationError as exc:
            raise StoreUnavailable(f"redis store {self.url}: authentication failed "
                                   f"({scrub(str(exc), self._secrets)})") from None
        except redis.exceptions.NoPermissionError as exc:
            raise StoreUnavailable(f"redis store {self.url}: permission denied "
                                   f"({scrub(str(exc), self._secrets)})") from None
        except REDIS_ERRORS as exc:
            raise StoreUnavailable(f"redis store {self.url} unavailable: {scrub(str(exc), self._secrets)}") from None

    def ping(self) -> None:
        with self.errors():
            self.client.ping()

    def _gone(self, version: str) -> VersionNotFound:
        self._meta_cache.pop(version, None)
        return VersionNotFound(f"{self.url} has no version {version!r} (deleted, or never published)", version)

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
            raise self._gone(version)
        meta = ModelVersion.model_validate_json(raw)
        self._meta_cache[version] = meta
        return meta

    def list_versions(self) -> list[str]:
        with self.errors():
            return [v.decode() for v in self.client.zrange(self.key("versions"), 0, -1)]

    def exists(self, version: str) -> bool:
        with self.errors():
            pipe = self.client.pipeline(transaction=True)
            pipe.zscore(self.key("versions"), version)
            pipe.exists(self.key("v", version, "meta"))
            score, meta = pipe.execute()
        return score is not None and bool(meta)

    def promote(self, version: str) -> None:
        check_version_name(version)
        with self.errors():
            done = self._scripts["PROMOTE"](
                keys=[self.key("current"), self.key("versions"), self.key("v", version, "meta")], args=[version])
        if not done:
            raise VersionNotFound(f"{self.url} has no complete version {version!r}", version)

    def delete_version(self, version: str) -> None:
        with self.errors():
            forgotten = self._scripts["FORGET"](
                keys=[self.key("current"), self.key("versions"), self.key("incomplete"),
                      self.key("v", version, "meta"), self.key("v", version, "gen")], args=[version])
        if not forgotten:
            raise ConfigError(f"{self.url}: {version!r} is the current version; promote another first")
        self._meta_cache.pop(version, None)
        with self.errors():  # gone for everyone already; now the bulk of its keys
            batch = []
            for key in self.bulk.scan_iter(match=self.key("v", version, "*"), count=1000):
                batch.append(key)
                if len(batch) >= 500:
                    self.bulk.unlink(*batch)
                    batch = []
            if batch:
                self.bulk.unlink(*batch)

    def collect_garbage(self, current: str | None = None, keep: int | None = None) -> list[str]:
        removed = super().collect_garbage(current, keep)
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
            raise self._gone(version)
        return decode_state(raw)

    def read_id_map(self, version: str, table: str) -> tuple[np.ndarray, np.ndarray]:
        with self.errors():
            raw = self.client.get(self.key("v", version, "idmap", table))
        if raw is None:
            raise self._gone(version)
        pair = np.frombuffer(raw, dtype="<i8").reshape(2, -1).astype(np.int64)
        return pair[0], pair[1]

    def get_stored_rows_many(
        self, version: str, requests: dict[str, np.ndarray]
    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Rows as stored, of several tables in one pipelined round trip.

        Raises:
            VersionNotFound: the version was deleted (checked after the reads, in the same
                round trip: deletion removes the meta first, so rows read while it still
                exists are the version's own, and a missing row is never a deleted one).
        """
        meta = self.read_meta(version)
        widths = {t.name: row_width(t.dim, meta.row_dtype) for t in meta.spec.tables}
        pipe = self.client.pipeline(transaction=False)
        plan = []
        for table, ids in requests.items():
            parts = ids >> PART_BITS
            for part in np.unique(parts):
                sel = np.flatnonzero(parts == part)
                pipe.hmget(self.rows_key(version, table, int(part)), [b"%d" % i for i in ids[sel]])
                plan.append((table, sel))
        pipe.exists(self.key("v", version, "meta"))
        with self.errors():
            *replies, alive = pipe.execute()
        if not alive:
            raise self._gone(version)
        out = {}
        dtype = NUMPY_DTYPE[meta.row_dtype]
        for table, ids in requests.items():
            out[table] = (np.zeros((len(ids), widths[table]), dtype), np.zeros(len(ids), bool))
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
    def _live_keys(self, version: str) -> list[str]:
        return [self.key("v", version, "meta"), self.key("v", version, "gen"), self.key("v", version, "updates")]

    def update_rows(self, version: str, updates: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
        """One generation: every table's rows and the stream entry naming them, atomically, and
        only while the version exists (never recreating keys of a deleted one)."""
        meta = self.read_meta(version)
        entry = [item for table, (ids, _) in updates.items() for item in (f"t:{table}".encode(), encode_ids(ids))]
        keys, args = self._live_keys(version), [UPDATES_MAXLEN, len(entry) // 2, *entry]
        for table, (ids, rows) in updates.items():
            for part, mapping in rows_by_part(ids, rows, meta.row_dtype).items():
                keys.append(self.rows_key(version, table, part))
                args.append(len(mapping))
                args.extend(item for pair in mapping.items() for item in pair)
        with self.errors():
            generation = self._scripts["UPDATE_ROWS"](keys=keys, args=args)
        if generation < 0:
            raise self._gone(version)

    def update_dense(self, version: str, state: dict[str, torch.Tensor]) -> None:
        with self.errors():
            generation = self._scripts["UPDATE_DENSE"](
                keys=[*self._live_keys(version), self.key("v", version, "dense")],
                args=[UPDATES_MAXLEN, encode_state(state)])
        if generation < 0:
            raise self._gone(version)

    def poll_updates(self, version: str, cursor: str | None) -> UpdateBatch:
        """Cursor ``"<generation>:<stream id>"``. Entries carry their generation, so a gap (the
        stream was trimmed past entries this reader had not seen) is noticed: ``lost``."""
        meta_key, gen_key, stream = self._live_keys(version)
        seen, _, after = (cursor or "0:0-0").partition(":")
        with self.errors():
            pipe = self.client.pipeline(transaction=True)
            pipe.exists(meta_key)
            pipe.get(gen_key)
            if cursor is None:
                pipe.xrevrange(stream, count=1)
            else:
                pipe.xread({stream: after}, count=10_000)
            alive, generation, entries = pipe.execute()
        if not alive:
            raise self._gone(version)
        generation = int(generation or 0)
        if cursor is None:
            last = entries[0][0].decode() if entries else "0-0"
            return UpdateBatch(cursor=f"{generation}:{last}", generation=generation)
        return _batch(entries, int(seen), after, generation)

    def close(self) -> None:
        self.client.close()
        self.bulk.close()


def _batch(entries, seen: int, after: str, generation: int) -> UpdateBatch:
    """Stream entries after generation ``seen`` -> what changed, or ``lost`` on a gap."""
    items = [item for _name, stream_items in (entries or []) for item in stream_items]
    batch = UpdateBatch(cursor=f"{seen}:{after}", generation=seen)
    rows: dict[str, list[np.ndarray]] = defaultdict(list)
    for entry_id, fields in items:
        g = int(fields.get(b"g", -1))
        if g != batch.generation + 1:  # a gap, or an entry without a generation
            return UpdateBatch(cursor=f"{generation}:{items[-1][0].decode()}", generation=generation, lost=True)
        batch.generation, batch.cursor = g, f"{g}:{entry_id.decode()}"
        if batch.written_at is None:  # a stream id starts with the server's time in ms
            batch.written_at = int(entry_id.split(b"-")[0]) / 1000
        for name, value in fields.items():
            if name == b"dense":
                batch.dense_changed = True
            elif name.startswith(b"t:"):
                rows[name[2:].decode()].append(decode_ids(value))
    if not items and generation > seen:  # every entry after ours was trimmed
        return UpdateBatch(cursor=f"{generation}:{after}", generation=generation, lost=True)
    batch.rows = {t: np.unique(np.concatenate(v)) for t, v in rows.items()}
    return batch
