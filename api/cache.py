"""A per-process hot-row cache in front of a remote serving store.

One CLOCK cache per table (the second-chance approximation of LRU that databases use: a hit
costs a dict lookup and one bit, no list reshuffling), sized in bytes. Rows are stored in one
numpy array per table, so a batch of hits is a single gather, in the store's row dtype (fp16 and
int8/int4 rows take their stored bytes, not float32's). A dynamic table's rows carry a tag: the
id that held the row when it was read; a hit needs the id the request's map expects (a row given
to another id by a live update is never taken for the old one, whatever the map still says).
"""

from __future__ import annotations

import threading
from itertools import repeat

import numpy as np


class TableCache:
    def __init__(self, capacity: int, width: int, dtype: np.dtype | type = np.float32) -> None:
        self.capacity = capacity
        self.slots: dict[int, int] = {}
        self.rows = np.zeros((capacity, width), dtype=dtype)  # [capacity, row width]
        self.owner = np.full(capacity, -1, dtype=np.int64)  # row id held by each slot
        self.tags = np.zeros(capacity, dtype=np.int64)  # dynamic tables: the raw id the row held
        self.referenced = np.zeros(capacity, dtype=bool)
        self.hand = 0
        self.used = 0

    def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """-> (slot per id, -1 where missing)."""
        ids_list = ids.tolist()  # dict.get mapped in C (no Python frame per id)
        slots = np.fromiter(
            map(self.slots.get, ids_list, repeat(-1, len(ids_list))),
            dtype=np.int64,
            count=len(ids_list),
        )
        hit = slots >= 0
        self.referenced[slots[hit]] = True
        return slots, hit

    def _victim(self) -> int:
        if self.used < self.capacity:
            self.used += 1
            return self.used - 1
        while True:  # CLOCK: skip (and clear) referenced slots
            slot = self.hand
            self.hand = (self.hand + 1) % self.capacity
            if not self.referenced[slot]:
                return slot
            self.referenced[slot] = False

    def insert(self, ids: np.ndarray, rows: np.ndarray, tags: np.ndarray | None = None) -> None:
        tag_list = tags.tolist() if tags is not None else [0] * len(ids)
        for i, row, tag in zip(ids.tolist(), rows, tag_list, strict=True):
            if i in self.slots:
                self.rows[self.slots[i]] = row
                self.tags[self.slots[i]] = tag
                continue
            slot = self._victim()
            old = int(self.owner[slot])
            if old >= 0:
                del self.slots[old]
            self.slots[i] = slot
            self.owner[slot] = i
            self.rows[slot] = row
            self.tags[slot] = tag
            self.referenced[slot] = False

    def invalidate(self, ids: np.ndarray) -> None:
        for i in ids.tolist():
            slot = self.slots.pop(i, None)
            if slot is not None:
                self.owner[slot] = -1
                self.referenced[slot] = False


class RowCache:
    """Caches of all tables of one model version, within a byte budget.

    The budget is split in proportion to table size (rows x dim), capped at each table's size,
    so small tables end up fully cached.
    """

    def __init__(
        self,
        tables: list[tuple[str, int, int]],
        budget_bytes: float,
        dtype: np.dtype | type = np.float32,
    ) -> None:
        """Args:
        tables: (name, rows, row width in elements of ``dtype``) per table.
        dtype: element type of the stored rows (``wire.NUMPY_DTYPE`` of the version's row dtype).
        """
        size = np.dtype(dtype).itemsize
        total = sum(rows * width * size for _, rows, width in tables) or 1
        self.tables: dict[str, TableCache] = {}
        for name, rows, width in tables:
            share = budget_bytes * (rows * width * size) / total
            capacity = int(min(rows, share // (width * size)))
            if capacity > 0:
                self.tables[name] = TableCache(capacity, width, dtype)
        self.lock = threading.Lock()
        self.epochs: dict[str, int] = {}  # per table: bumped by every invalidation

    def epoch(self, table: str) -> int:
        return self.epochs.get(table, 0)

    def get(
        self, table: str, ids: np.ndarray, tags: np.ndarray | None = None
    ) -> tuple[np.ndarray | None, np.ndarray]:
        """Cached rows of ``ids`` ([n, width] as stored, rows of misses undefined) and the hit mask;
        ``tags`` [n]: a row hits only if it was cached with the same tag (dynamic tables)."""
        cache = self.tables.get(table)
        if cache is None:
            return None, np.zeros(len(ids), dtype=bool)
        with self.lock:
            slots, hit = cache.lookup(ids)
            at = np.maximum(slots, 0)
            if tags is not None:
                hit &= cache.tags[at] == tags
            return cache.rows[at], hit

    def holds(self, tables: list[str], ids: list[int], batch: int) -> bool:
        """Whether the row of id ``ids[f * batch + b]`` of table ``tables[f]`` is cached for every
        feature f and example b (one-hot examples; nothing is marked referenced)."""
        with self.lock:
            for f, name in enumerate(tables):
                cache = self.tables.get(name)
                if cache is None:
                    return False
                slots = cache.slots
                for i in ids[f * batch : (f + 1) * batch]:
                    if i not in slots:
                        return False
        return True

    def gather(
        self, tables: list[str], ids: list[int], out: np.ndarray, columns: list[int]
    ) -> bool:
        """One-hot examples: ``out[b, columns[f]:columns[f + 1]]`` = the cached row of id
        ``ids[f * B + b]`` of table ``tables[f]`` (out [B, sum W] of the rows' or a wider dtype,
        ``columns`` the rows' widths summed); False (``out``
        unspecified) unless every row is cached. One lock, no arrays built per table."""
        batch = out.shape[0]
        found = []
        with self.lock:
            for f, name in enumerate(tables):
                cache = self.tables.get(name)
                if cache is None:
                    return False
                for b in range(batch):
                    slot = cache.slots.get(ids[f * batch + b])
                    if slot is None:
                        return False
                    found.append((cache, slot))
            for k, (cache, slot) in enumerate(found):
                f, b = divmod(k, batch)
                cache.referenced[slot] = True
                out[b, columns[f] : columns[f + 1]] = cache.rows[slot]
        return True

    def put(
        self,
        table: str,
        ids: np.ndarray,
        rows: np.ndarray,
        epoch: int,
        tags: np.ndarray | None = None,
    ) -> None:
        """Cache rows read from the store when the table's epoch was ``epoch``; if rows were
        invalidated since (a live update raced the read), the read may be stale: drop it.
        ``tags`` [n]: the id each row held when read (dynamic tables)."""
        cache = self.tables.get(table)
        if cache is not None and len(ids):
            with self.lock:
                if self.epochs.get(table, 0) == epoch:
                    cache.insert(ids, rows, tags)

    def invalidate(self, table: str, ids: np.ndarray) -> None:
        cache = self.tables.get(table)
        if cache is not None:
            with self.lock:
                self.epochs[table] = self.epochs.get(table, 0) + 1
                cache.invalidate(ids)
