"""Live updates while ``dlrm train`` runs (see ``embedding_server/stores/live.py`` for the
mechanics).

Single process: at start a full version (``live-<time>-step<N>``) is published from the
in-memory tables (with the id maps of dynamic tables); the trainer then pushes the rows its
steps touch (dynamic tables: with their id-map changes) every ``push_every_s`` and the dense
weights every ``dense_every_s``.

With embedding servers: the job checkpoints, the master publishes that checkpoint as the live
version, every server pushes the rows of its own pieces, and the master pushes the dense
weights.
"""

from __future__ import annotations

import logging
import time
import uuid

from embedding_server.publish import CHUNK_ROWS, publish_checkpoint
from embedding_server.stores import ServingStore
from embedding_server.stores.live import LivePusher
from embedding_server.wire import ModelVersion

log = logging.getLogger(__name__)


class LivePublisher:
    """A running trainer's live updates to ``store``.

    Args:
        trainer: the running :class:`dense_trainer.train.Trainer`.
        store: where serving replicas read.
        push_every_s: seconds between row pushes (rows held by this process).
        dense_every_s: seconds between dense-weight pushes.
    """

    def __init__(
        self, trainer, store: ServingStore, push_every_s: float = 1.0, dense_every_s: float = 10.0
    ) -> None:
        self.trainer = trainer
        self.store = store
        self.push_every_s = push_every_s
        self.dense_every_s = dense_every_s
        self.spec = trainer.spec
        self.version: str | None = None
        self.rows: LivePusher | None = None  # None when embedding servers push the rows
        self._dense: LivePusher | None = None
        self._last_dense = time.monotonic()

    @property
    def pushes(self) -> int:
        return sum(p.pushes for p in (self.rows, self._dense) if p is not None)

    @property
    def rows_pushed(self) -> int:
        return self.rows.rows_pushed if self.rows else 0

    @property
    def failures(self) -> int:
        return sum(p.failures for p in (self.rows, self._dense) if p is not None)

    def stats(self, servers: list[dict[str, int]] = ()) -> dict[str, object]:
        """``metrics.json``'s ``live_updates``: the version pushed to and, summed over this
        process's pushers and the embedding servers' (``servers``: their :meth:`LivePusher.stats`),
        pushes, rows pushed, id-map changes, failed pushes and overlay compactions."""
        parts = [
            p.stats()
            for p in {id(p): p for p in (self.rows, self._dense) if p is not None}.values()
        ]
        total = {k: sum(part[k] for part in [*parts, *servers]) for k in LivePusher.STATS}
        return {"version": self.version, "store": self.store.url, **total}

    def _name(self) -> str:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return f"live-{stamp}-step{self.trainer.state.step}-{uuid.uuid4().hex[:6]}"

    def start(self) -> str:
        """Publish the in-memory tables and dense weights as a new version; start pushing."""
        t = self.trainer
        meta = ModelVersion(
            version=self._name(),
            step=t.state.step,
            spec=self.spec,
            model=t.cfg.model.model_dump(mode="json"),
            embedding_dim=t.cfg.embedding.dim,
            source="live training",
        )
        weights = t.client.export_state()
        id_rows = t.client.id_rows()
        with self.store.begin(meta) as writer:
            for table in self.spec.tables:
                w = weights[f"{table.name}.weight"]
                for start in range(0, table.rows, CHUNK_ROWS):
                    writer.write_rows(
                        table.name,
                        start,
                        w[start : start + CHUNK_ROWS].detach().cpu().float().numpy(),
                    )
                if table.name in id_rows:
                    writer.write_id_map(table.name, *(a.numpy() for a in id_rows[table.name]))
            writer.write_dense(t.model.state_dict())
            writer.commit()
        self.version = meta.version
        names = [t.name for t in self.spec.tables]
        self.rows = LivePusher(
            self.store,
            self.version,
            [(t.name, 0, t.rows) for t in self.spec.tables],
            lambda: [self.trainer.client.table_weights()[n] for n in names],
            self.push_every_s,
            owners=t.client.id_owners if id_rows else None,
        )
        self._dense = self.rows
        log.info(
            "live updates: published %s to %s; pushing rows every %.1fs",
            self.version,
            self.store.url,
            self.push_every_s,
        )
        return self.version

    def start_from_checkpoint(self, checkpoint) -> str:
        """Distributed: publish the job's checkpoint as the live version (master only)."""
        self.version = publish_checkpoint(checkpoint, self.store, version=self._name()).version
        self._dense = LivePusher(self.store, self.version, [], list, self.push_every_s)
        log.info(
            "live updates: published %s to %s; servers push rows every %.1fs",
            self.version,
            self.store.url,
            self.push_every_s,
        )
        return self.version

    def after_step(self, sparse) -> None:
        """Mark the batch's rows dirty (single process); push when due. Called between steps."""
        if self.rows is not None:
            b = sparse.batch_size
            values = self.trainer.client.trained_rows(sparse)  # dynamic tables' ids as rows
            for f, t in enumerate(self.spec.feature_tables):  # the rows of feature f's table
                self.rows.mark(
                    t, values[sparse.offsets[f * b] : sparse.offsets[(f + 1) * b]].numpy()
                )
            self.rows.maybe_push()
        now = time.monotonic()
        if self._dense is not None and now - self._last_dense >= self.dense_every_s:
            self._dense.push_dense(self.trainer.model.state_dict())
            self._last_dense = now

    def close(self) -> None:
        """Push what is left and stop."""
        if self._dense is not None:
            self._dense.push_dense(self.trainer.model.state_dict())
        for pusher in {id(p): p for p in (self.rows, self._dense) if p is not None}.values():
            pusher.close()


def start_live(trainer) -> None:
    """Publish a live version and push updates while training."""
    from embedding_server.stores import open_store

    live = trainer.cfg.live
    if trainer.cluster is None:  # the tables are here: publish them from memory
        trainer.live = LivePublisher(
            trainer, open_store(live.store), live.push_every_s, live.dense_every_s
        )
        trainer.client.live_start(trainer.live.start)
        return
    # Embedding servers: checkpoint, the master publishes it, then every server pushes its rows.
    checkpoint = trainer.save_checkpoint()
    publish = None
    if trainer.is_master:
        trainer.live = LivePublisher(
            trainer, open_store(live.store), live.push_every_s, live.dense_every_s
        )

        def publish() -> str:  # the others wait on the slow group: bounded by the bytes, as this is
            with trainer.checkpoints.phase(f"publishing {checkpoint.name}"):
                return trainer.live.start_from_checkpoint(checkpoint)

    trainer.client.live_start(publish)
