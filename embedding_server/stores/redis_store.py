"""``redis://[user:password@]host:port/db`` (``rediss://`` for TLS): the cluster serving store
(HugeCTR's in-memory tier).

Keys (``P`` is the prefix, default ``dlrm``):

    P:current                      name of the current version
    P:versions                     sorted set of complete versions by publish time
    P:incomplete                   set of versions being written; P:writing:<v> is the writer's
    lease
    P:v:<v>:meta                   ModelVersion (JSON)
    P:v:<v>:dense                  dense weights (torch.save bytes, loaded with weights_only)
    P:v:<v>:t:<table>:<block>      string: the rows of one block, as stored (fp32/fp16, or int8/int4
                                   in fbgemm's row-wise layout), back to back (``redis_blocks.py``);
                                   blocks without a published row are not there
    P:v:<v>:idmap:<table>          dynamic tables: int64 [2, n] bytes, admitted ids (sorted) over
                                   their rows (read once per loaded version)
    P:v:<v>:idmap:<table>:over     hash keyed by raw id (8 bytes): the row (8 bytes, -1 evicted) of
                                   each id live updates changed since; folded into the base past
                                   ``view.compact_at(n)`` entries
    P:v:<v>:o:<table>:<block>      dynamic tables: the id each row holds (int64), in blocks like
                                   the rows'; a gather reads a row and its owner in one call
    P:v:<v>:gen                    live updates written to the version so far (its generation)
    P:v:<v>:updates                stream of live updates: {g: generation, t:<table>: int64 ids
                                   bytes, m:<table>: IdMapDelta bytes, ...} or {g, dense: 1}

Lookups of all tables of a request go out in one round trip: read-only ``GATHER`` scripts
(``EVALSHA_RO``) that check the version still exists and ``GETRANGE`` just the rows asked for,
answering with the rows concatenated. Promotion, deletion and live
updates are server-side scripts (``redis_scripts.py``). Every call has a socket timeout: an
unreachable Redis raises :class:`StoreUnavailable` quickly instead of hanging a request. Only
the redacted URL ever appears in a message.

Serving replicas need read commands only (GET, EXISTS, ZRANGE, XREAD, XRANGE, XREVRANGE,
MULTI/EXEC, EVALSHA_RO / EVAL_RO of the read-only gather script): give them an ACL user without
write access (docker/compose.yaml).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import numpy as np
import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

import embedding_server.stores.redis_live as redis_live
from dlrm_core.errors import ConfigError
from dlrm_core.secrets import redact_url, scrub, url_password
from embedding_server.idmap.view import NO_OWNER, IdMapDelta
from embedding_server.stores.base import (
    ServingStore,
    StoreUnavailable,
    UpdateBatch,
    VersionNotFound,
    VersionWriter,
)
from embedding_server.stores.file_store import check_version_name
from embedding_server.stores.redis_idmaps import (
    gather_rows,
    read_id_map,
)
from embedding_server.stores.redis_scripts import (
    COMPACT,
    FORGET,
    GATHER,
    PROMOTE,
    UPDATE_DENSE,
    UPDATE_ROWS,
)
from embedding_server.stores.redis_writer import RedisVersionWriter
from embedding_server.wire import (
    ModelVersion,
    decode_state,
)

log = logging.getLogger(__name__)

BULK_TIMEOUT_S = 30.0
"""Socket timeout of bulk writes (a 4 MB pipeline to a busy server); reads keep the store's own."""

REDIS_ERRORS = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class RedisStore(ServingStore):
    remote = True

    def __init__(
        self,
        url: str,
        keep_versions: int = 3,
        prefix: str = "dlrm",
        timeout_s: float = 1.0,
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
            raise ConfigError(
                f"store URL {self.url}: a password is in the URL and in a password file; give it "
                "once"
            )
        extra = {"password": password} if password is not None else {}
        try:
            # No client-side retries: a failed call fails fast (the API answers 503 at once and
            # the next call reconnects), instead of stalling requests for seconds of backoff.
            # Bulk writes (publishing, live updates, deleting a version) move megabytes per round
            # trip: their own connections wait up to BULK_TIMEOUT_S.
            self.client, self.bulk = (
                redis.Redis.from_url(
                    url,
                    socket_timeout=t,
                    socket_connect_timeout=timeout_s,
                    health_check_interval=30,
                    decode_responses=False,
                    retry=Retry(NoBackoff(), 0),
                    **extra,
                )
                for t in (timeout_s, max(timeout_s, BULK_TIMEOUT_S))
            )
        except (ValueError, TypeError):  # the library's message may quote the password: dropped
            raise ConfigError(
                f"store URL {self.url}: not a valid Redis URL (redis://[user[:pw]@]host:port/db)"
            ) from None
        self._meta_cache: dict[str, ModelVersion] = {}
        self._gather_sha = hashlib.sha1(GATHER.encode()).hexdigest()
        self._scripts = {
            name: client.register_script(src)
            for name, src, client in (
                ("PROMOTE", PROMOTE, self.client),
                ("FORGET", FORGET, self.client),
                ("UPDATE_ROWS", UPDATE_ROWS, self.bulk),
                ("UPDATE_DENSE", UPDATE_DENSE, self.bulk),
                ("COMPACT", COMPACT, self.bulk),
            )
        }

    # -- helpers -----------------------------------------------------------------------------------
    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def rows_key(self, version: str, table: str, block: int | str) -> str:
        return self.key("v", version, "t", table, str(block))

    def owners_key(self, version: str, table: str, block: int | str) -> str:
        return self.key("v", version, "o", table, str(block))

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Turn connection failures into :class:`StoreUnavailable` (messages redacted)."""
        try:
            yield
        except redis.exceptions.AuthenticationError as exc:
            raise StoreUnavailable(
                f"redis store {self.url}: authentication failed ({scrub(str(exc), self._secrets)})"
            ) from None
        except redis.exceptions.NoPermissionError as exc:
            raise StoreUnavailable(
                f"redis store {self.url}: permission denied ({scrub(str(exc), self._secrets)})"
            ) from None
        except REDIS_ERRORS as exc:
            raise StoreUnavailable(
                f"redis store {self.url} unavailable: {scrub(str(exc), self._secrets)}"
            ) from None

    def ping(self) -> None:
        with self.errors():
            self.client.ping()

    def _gone(self, version: str) -> VersionNotFound:
        self._meta_cache.pop(version, None)
        return VersionNotFound(
            f"{self.url} has no version {version!r} (deleted, or never published)", version
        )

    # -- registry ----------------------------------------------------------------------------------
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
                keys=[self.key("current"), self.key("versions"), self.key("v", version, "meta")],
                args=[version],
            )
        if not done:
            raise VersionNotFound(f"{self.url} has no complete version {version!r}", version)

    def delete_version(self, version: str) -> None:
        with self.errors():
            forgotten = self._scripts["FORGET"](
                keys=[
                    self.key("current"),
                    self.key("versions"),
                    self.key("incomplete"),
                    self.key("v", version, "meta"),
                    self.key("v", version, "gen"),
                ],
                args=[version],
            )
        if not forgotten:
            raise ConfigError(
                f"{self.url}: {version!r} is the current version; promote another first"
            )
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

    def make_room(self, needed: int) -> list[str]:
        """Before a version of up to ``needed`` bytes of rows is written: when Redis has a
        ``maxmemory`` they would pass, collect every version but the current one first (under
        noeviction Redis would refuse the writes). -> the versions collected. Nothing is done
        without a maxmemory or without permission to read INFO; a write refused for memory
        still collects them (``RedisVersionWriter._flush``)."""
        try:
            info = self.bulk.info("memory")
        except (redis.exceptions.ResponseError, *REDIS_ERRORS):
            return []
        limit = int(info.get("maxmemory", 0))
        if not limit or int(info["used_memory"]) + needed * 1.05 <= limit:
            return []
        collected = self.collect_garbage(keep=0)
        log.info(
            "redis store %s: collected %s to make room for %d MB of rows",
            self.url,
            collected,
            needed >> 20,
        )
        return collected

    def collect_garbage(self, current: str | None = None, keep: int | None = None) -> list[str]:
        removed = super().collect_garbage(current, keep)
        with self.errors():
            stale = [v.decode() for v in self.client.smembers(self.key("incomplete"))]
            stale = [v for v in stale if not self.client.exists(self.key("writing", v))]
        for v in stale:  # publishers that died mid-write: their lease expired
            self.delete_version(v)
        return removed + stale

    # -- reading -----------------------------------------------------------------------------------
    def read_dense(self, version: str) -> dict[str, torch.Tensor]:
        with self.errors():
            raw = self.client.get(self.key("v", version, "dense"))
        if raw is None:
            raise self._gone(version)
        return decode_state(raw)

    def read_id_map(self, version: str, table: str) -> tuple[np.ndarray, np.ndarray]:
        found = read_id_map(self, version, table)
        if found is None:
            raise self._gone(version)
        return found

    def read_owners(self, version: str, table: str, rows: np.ndarray) -> np.ndarray:
        expect = np.full(len(rows), NO_OWNER, dtype=np.int64)
        return gather_rows(self, version, {table: rows}, {table: expect})[table][2]

    def get_stored_rows_many(
        self, version: str, requests: dict[str, np.ndarray]
    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Rows as stored, of several tables in one round trip: ``GATHER`` calls (GETRANGE of
        just those rows, ``redis_blocks.GATHER_KEYS`` rows a call) in one pipeline.

        Raises:
            VersionNotFound: the version was deleted (each call checks the meta in the script
                that reads the rows: deletion removes the meta first, so rows read while it
                still exists are the version's own, and a missing row is never a deleted one).
        """
        return {
            t: (raw, present)
            for t, (raw, present, _, _) in gather_rows(self, version, requests, {}).items()
        }

    def get_checked_rows_many(
        self, version: str, requests: dict[str, np.ndarray], expect: dict[str, np.ndarray]
    ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Each checked row and its owner in one ``GATHER`` call: read atomically together."""
        out = {}
        for t, (raw, present, owner, want) in gather_rows(self, version, requests, expect).items():
            out[t] = (
                raw,
                present,
                np.ones(len(raw), bool) if owner is None else (want == NO_OWNER) | (owner == want),
            )
        return out

    def _gather(self, calls: list[tuple]) -> list:
        """Run ``GATHER`` calls (numkeys, keys..., args...) in one pipeline (``EVALSHA_RO``);
        a Redis that lacks the script (restarted, flushed) gets its source once (``EVAL_RO``)."""
        with self.errors():
            pipe = self.client.pipeline(transaction=False)
            for call in calls:
                pipe.execute_command("EVALSHA_RO", self._gather_sha, *call)
            try:
                return pipe.execute()
            except redis.exceptions.NoScriptError:
                first = self.client.execute_command("EVAL_RO", GATHER, *calls[0])  # loads it too
                return [first, *self._gather(calls[1:])] if len(calls) > 1 else [first]

    # -- writing -----------------------------------------------------------------------------------
    def begin(self, meta: ModelVersion) -> VersionWriter:
        check_version_name(meta.version)
        with self.errors():
            taken = (
                self.client.exists(self.key("v", meta.version, "meta"))
                or self.client.zscore(self.key("versions"), meta.version) is not None
            )
        if taken:
            raise ConfigError(
                f"{self.url} already has a version {meta.version!r}: publish under a new name"
            )
        return RedisVersionWriter(self, meta)

    # -- live updates (``redis_live.py``) ------------------------------------------------------
    def update_rows(
        self,
        version: str,
        updates: dict[str, tuple[np.ndarray, np.ndarray]],
        id_maps: dict[str, IdMapDelta] | None = None,
    ) -> None:
        redis_live.update_rows(self, version, updates, id_maps)

    def update_dense(self, version: str, state: dict[str, torch.Tensor]) -> None:
        redis_live.update_dense(self, version, state)

    def poll_updates(self, version: str, cursor: str | None) -> UpdateBatch:
        return redis_live.poll_updates(self, version, cursor)

    def close(self) -> None:
        self.client.close()
        self.bulk.close()
