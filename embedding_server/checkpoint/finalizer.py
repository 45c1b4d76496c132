"""The master's side of a checkpoint: wait for every writer's record, then make it current.

    begin(cut)          the master, before it orders the cut (the partial directory is fresh)
    background thread   per cut, in order: wait, within the cut's bound, until every writer's
                        record is in the partial directory; merge them into the manifest (each
                        writer's own digests: nothing is read back); rename; replace ``latest``;
                        prune; log what was written against what is allocated
    wait(cut)           the last checkpoint of a run: block (bounded) until it is current
    check()             a writer's error, or a cut past its bound, raised on the training thread
                        at the next cut: the run ends naming the writer

Training never waits for a checkpoint it does not need now: the trainers order the cut, each
writer snapshots and writes in the background, and this thread finishes it.
"""

from __future__ import annotations

import logging
import queue
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlrm_core.errors import CheckpointError
from embedding_server.checkpoint.files import finalize_checkpoint, read_record, step_name

log = logging.getLogger(__name__)


@dataclass
class PendingCut:
    """One checkpoint on its way to being current."""

    step: int
    kind: str
    """full, or delta (of ``base``)."""
    base: str | None
    writers: dict[str, str]
    """Record name -> role in words (``server-1`` -> ``embedding server 1``)."""
    meta: dict[str, Any]
    bound_s: float
    """How long its writers may take, from now."""
    issued: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    path: Path | None = None
    error: str | None = None


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


class Finalizer:
    """The master's checkpoint finishing thread.

    Args:
        root: the checkpoints directory.
        keep: full checkpoints kept (``train.keep_checkpoints``).
    """

    def __init__(self, root: Path, keep: int) -> None:
        self.root = Path(root)
        self.keep = keep
        self.latest_step: int | None = None
        """Step of the newest current checkpoint (what a delta is based on)."""
        self.completed: list[dict[str, Any]] = []
        """Per current checkpoint: step, kind, bytes and rows written, rows allocated, seconds."""
        self.failure: CheckpointError | None = None
        self._queue: queue.Queue = queue.Queue()
        self._open = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="checkpoint-finalizer", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        return self._open > 0

    def begin(self, cut: PendingCut) -> PendingCut:
        with self._lock:
            self._open += 1
        self._queue.put(cut)
        return cut

    def wait(self, cut: PendingCut, timeout_s: float) -> Path:
        """Block until ``cut`` is current (or failed: raises), at most ``timeout_s``."""
        if not cut.done.wait(timeout_s):
            raise CheckpointError(
                f"checkpoint {step_name(cut.step)} was not complete within {timeout_s:.0f}s"
            )
        self.check()
        return cut.path

    def check(self) -> None:
        """Raise the first failure of a background checkpoint, if any."""
        if self.failure is not None:
            raise self.failure

    def close(self, timeout_s: float) -> None:
        """Finish the open cuts (bounded), then stop."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        self._queue.put(None)
        if not self.in_flight:
            self._thread.join(timeout=5)

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while (cut := self._queue.get()) is not None:
            try:
                cut.path = self._finish(cut)
            except CheckpointError as exc:
                cut.error = str(exc)
                self.failure = self.failure or exc
                log.error("%s", exc)
                shutil.rmtree(self.root / f".{step_name(cut.step)}.partial", ignore_errors=True)
            finally:
                with self._lock:
                    self._open -= 1
                cut.done.set()

    def _records(self, cut: PendingCut) -> dict[str, dict]:
        """Every writer's record, once all are there (bounded by the cut's bound)."""
        directory = self.root / f".{step_name(cut.step)}.partial"
        records: dict[str, dict] = {}
        while True:
            for name in cut.writers:
                if name not in records and (record := read_record(directory, name)) is not None:
                    if "error" in record:
                        raise CheckpointError(
                            f"checkpoint {step_name(cut.step)}: {cut.writers[name]} could not "
                            f"write it: {record['error']}"
                        )
                    records[name] = record
            if len(records) == len(cut.writers):
                return records
            waited = time.monotonic() - cut.issued
            if waited > cut.bound_s:
                missing = ", ".join(cut.writers[n] for n in cut.writers if n not in records)
                raise CheckpointError(
                    f"checkpoint {step_name(cut.step)}: {missing} did not finish writing within "
                    f"{cut.bound_s:.0f}s (stuck storage?)"
                )
            time.sleep(0.05)

    def _finish(self, cut: PendingCut) -> Path:
        records = self._records(cut)
        files: dict[str, Any] = {}
        for record in records.values():
            files.update(record["files"])
        # Each writer's own account (its files' digests are in ``files``, under their names).
        writers = {
            name: {**{k: v for k, v in r.items() if k != "files"}, "files": sorted(r["files"])}
            for name, r in records.items()
        }
        extra = {"kind": cut.kind, "base": cut.base, "writers": writers}
        path = finalize_checkpoint(
            self.root, cut.step, cut.meta, self.keep, files=files, extra=extra
        )
        self.latest_step = cut.step
        stats = {
            "step": cut.step,
            "kind": cut.kind,
            "bytes": sum(f["bytes"] for f in files.values()),
            "rows_written": sum(r.get("rows_written", 0) for r in records.values()),
            "rows_allocated": sum(r.get("rows_allocated", 0) for r in records.values()),
            "bytes_allocated": sum(r.get("bytes_allocated", 0) for r in records.values()),
            "seconds": round(time.monotonic() - cut.issued, 3),
        }
        self.completed.append(stats)
        what, rows = (
            (f"delta of {cut.base}", "rows changed") if cut.base else ("full", "rows trained")
        )
        log.info(
            "checkpoint %s (%s): %s written: %s %s of %s allocated (%s of tables allocated); "
            "current %.1fs after the cut",
            path.name,
            what,
            _mb(stats["bytes"]),
            f"{stats['rows_written']:,}",
            rows,
            f"{stats['rows_allocated']:,}",
            _mb(stats["bytes_allocated"]),
            stats["seconds"],
        )
        return path
