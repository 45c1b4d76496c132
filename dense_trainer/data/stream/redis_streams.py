"""Redis Streams as a :class:`StreamSource`: one consumer group per training job.

Each trainer is a consumer of the group (its name: the job's, plus its rank), so trainers share
the streams: Redis delivers each entry to one of them. An entry stays in the consumer's pending
list until :meth:`RedisStreamSource.ack`; a consumer that restarts under the same name reads its
pending entries again first (``XREADGROUP ... 0``), then new ones (``>``). Every call waits at
most the connection's timeout plus the read's own block: a Redis that hangs ends in an error
naming it, never a hang. The URL's password (or ``password``) is never shown: messages name the
URL redacted.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from dense_trainer.data.stream.source import Entry, StreamSource
from dlrm_core.errors import ConfigError, DlrmError
from dlrm_core.secrets import redact_url, scrub, url_password

DEAD_SUFFIX = ":dead"
"""The dead-letter stream of ``S`` is ``S:dead``."""
DEAD_MAXLEN = 100_000
"""Dead letters kept per stream (the oldest trimmed, approximately)."""


class RedisStreamSource(StreamSource):
    """Args:
    url: ``redis://[user[:password]@]host:port/db`` (or ``rediss://``).
    streams: the streams to read (e.g. impressions and clicks).
    group: the consumer group (created at the streams' start if missing).
    consumer: this reader's name in the group (stable across restarts).
    timeout_s: bound of every call beyond its own block.
    """

    def __init__(
        self,
        url: str,
        streams: Sequence[str],
        group: str,
        consumer: str,
        timeout_s: float = 5.0,
        password: str | None = None,
        max_block_s: float = 2.0,
    ) -> None:
        self.url, self.streams = redact_url(url), list(streams)
        self.group, self.consumer, self.max_block_s = group, consumer, max_block_s
        self._secrets = [url_password(url), password]
        extra = {"password": password} if password is not None else {}
        try:  # reads wait up to their block, then the same bound as every other call
            self.client, self._reader = (
                redis.Redis.from_url(
                    url,
                    socket_timeout=t,
                    socket_connect_timeout=timeout_s,
                    decode_responses=True,
                    **extra,
                )
                for t in (timeout_s, timeout_s + max_block_s)
            )
        except (ValueError, TypeError):
            raise ConfigError(f"stream URL {self.url}: not a valid Redis URL") from None
        # per stream: where our own pending entries (delivered before, never acknowledged) are
        # read from next, or None once they are all read again (then new entries, ">")
        self._history: dict[str, str | None] = {s: "0" for s in self.streams}
        with self._errors("create the consumer group"):
            for s in self.streams:
                try:
                    self.client.xgroup_create(s, group, id="0", mkstream=True)
                except redis.ResponseError as exc:
                    if "BUSYGROUP" not in str(exc):
                        raise

    def _errors(self, what: str) -> RedisErrors:
        return RedisErrors(self.url, self._secrets, what)

    def read(self, count: int, block_s: float, streams: Sequence[str] | None = None) -> list[Entry]:
        chosen = self.streams if streams is None else [s for s in self.streams if s in streams]
        for _ in range(2):  # once more when our own pending entries ran out
            ids = {s: self._history[s] or ">" for s in chosen}
            history = [s for s in chosen if self._history[s] is not None]
            block = None if history else max(1, int(min(block_s, self.max_block_s) * 1000))
            with self._errors("read"):
                answer = self._reader.xreadgroup(
                    self.group, self.consumer, ids, count=count, block=block
                )
            out = [
                Entry(stream, entry_id, fields or {})
                for stream, entries in answer or []
                for entry_id, fields in entries
            ]
            for s in history:
                mine = [e.id for e in out if e.stream == s]
                self._history[s] = mine[-1] if mine else None  # none left: new entries
            if out or not history:
                return out
        return []

    def ack(self, entries: Sequence[Entry]) -> None:
        by_stream: dict[str, list[str]] = {}
        for e in entries:
            by_stream.setdefault(e.stream, []).append(e.id)
        if not by_stream:
            return
        with self._errors("acknowledge"):
            pipe = self.client.pipeline(transaction=False)
            for stream, ids in by_stream.items():
                pipe.xack(stream, self.group, *ids)
            pipe.execute()

    def dead_letter(self, entry: Entry, reason: str) -> None:
        fields = {"entry": entry.id, "reason": reason, **entry.fields}
        with self._errors("write a dead letter"):
            pipe = self.client.pipeline(transaction=True)
            pipe.xadd(entry.stream + DEAD_SUFFIX, fields, maxlen=DEAD_MAXLEN, approximate=True)
            pipe.xack(entry.stream, self.group, entry.id)
            pipe.execute()

    def lag(self) -> int:
        total = 0
        with self._errors("read the group's lag"):
            for s in self.streams:
                for g in self.client.xinfo_groups(s):
                    if g["name"] == self.group:
                        total += int(g.get("lag") or 0)
        return total

    def close(self) -> None:
        self.client.close()


class RedisErrors:
    """Turns a Redis failure into one line naming the URL (redacted) and what was being done.

    Args:
        url: the URL, already redacted.
        secrets: passwords scrubbed from the failure's own text.
        what: what was being done ("read", "publish the rows", ...).
    """

    def __init__(self, url: str, secrets: Sequence[str | None], what: str) -> None:
        self.url, self.secrets, self.what = url, secrets, what

    def __enter__(self) -> RedisErrors:
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or not isinstance(exc, redis.RedisError):
            return False
        detail = scrub(str(exc), self.secrets)
        raise DlrmError(
            f"stream {self.url}: could not {self.what} ({type(exc).__name__}: {detail})"
        ) from None
