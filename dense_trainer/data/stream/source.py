"""The stream-source interface: entries delivered at least once, acknowledged after training.

A consumer reads entries, trains on the rows they make, and acknowledges them only once a
checkpoint holds the step that trained on them: an entry read but not acknowledged when the
consumer dies is delivered again to its successor, so every event is trained at least once,
and again only if it came after the last checkpoint. A malformed entry goes to the dead-letter
stream with the reason and its id, and is acknowledged: it never stops the consumer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    """One stream entry."""

    stream: str
    """The stream it came from."""
    id: str
    """Its id in that stream (Redis: ``<milliseconds>-<sequence>``, ordered)."""
    fields: dict[str, str]
    """Its fields, by name (a row's columns, by the schema's column names)."""

    @property
    def time_ms(self) -> int:
        """When it entered the stream (the id's milliseconds)."""
        return int(self.id.split("-", 1)[0])


class StreamSource(ABC):
    """Entries of one or more streams, read by one consumer of a group."""

    @abstractmethod
    def read(self, count: int, block_s: float) -> list[Entry]:
        """Up to ``count`` entries, waiting at most ``block_s`` seconds for the first: first
        those delivered to this consumer before and never acknowledged (a restart), then new
        ones."""

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
