"""Background checkpoint writing: a process hands over a snapshot and goes on training.

    training thread:  snapshot (copies of the rows and states to write, taken between steps)
                      -> ``submit(directory, files, record)``, returns at once
    writer thread:    writes the files one by one (fsynced, digested while written, paced to
                      ``bytes_per_s`` when set), then its record ``writer-<name>.json`` in the
                      partial directory: its files and digests, or the error that stopped it

Jobs are written in the order they were submitted. The master trainer's finaliser
(``checkpoint/finalizer.py``) waits for every writer's record of a checkpoint before making it
current.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from embedding_server.checkpoint.files import save_file, write_record

log = logging.getLogger(__name__)

_WRITERS: weakref.WeakSet = weakref.WeakSet()


def exit_status(code: int) -> int:
    """``code``, for a process that ends on a failure. While a checkpoint writer is still busy,
    the process ends here (``os._exit``, after flushing): interpreter shutdown under a thread that
    is inside torch aborts the process, which would hide the status. The partial checkpoint it
    was writing is never made current."""
    if any(w.busy for w in list(_WRITERS)):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


class CheckpointWriter:
    """One process's checkpoint writer thread.

    Args:
        name: the writer's name in records (``trainer-0``, ``server-1``).
        bytes_per_s: rate limit of its writes (0: none).
    """

    def __init__(self, name: str, bytes_per_s: float = 0.0) -> None:
        self.name = name
        self.bytes_per_s = bytes_per_s
        self._jobs: queue.Queue = queue.Queue()
        self._pending = 0
        self._idle = threading.Condition()
        self._thread = threading.Thread(
            target=self._run, name=f"checkpoint-writer-{name}", daemon=True
        )
        self._thread.start()
        _WRITERS.add(self)

    @property
    def busy(self) -> bool:
        return self._pending > 0

    def submit(self, directory: Path, files: dict[str, Any], record: dict[str, Any]) -> None:
        """Write ``files`` (name -> object of tensors) into ``directory``, then ``record`` plus the
        files' entries; returns at once. The objects must not change afterwards (snapshots)."""
        with self._idle:
            self._pending += 1
        self._jobs.put((Path(directory), files, record))

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every submitted job is written; False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def close(self, timeout_s: float) -> bool:
        """Finish the submitted jobs (bounded), then stop the thread."""
        done = self.wait_idle(timeout_s)
        self._jobs.put(None)
        if done:
            self._thread.join(timeout=5)
        return done

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            directory, files, record = job
            t0 = time.perf_counter()
            try:
                entries = {
                    name: save_file(directory, name, obj, self.bytes_per_s)
                    for name, obj in files.items()
                }
                write_record(
                    directory,
                    self.name,
                    {**record, "files": entries, "write_s": round(time.perf_counter() - t0, 3)},
                )
            # told to the finaliser through the record, when it can be written
            except Exception as exc:
                log.error("checkpoint writer %s: %s", self.name, exc)
                try:
                    write_record(
                        directory,
                        self.name,
                        {"error": str(exc).splitlines()[0] if str(exc) else repr(exc)},
                    )
                except OSError:
                    pass
            finally:
                del files
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
