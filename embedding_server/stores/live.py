"""Live row updates: push the rows a training job changes to a serving-store version.

Whoever holds table rows (the single-process trainer, or each embedding server for its pieces)
marks the rows a training step touched (one byte per row, vectorised), and every
``push_every_s`` copies them (between steps: each push is a consistent snapshot) and hands them
to a background thread, which writes them into the published version and appends them to the
store's update stream, so that serving replicas drop them from their caches. A failed push is
merged into the next one; training never waits for the store beyond a bounded queue. A version
that was deleted meanwhile (collected after newer publishes) is never written again: the store
refuses the update atomically, and the pusher stops (``gone``), logging it once.

Dynamic tables (``owners`` given): each push also carries the table's id-map changes since the
previous push (:class:`~embedding_server.idmap.view.IdMapDelta`: ids admitted with their rows,
ids evicted, the rows whose owner changed), found by comparing each row's owner (the id it holds,
``row_id`` where ``used``) with the owners of the last push: O(R) vectorised compares per push,
whatever happened in between, and no hook in admission or eviction. Rows given to a new id are
pushed with it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from embedding_server.idmap.view import NO_OWNER, IdMapDelta
from embedding_server.stores import ServingStore, VersionNotFound

log = logging.getLogger(__name__)


class LivePusher:
    """Pushes changed rows of some table pieces (and, when given, dense weights) to ``version``.

    Args:
        pieces: (table name, first global row, rows) of each piece this process holds.
        weights: returns each piece's current weights [rows, D] (views are fine).
        owners: returns, per dynamic table among the pieces, (row_id int64 [R], used bool [R]):
            the id each row holds where ``used`` (views are fine); None: no dynamic table.
    """

    def __init__(
        self,
        store: ServingStore,
        version: str,
        pieces: list[tuple[str, int, int]],
        weights: Callable[[], list[torch.Tensor]],
        push_every_s: float = 1.0,
        owners: Callable[[], dict[str, tuple[torch.Tensor, torch.Tensor]]] | None = None,
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
        self._retry_maps: dict[str, IdMapDelta] = {}
        self.owners = owners
        self._owners = self._read_owners()  # as published: the base of the first push's changes
        self.map_changes = 0
        """Id-map entries pushed (admissions and evictions)."""
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="live-pusher", daemon=True)
        self._thread.start()

    def _read_owners(self) -> dict[str, np.ndarray]:
        """The id each row of every dynamic table holds now, int64 [R] (NO_OWNER: none)."""
        if self.owners is None:
            return {}
        return {
            table: np.where(used.numpy(), row_id.numpy(), NO_OWNER)
            for table, (row_id, used) in self.owners().items()
        }

    def _map_changes(self) -> dict[str, IdMapDelta]:
        """Per dynamic table: its map's changes since the last push (tables without any: left
        out)."""
        now = self._read_owners()
        out = {}
        for table, owner in now.items():
            before = self._owners[table]
            slots = np.flatnonzero(owner != before)  # [s] rows whose id changed
            if not len(slots):
                continue
            old, new = before[slots], owner[slots]
            gone, came = old != NO_OWNER, new != NO_OWNER
            ids = np.concatenate([new[came], old[gone]])  # the admitted first: they win below
            rows = np.concatenate([slots[came], np.full(int(gone.sum()), -1, np.int64)])
            ids, first = np.unique(ids, return_index=True)
            piece = next(i for i, (name, _, _) in enumerate(self.pieces) if name == table)
            # a piece of a table split by rows: its rows are global + start
            start = self.pieces[piece][1]
            rows = rows[first]
            out[table] = IdMapDelta(ids, np.where(rows >= 0, rows + start, -1), slots + start, new)
            self.dirty[piece][slots[came]] = True  # a new id's row goes with its map entry
        self._owners = now
        return out

    STATS = ("pushes", "rows_pushed", "id_map_changes", "failures", "overlay_compactions")
    """The keys of :meth:`stats`."""

    def stats(self) -> dict[str, int]:
        """What this pusher did: pushes that landed, rows pushed, id-map entries pushed (admissions
        and evictions), failed pushes (retried with the next), overlays its store folded."""
        return dict(
            zip(
                self.STATS,
                (
                    self.pushes,
                    self.rows_pushed,
                    self.map_changes,
                    self.failures,
                    self.store.compactions,
                ),
                strict=True,
            )
        )

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
        maps = self._map_changes()
        weights = self.weights()
        updates = {}
        for i, (table, start, _) in enumerate(self.pieces):
            ids = np.flatnonzero(self.dirty[i])
            if len(ids):
                self.dirty[i][ids] = False
                rows = weights[i][torch.from_numpy(ids)].float().cpu().numpy()
                updates[table] = ((ids + start).astype(np.int64), rows)
        if updates or maps:
            self._queue.put(("rows", (updates, maps)))

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
                    self._push(*payload)
                else:
                    self.store.update_dense(self.version, payload)
                self.pushes += 1
            except VersionNotFound:
                self.gone, self._retry, self._retry_maps = True, {}, {}
                log.warning(
                    "live updates stop: version %s is no longer in %s (collected or deleted)",
                    self.version,
                    self.store.url,
                )
            except Exception as exc:
                self.failures += 1  # a row push stays in _retry / _retry_maps: merged into the next
                log.warning("live update push failed (%s); retrying with the next push", exc)

    def _push(
        self, updates: dict[str, tuple[np.ndarray, np.ndarray]], maps: dict[str, IdMapDelta]
    ) -> None:
        """One push, a failed one's rows and map changes merged in (the newer row wins)."""
        for table, (ids, rows) in self._retry.items():
            if table in updates:
                keep = ~np.isin(ids, updates[table][0])
                ids = np.concatenate([ids[keep], updates[table][0]])
                rows = np.concatenate([rows[keep], updates[table][1]])
            updates[table] = (ids, rows)
        for table, delta in self._retry_maps.items():
            maps[table] = delta.then(maps[table]) if table in maps else delta
        self._retry, self._retry_maps = updates, maps  # until the store took them
        self.store.update_rows(self.version, updates, id_maps=maps or None)
        self._retry, self._retry_maps = {}, {}
        self.rows_pushed += sum(len(ids) for ids, _ in updates.values())
        self.map_changes += sum(len(d) for d in maps.values())
