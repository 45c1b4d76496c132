"""Training batches from a stream source: entries -> joiner -> the shared featurizer -> a Batch.

Rows are featurized by the same :class:`~dlrm_core.featurize.Featurizer` as every file format
(an impression's fields are its row's columns, by the schema's column names), so a row scores
the same whether it came from a file, a stream or a request. A batch is handed to training once
it has ``batch_size`` rows or its first row has waited ``max_batch_wait_s`` (a quiet stream is
still trained on within about that long). Malformed entries never stop the reader: the joiner's
(no ``impression_id``, a label other than 0/1), the featurizer's (a dense value that is not a
number or out of range, a bad id) and, with ``strict_columns``, a field the schema does not
read, each go to the dead-letter stream with the reason.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from dense_trainer.data.stream.config import StreamConfig
from dense_trainer.data.stream.joiner import IMPRESSION_ID, Joiner, Row
from dense_trainer.data.stream.source import Entry, StreamSource
from dlrm_core.batch import Batch, SparseFeatures
from dlrm_core.errors import ConfigError
from dlrm_core.featurize import LABEL, Featurizer
from dlrm_core.schema import FeatureSpec

IDLE_BLOCK_S = 1.0
"""A read with no row waiting blocks at most this long (stop requests are seen this often)."""


@dataclass
class StreamBatch:
    """Rows of one training step and where they came from."""

    batch: Batch
    entries: list[Entry]
    """The entries the rows came from: acknowledged once a checkpoint holds this step."""
    impression_ids: list[str]
    """One per row, in the batch's order."""
    ready_ms: int
    """When the batch's longest-waiting row got its label (its click, or its window's close),
    in stream time: freshness, event to trained, is the step's end minus this."""


def column_names(spec: FeatureSpec) -> dict[str, str]:
    """Each feature's field name in an entry: its column, by name (a numbered column needs the
    schema's ``columns`` to name it)."""
    out = {}
    for feat in [*spec.dense, *spec.categorical]:
        col = feat.column if feat.column is not None else feat.name
        if isinstance(col, int):
            if not spec.columns or col >= len(spec.columns):
                raise ConfigError(
                    f"feature {feat.name!r}: column {col} is a number; a stream names its fields, "
                    "so the schema needs `columns` (or name the column)"
                )
            col = spec.columns[col]
        out[feat.name] = col
    return out


class TimeMerge:
    """Entries of several streams in time order. An entry is released once every stream has
    been read past its time or has nothing more to give, so the joiner sees impressions and
    clicks in the order they happened even while it reads a backlog (reading both at ``count``
    entries a round, the sparser click stream would run ahead in time). A stream with ``hold``
    entries waiting is not read until the others catch up: memory stays bounded.
    """

    def __init__(self, streams: list[str], hold: int) -> None:
        self.waiting: dict[str, deque[Entry]] = {s: deque() for s in streams}
        self.seen = dict.fromkeys(streams, -1)  # time of the last entry read, per stream
        self.dry = dict.fromkeys(streams, False)  # the last read of it gave nothing
        self.hold = hold

    def wanted(self) -> list[str]:
        """The streams to read now."""
        return [s for s, q in self.waiting.items() if len(q) < self.hold] or list(self.waiting)

    def add(self, read: list[str], entries: list[Entry]) -> list[Entry]:
        """Take what a read of the streams ``read`` gave; return the entries now in order."""
        for e in entries:
            self.waiting[e.stream].append(e)
            self.seen[e.stream] = e.time_ms
        for s in read:
            self.dry[s] = not any(e.stream == s for e in entries)
        mark = min((self.seen[s] for s in self.waiting if not self.dry[s]), default=None)
        out: list[Entry] = []
        while True:
            heads = [(q[0].time_ms, s) for s, q in self.waiting.items() if q]
            if not heads:
                return out
            t, s = min(heads)
            if mark is not None and t > mark:
                return out
            out.append(self.waiting[s].popleft())


class StreamBatches:
    """Args:
    source: the streams (impressions and clicks, one consumer of the job's group).
    spec: the schema (features by column name).
    cfg: the ``[stream]`` settings.
    batch_size: rows per step.
    clock: wall-clock seconds (injectable for tests).
    """

    def __init__(
        self,
        source: StreamSource,
        spec: FeatureSpec,
        cfg: StreamConfig,
        batch_size: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.source, self.spec, self.cfg, self.batch_size = source, spec, cfg, batch_size
        self.clock = clock
        self.joiner = Joiner(cfg.join_window_s, cfg.max_pending)
        self.merge = TimeMerge([cfg.impressions, cfg.clicks], 4 * cfg.read_count)
        self.featurizer = Featurizer(spec, with_label=True)
        self.columns = column_names(spec)
        self.known = {*self.columns.values(), IMPRESSION_ID}
        self.rows: deque[Row] = deque()
        self.dead: Counter[str] = Counter()
        """Dead letters by reason."""
        self.entries_read = 0
        self.last_entry_at = time.monotonic()
        self._flowing = False  # the last read was full (a backlog)

    def next(self, stop: Callable[[], bool]) -> StreamBatch | None:
        """The next batch; None when ``stop()`` holds or the stream stayed idle for
        ``idle_exit_s`` with nothing pending (rows not yet trained on stay unacknowledged: they
        are read again by the next run)."""
        deadline = None
        while True:
            while len(self.rows) < self.batch_size and not stop():
                if self.rows and deadline is None:
                    deadline = time.monotonic() + self.cfg.max_batch_wait_s
                if deadline is not None and time.monotonic() >= deadline:
                    break
                # reading a backlog, look again without waiting: one just drained closes its
                # windows by the clock at once (a trickle's reads wait: no spinning)
                wait = IDLE_BLOCK_S if deadline is None else deadline - time.monotonic()
                self._read(0.001 if self._flowing else max(0.001, wait))
                if not self.rows and self._idle():
                    return None
            if stop() or not self.rows:
                return None
            take = [self.rows.popleft() for _ in range(min(self.batch_size, len(self.rows)))]
            batch = self._featurize(take)
            if batch is not None:
                return batch
            deadline = None  # every row was malformed: read on

    def _read(self, block_s: float) -> None:
        streams = self.merge.wanted()
        got = self.source.read(self.cfg.read_count, block_s, streams)
        self.entries_read += len(got)
        self._flowing = 2 * len(got) >= self.cfg.read_count  # a backlog, not a trickle
        if got:
            self.last_entry_at = time.monotonic()
        entries = self.merge.add(streams, got)
        for i, e in enumerate(entries):
            feedback = e.stream == self.cfg.clicks
            reason = None if feedback else self._unknown_fields(e)
            if reason is None:
                rows, reason = self.joiner.add(e, feedback)
                self.rows.extend(rows)
            if reason is not None:
                self._dead_letter([e], reason)
            if feedback or i % 64 == 63:  # negatives as their windows close, in time order
                self.rows.extend(self.joiner.due())
        self.rows.extend(self.joiner.due())
        if not got:  # a quiet stream closes its windows by the clock (entries carry Redis's)
            self.rows.extend(self.joiner.due(int(self.clock() * 1000)))

    def _idle(self) -> bool:
        idle_s = self.cfg.idle_exit_s
        return bool(idle_s) and (
            time.monotonic() - self.last_entry_at >= idle_s and self.joiner.pending == 0
        )

    def _unknown_fields(self, entry: Entry) -> str | None:
        if not self.cfg.strict_columns or entry.fields.keys() <= self.known:
            return None
        extra = [k for k in entry.fields if k not in self.known]
        return f"unknown column {extra[0]!r}" + (
            f" (and {len(extra) - 1} more)" if extra[1:] else ""
        )

    def _dead_letter(self, entries: list[Entry], reason: str) -> None:
        for e in entries:
            self.source.dead_letter(e, reason)
        self.dead[reason] += 1

    def _featurize(self, rows: list[Row]) -> StreamBatch | None:
        """Rows -> a batch of their valid ones (the others dead-lettered), None if none is."""
        n = len(rows)
        columns = {LABEL: pa.array([str(r.label) for r in rows], pa.string())}
        fields = [r.entries[0].fields for r in rows]  # the impressions' (impression_id unread)
        for name, col in self.columns.items():
            columns[name] = pa.array([f.get(col) for f in fields], pa.string())
        lines = np.arange(1, n + 1, dtype=np.int64)  # row i of the batch is "line" i + 1
        parsed = self.featurizer(columns, n, lines, "stream")
        for bad in parsed.bad:
            row = rows[bad.line - 1]
            self._dead_letter(row.entries, bad.reason)
        if parsed.num_rows == 0:
            return None
        kept = [rows[i - 1] for i in parsed.lines.tolist()]
        dense, ids, offsets = parsed.model_inputs()  # [n, I], ids feature-major, [F*n + 1]
        sparse = SparseFeatures(torch.from_numpy(ids), torch.from_numpy(offsets), len(kept))
        batch = Batch(torch.from_numpy(dense), sparse, torch.from_numpy(parsed.labels))
        entries = [e for r in kept for e in r.entries]
        return StreamBatch(
            batch,
            entries,
            [r.entries[0].fields.get(IMPRESSION_ID, "") for r in kept],
            min(self._ready_ms(r) for r in kept),
        )

    def _ready_ms(self, row: Row) -> int:
        if row.joined_after_ms is not None:
            return row.entries[-1].time_ms  # its click
        return min(row.entries[0].time_ms + int(1000 * self.cfg.join_window_s), self.joiner.now_ms)

    def take_done(self) -> list[Entry]:
        """Entries that made no row (late feedback): acknowledged with the next checkpoint."""
        return self.joiner.take_done()
