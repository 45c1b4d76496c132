"""Background loading: read blocks, parse them on worker threads, batch, prefetch.

    reader thread: file blocks (``dlrm_core.formats``: any input format, on its block grid)
                   -> parse jobs (``num_workers`` threads, results kept in order)
                   -> batches of exactly B rows -> queue of ``prefetch_batches``
    training loop: takes ready batches from the queue

pyarrow and numpy release the GIL while they parse, so threads overlap with each other and
with the training step. Batch composition does not depend on the number of workers, and every
batch carries the :class:`Position` after it, so that a resumed run reads exactly what an
uninterrupted one would.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from dense_trainer.data.elastic import Consumed
from dense_trainer.data.split import RowSplit
from dlrm_core.batch import Batch, Position, SparseFeatures
from dlrm_core.errors import DataError
from dlrm_core.featurize import BadLine, ParsedBlock
from dlrm_core.formats import InputReader
from dlrm_core.formats.base import BadLineLog
from dlrm_core.schema import FeatureSpec

log = logging.getLogger(__name__)

_END = object()


@dataclass
class _Block:
    parsed: ParsedBlock
    file_index: int
    offset: int
    line: int
    number: int = 0  # the block's number in the epoch
    cursor: int = 0  # rows already put into batches
    cum: np.ndarray | None = None  # multi-hot: int64 [F, n + 1] bag offsets
    bad_reported: bool = False


@dataclass
class LoaderStats:
    rows: int = 0
    """Valid rows parsed."""
    bytes: int = 0
    """Bytes of text parsed."""
    parse_seconds: float = 0.0
    """Seconds spent parsing, summed over worker threads."""

    @property
    def parse_rows_per_s(self) -> float:
        """Parse throughput of one worker thread."""
        return self.rows / self.parse_seconds if self.parse_seconds else 0.0


class BatchLoader:
    """Iterates batches over the input files of a feature spec, for one or more epochs, from a
    position.

    Args:
        files: input files (text plain or gzip, or Parquet), read in order.
        spec: the feature spec (format, columns, features, table rows for hashing).
        batch_size: B; the last batch of an epoch may be smaller.
        num_workers: parser threads (0: parse on the reader thread).
        block_bytes: text per parse job.
        prefetch_batches: ready batches kept ahead of the consumer.
        strict: raise at the first malformed line instead of skipping it.
        epochs: passes over ``files``.
        start: where to start (a checkpoint's position); default the beginning.
        max_rows: stop after this many rows (0: no limit).
        pin_memory: pin batch tensors (for copies to CUDA).
        part / parts: read only the blocks whose number is ``part`` modulo ``parts`` (trainer
            ``part`` of ``parts``: together they parse every row once); the others are skipped
            unparsed.
        consumed: rows earlier runs with other numbers of trainers read (an elastic restart):
            skipped.
        split: keep only one side of the validation split (``data/split.py``; None: every
            row). Positions and ``max_rows`` count the rows kept.
    """

    def __init__(
        self,
        files: list[Path],
        spec: FeatureSpec,
        batch_size: int,
        num_workers: int = 2,
        block_bytes: int = 4 << 20,
        prefetch_batches: int = 8,
        strict: bool = False,
        epochs: int = 1,
        start: Position | None = None,
        max_rows: int = 0,
        pin_memory: bool = False,
        part: int = 0,
        parts: int = 1,
        consumed: Consumed | None = None,
        split: RowSplit | None = None,
    ) -> None:
        self.files = [Path(f) for f in files]
        self.spec = spec
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.block_bytes = block_bytes
        self.prefetch_batches = prefetch_batches
        self.epochs = epochs
        self.start = start or Position()
        self.max_rows = max_rows
        self.pin_memory = pin_memory
        self.part, self.parts = part, parts
        self.consumed = consumed
        self.split = split
        self.bad_lines = BadLineLog(strict)
        self.stats = LoaderStats()
        self._reader = InputReader(spec, self.files)
        self._checked = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- consumer side ------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Batch]:
        if self._thread is not None:
            raise RuntimeError("a BatchLoader is iterated once; make a new one")
        q: queue.Queue = queue.Queue(maxsize=self.prefetch_batches)
        self._thread = threading.Thread(
            target=self._run, args=(q,), name="criteo-loader", daemon=True
        )
        self._thread.start()
        try:
            while True:
                item = q.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                batch, bad = item
                self.bad_lines.add(bad)  # strict mode raises here, before the batch is used
                if batch is not None:
                    yield batch
        finally:
            self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    # -- reader thread ------------------------------------------------------------------------

    def _put(self, q: queue.Queue, item) -> bool:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, q: queue.Queue) -> None:
        pool = ThreadPoolExecutor(self.num_workers) if self.num_workers > 0 else None
        try:
            for batch in self._batches(pool):
                if not self._put(q, batch):
                    return
            self._put(q, _END)
        except BaseException as exc:  # handed to the consumer, which raises it
            self._put(q, exc)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def _parsed_blocks(self, pool: ThreadPoolExecutor | None, epoch: int) -> Iterator[_Block]:
        """Parsed blocks of one epoch, in file order, parsing up to 2 x workers ahead."""
        resume = self.start if epoch == self.start.epoch else Position(epoch=epoch)
        in_flight: deque[tuple[Future | ParsedBlock, int, int, int, float, int]] = deque()
        max_in_flight = max(1, 2 * self.num_workers)
        first = True
        number = resume.block
        for fi in range(resume.file_index, len(self.files)):
            offset, line = (resume.block_offset, resume.block_line) if first else (0, 1)
            first = False
            for raw in self._reader.blocks(fi, self.block_bytes, offset, line):
                if self._stop.is_set():
                    return
                number += 1
                if (number - 1) % self.parts != self.part:
                    continue  # another trainer's block
                if self._consumed_rows(epoch, number - 1) is None:
                    continue  # read by an earlier run (elastic restart)
                job = pool.submit(self._timed_parse, raw) if pool else self._timed_parse(raw)
                in_flight.append(
                    (job, raw.file_index, raw.offset, raw.line, len(raw.data), number - 1)
                )
                while len(in_flight) >= max_in_flight:
                    yield self._finish(in_flight.popleft())
        while in_flight:
            yield self._finish(in_flight.popleft())

    def _consumed_rows(self, epoch: int, block: int) -> int | None:
        if self.consumed is None or epoch != self.consumed.epoch:
            return 0
        return self.consumed.rows(block)

    def _timed_parse(self, raw) -> tuple[ParsedBlock, float]:
        t0 = time.perf_counter()
        parsed = self._reader.parse(raw)
        return parsed, time.perf_counter() - t0

    def _finish(self, item) -> _Block:
        job, fi, offset, line, nbytes, number = item
        parsed, seconds = job.result() if isinstance(job, Future) else job
        self.stats.rows += parsed.num_rows
        self.stats.bytes += nbytes
        self.stats.parse_seconds += seconds
        self._check_schema(parsed)  # on all of the block's rows, before a split keeps some
        if self.split is not None:
            rows = self._reader.row_numbers(fi, parsed.lines)
            parsed = parsed.select(self.split.keep(fi, rows))
            if not self.split.reports_bad_lines:
                parsed = replace(parsed, bad=[])
        block = _Block(parsed, fi, offset, line, number)
        if parsed.values is not None:
            block.cum = np.zeros((len(parsed.values), parsed.num_rows + 1), dtype=np.int64)
            np.cumsum(parsed.lengths, axis=1, out=block.cum[:, 1:])
        return block

    @staticmethod
    def _as_bags(block: _Block) -> None:
        """A one-hot block in the multi-hot layout (when a batch mixes the two)."""
        parsed = block.parsed
        if parsed.values is not None:
            return
        n = parsed.num_rows
        parsed.values = list(parsed.ids)
        parsed.lengths = np.ones((parsed.ids.shape[0], n), dtype=np.int32)
        block.cum = np.tile(np.arange(n + 1, dtype=np.int64), (parsed.ids.shape[0], 1))

    def _batches(
        self, pool: ThreadPoolExecutor | None
    ) -> Iterator[tuple[Batch | None, list[BadLine]]]:
        emitted = 0
        for epoch in range(self.start.epoch, self.epochs):
            pending: deque[_Block] = deque()
            have = 0
            resuming = epoch == self.start.epoch and self.start != Position(epoch=epoch)
            for block in self._parsed_blocks(pool, epoch):
                if resuming:  # rows (and bad lines) of this block before the position were consumed
                    block.cursor = min(self.start.rows_into_block, block.parsed.num_rows)
                    block.bad_reported = True
                    resuming = False
                if done := self._consumed_rows(epoch, block.number):
                    block.cursor = max(block.cursor, min(done, block.parsed.num_rows))
                    block.bad_reported = True
                pending.append(block)
                have += block.parsed.num_rows - block.cursor
                while have >= self.batch_size or (
                    self.max_rows and emitted + have >= self.max_rows
                ):
                    size = self.batch_size
                    if self.max_rows:
                        size = min(size, self.max_rows - emitted)
                    if size <= 0:
                        return
                    yield self._take(pending, size, epoch)
                    have -= size
                    emitted += size
                    if self.max_rows and emitted >= self.max_rows:
                        return
            if have > 0:
                yield self._take(pending, have, epoch)
                emitted += have
            # Bad lines of trailing blocks that had no valid rows: reported without a batch.
            tail = [b for block in pending for b in self._unreported(block)]
            if tail:
                yield None, tail

    def _take(self, pending: deque[_Block], size: int, epoch: int) -> tuple[Batch, list[BadLine]]:
        """Cut the next ``size`` rows from the pending blocks into one batch."""
        parts: list[tuple[_Block, int, int]] = []
        bad: list[BadLine] = []
        need = size
        while need > 0:
            block = pending[0]
            bad.extend(self._unreported(block))
            take = min(need, block.parsed.num_rows - block.cursor)
            if take:
                parts.append((block, block.cursor, block.cursor + take))
            block.cursor += take
            need -= take
            if block.cursor == block.parsed.num_rows:
                pending.popleft()
        last = parts[-1][0]
        position = Position(
            epoch, last.file_index, last.offset, last.line, last.cursor, last.number
        )
        return self._to_batch(parts, position), bad

    def _check_schema(self, parsed: ParsedBlock) -> None:
        """A first block that is mostly malformed means the schema does not fit the data (a
        label that is not 0/1, a wrong column): stop at once, naming the first bad line, rather
        than skip every line."""
        if self._checked:
            return
        self._checked = True
        total = parsed.num_rows + len(parsed.bad)
        if total >= 20 and len(parsed.bad) > 0.5 * total:
            b = parsed.bad[0]
            raise DataError(
                f"{b.file}:{b.line}: {b.reason} ({len(parsed.bad)} of the first {total} lines are "
                "malformed: does the schema fit this file?)"
            )

    @staticmethod
    def _unreported(block: _Block) -> list[BadLine]:
        if block.bad_reported:
            return []
        block.bad_reported = True
        return block.parsed.bad

    def _to_batch(self, parts: list[tuple[_Block, int, int]], position: Position) -> Batch:
        labels = np.concatenate([p.parsed.labels[a:b] for p, a, b in parts])
        dense = np.concatenate([p.parsed.dense[a:b] for p, a, b in parts])
        multi = any(p.parsed.values is not None for p, _, _ in parts)
        if multi:
            for p, _, _ in parts:
                self._as_bags(p)
        if not multi:
            ids = np.concatenate([p.parsed.ids[:, a:b] for p, a, b in parts], axis=1)  # [F, B]
            sparse = SparseFeatures.one_hot(torch.from_numpy(ids))
        else:
            num_f = len(self.spec.categorical)
            lengths = np.concatenate([p.parsed.lengths[:, a:b] for p, a, b in parts], axis=1)
            values = np.concatenate(
                [
                    p.parsed.values[f][p.cum[f, a] : p.cum[f, b]]
                    for f in range(num_f)
                    for p, a, b in parts
                ]
            )
            sparse = SparseFeatures.from_lengths(
                torch.from_numpy(values), torch.from_numpy(lengths)
            )
        batch = Batch(torch.from_numpy(dense), sparse, torch.from_numpy(labels), position)
        if self.pin_memory:
            batch = Batch(
                batch.dense.pin_memory(),
                batch.sparse.pin_memory(),
                batch.labels.pin_memory(),
                position,
            )
        return batch
