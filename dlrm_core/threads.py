"""A process-wide thread pool started on first use (what every process shares: a scoring pool
in the API, the id maps' remap-ahead thread in a trainer)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor


class LazyPool:
    """A ``ThreadPoolExecutor`` created by the first :meth:`get`, then shared by every caller.

    Args:
        workers: its threads.
        prefix: their names' prefix.
        initializer, initargs: run in each thread when it starts.
    """

    def __init__(
        self, workers: int, prefix: str, initializer: Callable | None = None, initargs: tuple = ()
    ) -> None:
        self.workers, self.prefix = workers, prefix
        self.initializer, self.initargs = initializer, initargs
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=self.workers,
                    thread_name_prefix=self.prefix,
                    initializer=self.initializer,
                    initargs=self.initargs,
                )
            return self._pool
