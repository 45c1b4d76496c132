"""Dynamic batching: concurrent requests of one version scored in one model call.

Each request decodes and featurises its own body (a bad request fails there, alone, before it
is queued), in its pool thread or, small ones that arrive beside others, on the event loop
(``api/fastpath.py``), then hands its model inputs to the batcher and waits:

    request threads:  decode -> featurise -> score(model, inputs) ... wait ... predictions
    event loop:       decode -> featurise -> submit(model, inputs) ... await the future ...
    batcher thread:   wait for a queued request; while other requests are still being decoded
                      (``coming``) and the batch has room, wait for them up to max_delay;
                      merge up to max_size examples of one version -> one model call -> split

A lone request is never delayed: when no model call is running and nothing is queued, it is
scored at once in its own thread. Batches form while a model call runs (requests queue behind
it) and from requests already being decoded. A batch whose call fails is scored again request
by request, so that each request gets its own answer or its own error (unless the store is
unavailable or the version gone: that is every request's answer at once).

Shapes: B examples of a request, F categorical features, I dense features; inputs are
``ModelInputs`` (dense [B, I], ids of all bags feature-major, offsets [F*B + 1]).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from api.featurize import ModelInputs
from api.metrics import ServingMetrics
from api.model import ServingModel
from api.slots import CpuSlots, waiting
from embedding_server.stores import StoreUnavailable, VersionNotFound

Score = Callable[[ServingModel, ModelInputs], list[float]]


class BatcherStopped(RuntimeError):
    """``submit`` after the batcher thread stopped (the server is shutting down)."""


SHARED_FAULTS = (StoreUnavailable, VersionNotFound)
"""Failures of a coalesced call that are no single request's: answered to all of its requests."""


def merge(parts: list[ModelInputs]) -> ModelInputs:
    """Inputs of several requests -> one batch, examples in request order."""
    sizes = [p[0].shape[0] for p in parts]
    total = sum(sizes)
    n_features = (len(parts[0][2]) - 1) // sizes[0]
    dense = np.concatenate([p[0] for p in parts])  # [sum B, I]
    lengths = np.concatenate(
        [
            np.diff(offsets).reshape(n_features, b)
            for (_, _, offsets), b in zip(parts, sizes, strict=True)
        ],
        axis=1,
    )  # [F, sum B]
    offsets = np.zeros(n_features * total + 1, dtype=np.int64)
    np.cumsum(lengths.ravel(), out=offsets[1:])
    pieces = [
        ids[offs[f * b] : offs[(f + 1) * b]]
        for f in range(n_features)
        for (_, ids, offs), b in zip(parts, sizes, strict=True)
    ]
    ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return dense, ids.astype(np.int64, copy=False), offsets


@dataclass
class _Job:
    model: ServingModel
    inputs: ModelInputs
    future: Future = field(default_factory=Future)

    @property
    def size(self) -> int:
        return self.inputs[0].shape[0]


class Batcher:
    """Coalesces concurrent ``score`` calls into fewer model calls.

    Args:
        score: scores one batch with one version (the service's model call).
        max_size: most examples per coalesced call.
        max_delay_s: longest a queued batch waits for requests still being decoded.
    """

    def __init__(
        self, score: Score, max_size: int, max_delay_s: float, metrics: ServingMetrics
    ) -> None:
        self._score = score
        self.max_size = max_size
        self.max_delay_s = max_delay_s
        self.metrics = metrics
        self._cond = threading.Condition()
        self._queue: list[_Job] = []
        self._busy = False
        """A model call is running (inline or on the batcher thread)."""
        self._coming = 0
        """Requests being decoded and featurised, not queued yet."""
        self.slots: CpuSlots | None = None
        """The app's CPU slots (``api/slots.py``, set by ``create_app``): the batcher thread holds
        one while it scores, so it counts among the threads contending for the GIL."""
        self._local = threading.local()
        self._stopped = False
        self._thread: threading.Thread | None = None

    # -- request threads ---------------------------------------------------------------------------
    @contextmanager
    def coming(self) -> Iterator[None]:
        """Count this request as on its way to ``score`` until it gets there (or fails)."""
        with self._cond:
            self._coming += 1
        self._local.coming = True
        try:
            yield
        finally:
            self._arrived()

    def _arrived(self) -> None:
        if getattr(self._local, "coming", False):
            self._local.coming = False
            with self._cond:
                self._coming -= 1
                # only a forming batch waits for comers (a needless wake costs a GIL hand-off)
                if self._queue:
                    self._cond.notify_all()

    def score(self, model: ServingModel, inputs: ModelInputs) -> list[float]:
        """Predictions of ``inputs``, scored alone at once when the batcher is idle, else with
        the requests queued beside them."""
        self._arrived()
        job = _Job(model, inputs)
        with self._cond:
            running = self.running
            inline = not running or (not self._busy and not self._queue)
            if inline and running:
                self._busy = True  # requests that come meanwhile queue for the batcher thread
            elif not inline:
                self._queue.append(job)
                self._cond.notify_all()
        if not inline:
            with waiting():  # no CPU while the batcher scores it: the slot goes to another request
                return job.future.result()
        try:
            self._observe([job])
            return self._score(model, inputs)
        finally:
            if running:
                with self._cond:
                    self._busy = False
                    if self._queue:
                        self._cond.notify_all()

    @property
    def running(self) -> bool:
        """Whether the batcher thread takes queued requests (``submit`` may be used)."""
        return self._thread is not None and not self._stopped

    def submit(self, model: ServingModel, inputs: ModelInputs) -> Future:
        """Queue ``inputs`` for the batcher thread, never scored in this thread (callers that
        must not block: the event loop) -> the future of their predictions, always resolved:
        the thread scores what is queued, also when it stops.

        Raises:
            BatcherStopped: the batcher thread is not running.
        """
        job = _Job(model, inputs)
        with self._cond:
            if not self.running:
                raise BatcherStopped("the batcher is not running")
            self._queue.append(job)
            self._cond.notify_all()
        return job.future

    # -- the batcher thread ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="batcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Score what is queued, then end the thread; later calls score inline."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._thread = None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._queue and not self._busy) and not self._stopped:
                    self._cond.wait()
                if not self._queue:
                    return  # stopped and drained
                deadline = time.monotonic() + self.max_delay_s
                while self._coming > 0 and sum(j.size for j in self._queue) < self.max_size:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                batch = self._take()
                self._busy = True
            try:
                if self.slots is None:
                    self._run(batch)
                else:
                    with self.slots.held():
                        self._run(batch)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _take(self) -> list[_Job]:
        """The oldest job and the queued jobs of its version that fit beside it."""
        first = self._queue[0]
        batch, rest, size = [first], [], first.size
        for job in self._queue[1:]:
            if job.model is first.model and size + job.size <= self.max_size:
                batch.append(job)
                size += job.size
            else:
                rest.append(job)
        self._queue = rest
        return batch

    def _run(self, batch: list[_Job]) -> None:
        self._observe(batch)
        if len(batch) > 1:
            try:
                predictions = self._score(batch[0].model, merge([j.inputs for j in batch]))
            except SHARED_FAULTS as exc:  # the store or the version: every request's alike, at once
                # (scored again one by one, each would wait out the store's timeout)
                for job in batch:
                    job.future.set_exception(exc)
                return
            except Exception:  # noqa: BLE001 - each request is scored again, alone, for its own error
                predictions = None
            if predictions is not None:
                lo = 0
                for job in batch:
                    job.future.set_result(predictions[lo : lo + job.size])
                    lo += job.size
                return
        for job in batch:
            try:
                job.future.set_result(self._score(job.model, job.inputs))
            except Exception as exc:  # noqa: BLE001 - delivered to the request it belongs to
                job.future.set_exception(exc)

    def _observe(self, batch: list[_Job]) -> None:
        self.metrics.model_batch_requests.observe(len(batch))
        self.metrics.model_batch_examples.observe(sum(j.size for j in batch))
