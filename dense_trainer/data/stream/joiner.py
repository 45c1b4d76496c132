"""The online joiner: impressions and their feedback, on two streams, made into labelled rows.

An impression (its features and an ``impression_id``) waits for its feedback (the same
``impression_id`` and a ``label``, 1 for a click). Its row is emitted

    - as soon as its feedback arrives, with the feedback's label;
    - as a negative when its window closes (``window_s`` after it entered its stream) without
      any feedback;
    - as a negative at once, the oldest first, when more than ``max_pending`` impressions wait
      (counted: ``evicted``): memory stays bounded whatever the click delay.

Feedback that arrives before its impression waits for it as long (same window, same bound).
Feedback for an impression already emitted, or never seen within the window, is ``late``:
counted, never trained on, acknowledged with the next rows. Time is the streams' own: an entry's
time is its id's milliseconds, so a replay joins as the live stream did. Malformed entries (no
``impression_id``, a label other than 0/1) are returned apart, with the reason, for the dead
letters.

Each row carries the entries it came from, to be acknowledged once a checkpoint holds the step
that trained on it; ``done`` entries (late feedback) carry no row.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from dense_trainer.data.stream.source import Entry

IMPRESSION_ID = "impression_id"
LABEL = "label"


@dataclass
class Row:
    """A labelled training row and the entries it came from."""

    label: int
    entries: list[Entry]
    """The impression first, then its feedback (if any)."""
    joined_after_ms: int | None = None
    """How long after the impression its feedback came (None: a negative by window or bound)."""

    @property
    def fields(self) -> dict[str, str]:
        """The impression's fields, by column name (without ``impression_id``)."""
        return {k: v for k, v in self.entries[0].fields.items() if k != IMPRESSION_ID}


@dataclass
class JoinStats:
    """What the joiner did (the ``dlrm_join_*`` metrics)."""

    impressions: int = 0
    feedback: int = 0
    joined: int = 0
    """Rows labelled by their feedback."""
    expired: int = 0
    """Negatives: the window closed without feedback."""
    evicted: int = 0
    """Negatives emitted early: over ``max_pending``."""
    late: int = 0
    """Feedback after its impression's row was emitted (or for an impression never seen)."""
    malformed: int = 0


@dataclass
class Joiner:
    """Args:
    window_s: how long an impression waits for its feedback.
    max_pending: impressions (and early feedback) held at most.
    """

    window_s: float = 60.0
    max_pending: int = 1_000_000
    stats: JoinStats = field(default_factory=JoinStats)
    _impressions: OrderedDict = field(default_factory=OrderedDict)  # id -> Entry, oldest first
    _early: OrderedDict = field(default_factory=OrderedDict)  # id -> feedback Entry
    _done: list = field(default_factory=list)  # entries to acknowledge without a row
    _now_ms: int = 0

    @property
    def now_ms(self) -> int:
        """The joiner's time: the latest entry's, or the clock's when the stream was quiet."""
        return self._now_ms

    @property
    def pending(self) -> int:
        return len(self._impressions)

    def add(self, entry: Entry, feedback: bool) -> tuple[list[Row], str | None]:
        """Take one entry (of the feedback stream when ``feedback``); return the rows it completes
        and, for a malformed entry, the reason (the caller dead-letters it)."""
        self._now_ms = max(self._now_ms, entry.time_ms)
        key = entry.fields.get(IMPRESSION_ID)
        if not key:
            self.stats.malformed += 1
            return [], f"no {IMPRESSION_ID}"
        if feedback:
            label = entry.fields.get(LABEL)
            if label not in ("0", "1"):
                self.stats.malformed += 1
                return [], f"{LABEL} {label!r}: expected 0 or 1"
            self.stats.feedback += 1
            return self._feedback(key, entry, int(label)), None
        self.stats.impressions += 1
        if key in self._impressions:
            self.stats.malformed += 1
            return [], f"{IMPRESSION_ID} {key!r} is already waiting"
        early = self._early.pop(key, None)
        if early is not None:
            return [self._joined(entry, early, int(early.fields[LABEL]))], None
        self._impressions[key] = entry
        return self._over_bound(), None

    def _feedback(self, key: str, entry: Entry, label: int) -> list[Row]:
        imp = self._impressions.pop(key, None)
        if imp is not None:
            return [self._joined(imp, entry, label)]
        if entry.time_ms < self._now_ms - 1000 * self.window_s:
            self.stats.late += 1  # its impression's window has closed
            self._done.append(entry)
            return []
        self._early[key] = entry  # before its impression (or after its row: found late)
        return self._over_bound()

    def _joined(self, imp: Entry, fb: Entry, label: int) -> Row:
        self.stats.joined += 1
        return Row(label, [imp, fb], max(0, fb.time_ms - imp.time_ms))

    def _over_bound(self) -> list[Row]:
        rows = []
        while len(self._impressions) > self.max_pending:
            _, imp = self._impressions.popitem(last=False)
            self.stats.evicted += 1
            rows.append(Row(0, [imp]))
        while len(self._early) > self.max_pending:
            _, fb = self._early.popitem(last=False)
            self.stats.late += 1
            self._done.append(fb)
        return rows

    def due(self, now_ms: int | None = None) -> list[Row]:
        """Negatives of the impressions whose window closed by ``now_ms`` (default: the latest
        entry's time); early feedback whose impression never came is counted late."""
        if now_ms is not None:
            self._now_ms = max(self._now_ms, now_ms)
        limit = self._now_ms - 1000 * self.window_s
        rows = []
        while self._impressions:
            key, imp = next(iter(self._impressions.items()))
            if imp.time_ms > limit:
                break
            del self._impressions[key]
            self.stats.expired += 1
            rows.append(Row(0, [imp]))
        while self._early and next(iter(self._early.values())).time_ms <= limit:
            _, fb = self._early.popitem(last=False)
            self.stats.late += 1
            self._done.append(fb)
        return rows

    def take_done(self) -> list[Entry]:
        """Entries that make no row (late feedback): acknowledged with the next checkpoint."""
        done, self._done = self._done, []
        return done

    def held(self) -> list[Entry]:
        """Entries read but in no row yet (a checkpoint must not acknowledge them)."""
        return [*self._impressions.values(), *self._early.values()]
