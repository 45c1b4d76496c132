"""CPU slots: how many pool threads do a request's CPU work at once.

Forty scoring threads contending for the GIL starve the event loop (probes, new connections,
small requests wait a switch interval per runnable thread). A pool thread therefore holds one of
``pool_concurrency`` slots while it decodes, featurises or scores, and gives it back while it only
waits for the batcher to score its rows with others' (:func:`waiting`), so the cap bounds CPU
contention without bounding how many requests a batch can coalesce.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_local = threading.local()


class CpuSlots:
    """``n`` slots; :meth:`held` takes one for the calling thread (blocking it, not the loop)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._free = threading.BoundedSemaphore(n)

    @contextmanager
    def held(self) -> Iterator[None]:
        self._free.acquire()
        _local.slots = self
        try:
            yield
        finally:
            _local.slots = None
            self._free.release()


@contextmanager
def waiting() -> Iterator[None]:
    """The calling thread's slot given back for the duration (a wait that uses no CPU); a thread
    that holds none waits as it is."""
    slots: CpuSlots | None = getattr(_local, "slots", None)
    if slots is None:
        yield
        return
    _local.slots = None
    slots._free.release()
    try:
        yield
    finally:
        slots._free.acquire()
        _local.slots = slots
