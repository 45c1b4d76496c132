"""The stream-source interface: entries delivered at least once, acknowledged after training.

A consumer reads entries, trains on the rows they make, and acknowledges them only once a
checkpoint holds the step that trained on them: an entry read but not acknowledged when the
consumer dies is delivered again to its successor, so every event is trained at least once,
and again only if it came after the last checkpoint. A malformed entry goes to the dead-letter
stream with the reason and its id, and is acknowledged: it never stops the consumer.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    """One stream entry."""

    stream: str
    """The stream it came from."""
    id: str
    """Its id in that stream (Redis: ``<milliseconds>-<sequence>``, ordered)."""
    fields: dict[str, str]
    """Its fields, by name (a row's columns, by the schema's column names)."""

    @cached_property
    def time_ms(self) -> int:
        """When it entered the stream (the id's milliseconds)."""
        return int(self.id.split("-", 1)[0])


class StreamSource(ABC):
    """Entries of one or more streams, read by one consumer of a group."""

    @abstractmethod
    def read(self, count: int, block_s: float, streams: Sequence[str] | None = None) -> list[Entry]:
        """Up to ``count`` entries of each stream (of ``streams``, default all), waiting at most
        ``block_s`` seconds for the first: first those delivered to this consumer before and
        never acknowledged (a restart), then new ones."""

    @abstractmethod
    def ack(self, entries: Sequence[Entry]) -> None:
        """Acknowledge entries: they are never delivered again."""

    @abstractmethod
    def dead_letter(self, entry: Entry, reason: str) -> None:
        """Move a malformed entry to the dead-letter stream (with ``reason`` and its id) and
        acknowledge it."""

    @abstractmethod
    def lag(self) -> int:
        """Entries in the streams not yet delivered to the group."""

    def close(self) -> None:  # noqa: B027 (nothing to release by default)
        """Release connections."""


class RetryingSource(StreamSource):
    """Another source whose calls are retried while it fails (a restarting Redis), for at most
    ``reconnect_s`` seconds per call, then the failure is raised: training outlives a broker
    restart and never waits forever on one that stays down.

    Args:
        inner: the source.
        reconnect_s: how long one call is retried.
        retry_on: the failures retried (the inner source's own, e.g. ``DlrmError``).
    """

    def __init__(
        self,
        inner: StreamSource,
        reconnect_s: float,
        retry_on: tuple[type[Exception], ...],
        sleep=time.sleep,
    ) -> None:
        self.inner, self.reconnect_s, self.retry_on, self.sleep = (
            inner,
            reconnect_s,
            retry_on,
            sleep,
        )
        self.retries = 0

    def _call(self, fn, *args):
        deadline, pause = time.monotonic() + self.reconnect_s, 0.1
        while True:
            try:
                return fn(*args)
            except self.retry_on as exc:
                if time.monotonic() + pause > deadline:
                    raise
                if self.retries == 0 or pause >= 1.0:
                    log.warning("%s; retrying for up to %.0fs", exc, self.reconnect_s)
                self.retries += 1
                self.sleep(pause)
                pause = min(2 * pause, 2.0)

    def read(self, count: int, block_s: float, streams: Sequence[str] | None = None) -> list[Entry]:
        return self._call(self.inner.read, count, block_s, streams)

    def ack(self, entries: Sequence[Entry]) -> None:
        self._call(self.inner.ack, entries)

    def dead_letter(self, entry: Entry, reason: str) -> None:
        self._call(self.inner.dead_letter, entry, reason)

    def lag(self) -> int:
        return self.inner.lag()

    def close(self) -> None:
        self.inner.close()
