"""Live updates: while ``dlrm train`` runs, push changed rows and dense weights to a serving store.

At start a full version (``live-<time>``) is published from the in-memory tables. After every
step the ids the batch touched are marked dirty (one byte per row, vectorised); every
``push_every_s`` the dirty rows are copied (between steps, so each push is a consistent
snapshot) and written to the store by a background thread, which also appends them to the
store's update stream so that serving replicas drop those rows from their caches. Dense weights
follow every ``dense_every_s``. A failed push is retried with the next one; training never waits
for the store beyond a bounded queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import numpy as np
import torch

from embedding_server.stores import ServingStore
from embedding_server.wire import ModelVersion

log = logging.getLogger(__name__)

CHUNK_ROWS = 65536


class LivePublisher:
    """Pushes a running trainer's changes to ``store``.

    Args:
        trainer: the running :class:`dense_trainer.train.Trainer`.
        store: where serving replicas read.
        push_every_s: seconds between row pushes.
        dense_every_s: seconds between dense-weight pushes.
    """

    def __init__(self, trainer, store: ServingStore, push_every_s: float = 1.0, dense_every_s: float = 10.0) -> None:
        self.trainer = trainer
        self.store = store
        self.push_every_s = push_every_s
        self.dense_every_s = dense_every_s
        self.spec = trainer.spec
        self.dirty = [np.zeros(t.rows, dtype=bool) for t in self.spec.tables]
        self.version: str | None = None
        self.pushes = 0
        self.rows_pushed = 0
        self.failures = 0
        self.last_push_step_time: float | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=4)
        self._retry: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self._thread = threading.Thread(target=self._run, name="live-publisher", daemon=True)
        self._last_rows = self._last_dense = time.monotonic()

    # -- main thread ---------------------------------------------------------------------------------

    def start(self) -> str:
        """Publish the current tables and dense weights as a new version; start pushing."""
        t = self.trainer
        name = f"live-{time.strftime('%Y%m%d-%H%M%S')}-step{t.state.step}"
        meta = ModelVersion(
            version=name, step=t.state.step, spec=self.spec, model=t.cfg.model.model_dump(mode="json"),
            embedding_dim=t.cfg.embedding.dim, source="live training",
        )
        weights = t.client.export_state()
        with self.store.begin(meta) as writer:
            for table in self.spec.tables:
                w = weights[f"{table.name}.weight"]
                for start in range(0, table.rows, CHUNK_ROWS):
                    writer.write_rows(table.name, start, w[start : start + CHUNK_ROWS].detach().cpu().float().numpy())
            writer.write_dense(t.model.state_dict())
            writer.commit()
        self.version = name
        self._thread.start()
        log.info("live updates: published %s to %s; pushing rows every %.1fs", name, self.store.url, self.push_every_s)
        return name

    def after_step(self, sparse) -> None:
        """Mark the batch's rows dirty; push when due. Called between steps."""
        b = sparse.batch_size
        values, offsets = sparse.values, sparse.offsets
        for f in range(len(self.dirty)):
            ids = values[offsets[f * b] : offsets[(f + 1) * b]]
            self.dirty[f][ids.numpy()] = True
        now = time.monotonic()
        if now - self._last_rows >= self.push_every_s:
            self.push_rows()
            self._last_rows = now
        if now - self._last_dense >= self.dense_every_s:
            self.push_dense()
            self._last_dense = now

    @torch.no_grad()
    def push_rows(self) -> None:
        weights = self.trainer.client.export_state()
        updates = {}
        for f, table in enumerate(self.spec.tables):
            ids = np.flatnonzero(self.dirty[f])
            if len(ids):
                self.dirty[f][ids] = False
                rows = weights[f"{table.name}.weight"][torch.from_numpy(ids)].float().cpu().numpy()
                updates[table.name] = (ids.astype(np.int64), rows)
        if updates:
            self._queue.put(("rows", updates, time.time()))

    @torch.no_grad()
    def push_dense(self) -> None:
        state = {k: v.detach().cpu().clone() for k, v in self.trainer.model.state_dict().items()}
        self._queue.put(("dense", state, time.time()))

    def close(self) -> None:
        """Push what is left and stop the background thread."""
        if self.version is None:
            return
        self.push_rows()
        self.push_dense()
        self._queue.put(None)
        self._thread.join(timeout=60)

    # -- background thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            kind, payload, stamp = item
            try:
                if kind == "rows":
                    for table, (ids, rows) in self._retry.items():  # merge a failed push
                        if table in payload:
                            keep = ~np.isin(ids, payload[table][0])
                            ids, rows = np.concatenate([ids[keep], payload[table][0]]), np.concatenate([rows[keep], payload[table][1]])
                        payload[table] = (ids, rows)
                    self._retry = {}
                    self.store.update_rows(self.version, payload)
                    self.rows_pushed += sum(len(ids) for ids, _ in payload.values())
                else:
                    self.store.update_dense(self.version, payload)
                self.pushes += 1
                self.last_push_step_time = stamp
            except Exception as exc:
                self.failures += 1
                if kind == "rows":
                    self._retry = payload
                log.warning("live update push failed (%s); retrying with the next push", exc)
