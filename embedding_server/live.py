"""Live row updates: push the rows a training job changes to a serving-store version.

Whoever holds table rows (the single-process trainer, or each embedding server for its pieces)
marks the rows a training step touched (one byte per row, vectorised), and every
``push_every_s`` copies them (between steps: each push is a consistent snapshot) and hands them
to a background thread, which writes them into the published version and appends them to the
store's update stream, so that serving replicas drop them from their caches. A failed push is
merged into the next one; training never waits for the store beyond a bounded queue. A version
that was deleted meanwhile (collected after newer publishes) is never written again: the store
refuses the update atomically, and the pusher stops (``gone``), logging it once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from embedding_server.stores import ServingStore, VersionNotFound

log = logging.getLogger(__name__)


class LivePusher:
    """Pushes changed rows of some table pieces (and, when given, dense weights) to ``version``.

    Args:
        pieces: (table name, first global row, rows) of each piece this process holds.
        weights: returns each piece's current weights [rows, D] (views are fine).
    """

    def __init__(
        self,
        store: ServingStore,
        version: str,
        pieces: list[tuple[str, int, int]],
        weights: Callable[[], list[torch.Tensor]],
        push_every_s: float = 1.0,
    ) -> None:
        self.store = store
        self.version = version
        self.pieces = pieces
        self.weights = weights
        self.push_every_s = push_every_s
        self.dirty = [np.zeros(rows, dtype=bool) for _, _, rows in pieces]
        self.pushes = self.rows_pushed = self.failures = 0
        self.gone = False
        """The version was deleted from the store: nothing more is pushed."""
        self._queue: queue.Queue = queue.Queue(maxsize=4)
        self._retry: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="live-pusher", daemon=True)
        self._thread.start()

    def mark(self, piece: int, local_ids: np.ndarray) -> None:
        self.dirty[piece][local_ids] = True

    def maybe_push(self) -> None:
        now = time.monotonic()
        if now - self._last >= self.push_every_s:
            self.push_rows()
            self._last = now

    @torch.no_grad()
    def push_rows(self) -> None:
        if self.gone:
            return
        weights = self.weights()
        updates = {}
        for i, (table, start, _) in enumerate(self.pieces):
            ids = np.flatnonzero(self.dirty[i])
            if len(ids):
                self.dirty[i][ids] = False
                rows = weights[i][torch.from_numpy(ids)].float().cpu().numpy()
                updates[table] = ((ids + start).astype(np.int64), rows)
        if updates:
            self._queue.put(("rows", updates))

    def push_dense(self, state: dict[str, torch.Tensor]) -> None:
        if self.gone:
            return
        self._queue.put(("dense", {k: v.detach().cpu().clone() for k, v in state.items()}))

    def close(self) -> None:
        """Push what is left, then stop the background thread."""
        self.push_rows()
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, payload = item
            if self.gone:
                continue
            try:
                if kind == "rows":
                    for table, (ids, rows) in self._retry.items():  # merge a failed push
                        if table in payload:
                            keep = ~np.isin(ids, payload[table][0])
                            ids = np.concatenate([ids[keep], payload[table][0]])
                            rows = np.concatenate([rows[keep], payload[table][1]])
                        payload[table] = (ids, rows)
                    self._retry = {}
                    self.store.update_rows(self.version, payload)
                    self.rows_pushed += sum(len(ids) for ids, _ in payload.values())
                else:
                    self.store.update_dense(self.version, payload)
                self.pushes += 1
            except VersionNotFound:
                self.gone, self._retry = True, {}
                log.warning("live updates stop: version %s is no longer in %s (collected or deleted)",
                            self.version, self.store.url)
            except Exception as exc:
                self.failures += 1
                if kind == "rows":
                    self._retry = payload
                log.warning("live update push failed (%s); retrying with the next push", exc)
