"""One dynamic table's id map: raw 64-bit ids -> rows, with admission and eviction.

Rows 0..S-1 are the table's shared rows (S from ``shared_rows``): an id not (yet) admitted
reads and trains shared row hash(id) % S (:func:`shared_rows_of`), so the tail scatters over S
rows instead of piling on one. Rows S..R-1 each hold one admitted id while it keeps its row. A
training lookup, on the batch's distinct
ids at once:

    known ids      -> their rows; last use and use count updated
    new ids        -> counted in a count-min sketch; those seen ``admit_after`` times are
                      admitted (most frequent first) into free rows
    no free rows   -> lru / ttl free rows (least recent / expired), in chunks of 1/64 of the
                      table; lfu (TinyLFU) lets a candidate replace the least used row only if
                      the sketch has seen it more often than that row was used;
                      rows used by this or the previous lookup never go (their gradients may not
                      have been applied yet: pipelined and semi-synchronous servers)
    a row reused   -> ``reset(rows, ids)`` re-initialises its weights and optimizer state first

An evaluation (or serving) lookup only reads: unknown ids get their shared row and nothing changes.
Every structure has a fixed size (capacity R, sketch width W), so memory is bounded whatever the
number of distinct ids, and the whole state is a handful of tensors (checkpoints).

Shape letters: R rows of the table (S shared), n ids in a call (u distinct).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dlrm_core.schema import DynamicIds, shared_row_count
from embedding_server.idmap.hash_table import IdHashTable, mix64
from embedding_server.idmap.sketch import CountMinSketch

EVICT_CHUNK = 64
"""When the table is full, at least 1/EVICT_CHUNK of its rows are freed at once (amortises the
O(R) choice of victims over many admissions)."""
COUNTERS = ("clock", "free", "admitted", "evicted", "default_lookups")
"""The map's scalar state: training lookups so far, free rows, ids admitted and evicted so far,
lookups (occurrences) that read the default row."""


def sketch_width(rows: int) -> int:
    """Counters per sketch row: twice the table's rows, within [2^16, 2^20] (wide enough that the
    counts of a table's candidates are not drowned in collisions; 16 MB at most)."""
    return min(max(2 * rows, 1 << 16), 1 << 20)


def has_sketch(cfg: DynamicIds) -> bool:
    """Whether a map counts occurrences (admission after more than one, or lfu's comparisons)."""
    return cfg.admit_after > 1 or cfg.evict == "lfu"


SHARED_SALT = 2
"""Salt of the hash that picks an id's shared row (independent of the hash table's and the
sketch's)."""


def shared_rows_of(
    ids: torch.Tensor, shared: torch.Tensor | int, offset: torch.Tensor | int = 0
) -> torch.Tensor:
    """Shared row of each raw id, int64 [n]: hash(id) % S - ``offset`` (``shared``: S, and
    ``offset``: the first shared index of the piece the ids are routed to, ``pieces.py``; one
    int or one per id). Training, evaluation and serving all map ids without a row through this."""
    rows = torch.remainder(mix64(ids, salt=SHARED_SALT), shared)
    return rows.sub_(offset) if isinstance(offset, torch.Tensor) or offset else rows


Reset = Callable[[torch.Tensor, torch.Tensor], None]
"""reset(rows int64 [k], ids int64 [k]): fresh weights and optimizer state for rows given to ids."""


class DynamicIdMap:
    """Raw ids -> rows of one table of ``rows`` rows (the first S shared).

    Args:
        rows: R, the table's rows (its capacity: R - S ids, plus the S shared rows).
        cfg: admission and eviction settings.
        reset: called with the rows (and their new ids) about to be reused.
        span: a piece of a table split over servers (``pieces.py``): (its shared rows S_p, the
            table's S, its first shared index o): its ids' shared row is hash(id) % S - o;
            None: a whole table, S = ``shared_row_count``.

    Example:
        >>> m = DynamicIdMap(4, DynamicIds(admit_after=2, shared_rows=0))  # S = 1: row 0
        >>> m.lookup(torch.tensor([10, 11, 10]), train=True)  # 10 seen twice: admitted
        tensor([1, 0, 1])
    """

    def __init__(
        self,
        rows: int,
        cfg: DynamicIds,
        reset: Reset | None = None,
        storage: dict[str, torch.Tensor] | None = None,
        span: tuple[int, int, int] | None = None,
    ) -> None:
        self.rows, self.cfg, self.reset = rows, cfg, reset
        whole = shared_row_count(rows, cfg)
        # S_p, S, o
        self.shared, self.shared_total, self.shared_offset = (
            span if span is not None else (whole, whole, 0)
        )
        # storage: views to use (of a shard's maps laid side by side, ``remap.py``), fresh and zero.
        views = storage or {}
        self.table = IdHashTable(
            rows - self.shared, views.get("keys"), views.get("slots"), views.get("table_counts")
        )
        self.sketch = (
            CountMinSketch(
                sketch_width(rows),
                counts=views.get("sketch_counts"),
                added=views.get("sketch_added"),
            )
            if has_sketch(cfg)
            else None
        )
        # [R] the id each row holds
        self.row_id = views.get("row_id", torch.zeros(rows, dtype=torch.int64))
        # [R] shared rows are never "used" by an id
        self.used = views.get("used", torch.zeros(rows, dtype=torch.bool))
        # [R] clock of the last training use
        self.last = views.get("last", torch.zeros(rows, dtype=torch.int64))
        # [R] training lookups since admission
        self.uses = views.get("uses", torch.zeros(rows, dtype=torch.int64))
        # [R - S] stack, top last
        self.free = views.get("free", torch.empty(rows - self.shared, dtype=torch.int64))
        self.free.copy_(torch.arange(rows - 1, self.shared - 1, -1, dtype=torch.int64))
        self.counters = views.get("counters", torch.zeros(len(COUNTERS), dtype=torch.int64))
        self.counters[COUNTERS.index("free")] = rows - self.shared

    def _get(self, name: str) -> int:
        return int(self.counters[COUNTERS.index(name)])

    def _add(self, name: str, value: int) -> None:
        self.counters[COUNTERS.index(name)] += value

    @property
    def ids_held(self) -> int:
        return self.rows - self.shared - self._get("free")

    def lookup(self, ids: torch.Tensor, train: bool) -> torch.Tensor:
        """Row of each raw id, int64 [n]; a training lookup admits and evicts (one step)."""
        rows = self.table.find(ids)  # [n], -1: not admitted
        if not train:
            return torch.where(rows >= 0, rows, self.local_shared(ids))
        self._add("clock", 1)
        known = rows >= 0
        self.touch(rows[known])
        if not bool(known.all()):
            rows[~known] = self.admit(ids[~known])
        self._add("default_lookups", int((rows < self.shared).sum()))
        self.end_step()
        return rows

    def local_shared(self, ids: torch.Tensor) -> torch.Tensor:
        """The shared row of each of ids [n] (routed to this piece), int64 [n] in [0, S)."""
        return shared_rows_of(ids, self.shared_total, self.shared_offset)

    def touch(self, rows: torch.Tensor) -> None:
        """Rows [k] (repeats counted) used by this training lookup (the clock already ticked)."""
        self.last[rows] = self.counters[COUNTERS.index("clock")]
        self.uses.index_add_(0, rows, torch.ones_like(rows))

    def admit(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ids [n] not in the map: those admitted now get one, the rest their shared row ->
        int64 [n]."""
        uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)  # [u]
        rows = self.local_shared(uniq)  # [u]
        new, priority = torch.arange(uniq.numel()), counts
        if self.sketch is not None:
            estimate, halved = self.sketch.add(uniq, counts)
            if halved:  # use counts stay on the sketch's scale (lfu compares them)
                self.uses >>= 1
            priority = estimate.to(torch.int64)
            ok = priority >= self.cfg.admit_after
            new, priority = new[ok], priority[ok]
        if new.numel():
            order = torch.argsort(priority, descending=True, stable=True)  # most frequent first
            new, priority = new[order], priority[order]
            taken, slots = self._admit(uniq[new], priority)
            rows[new[taken]] = slots
        return rows[inverse]

    def end_step(self) -> None:
        """ttl: every ttl_steps lookups, the ids unused for ttl_steps lose their rows."""
        clock = self._get("clock")
        if self.cfg.evict == "ttl" and clock % self.cfg.ttl_steps == 0:
            self._release(self._victims(self.rows, clock))

    def _admit(
        self, ids: torch.Tensor, priority: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for candidates ``ids`` [k], most frequent first (``priority`` [k]: their counts);
        -> (positions of those admitted, their rows)."""
        k, free, clock = ids.numel(), self._get("free"), self._get("clock")
        take = torch.arange(min(k, free))
        if k > free and self.cfg.evict == "lfu":
            # TinyLFU: the i-th most frequent candidate replaces the i-th least used row only if
            # it was seen more often; a full table of frequent ids is not churned by the tail.
            victims = self._victims(k - free, clock, below=int(priority[free]))
            rest = torch.arange(free, free + victims.numel())
            wins = priority[rest] > self.uses[victims]
            self._release(victims[wins])
            take = torch.cat([take, rest[wins]])
        elif k > free:
            self._release(
                self._victims(max(k - free, (self.rows - self.shared) // EVICT_CHUNK), clock)
            )
            take = torch.arange(min(k, self._get("free")))
        n, top = take.numel(), self._get("free")
        if n == 0:
            return take, take
        slots = self.free[top - n : top].flip(0)  # [n], popped
        self._add("free", -n)
        chosen = ids[take]
        self.table.insert(chosen, slots)
        self.row_id[slots], self.used[slots] = chosen, True
        self.last[slots], self.uses[slots] = clock, priority[take]
        if self.reset is not None:
            self.reset(slots, chosen)
        self._add("admitted", n)
        return take, slots

    def _victims(self, n: int, clock: int, below: int | None = None) -> torch.Tensor:
        """Up to ``n`` rows the policy frees now, int64 [<= n]; ``below``: only rows used fewer
        times (lfu: rows no candidate could beat are not worth sorting)."""
        if self.cfg.evict == "ttl":
            movable = self.used & (self.last <= clock - self.cfg.ttl_steps)
        else:
            # this and the previous lookup's rows stay
            movable = self.used & (self.last < clock - 1)
        if below is not None:
            movable &= self.uses < below
        score = self.uses if self.cfg.evict == "lfu" else self.last
        candidates = torch.nonzero(movable).squeeze(1)
        # Least recent (lru, ttl) / least used, then least recent (lfu); ties: lowest row.
        order = torch.argsort(self.last[candidates], stable=True)
        if self.cfg.evict == "lfu":
            order = order[torch.argsort(score[candidates][order], stable=True)]
        return candidates[order[:n]]

    def _release(self, rows: torch.Tensor) -> None:
        """Free ``rows``: their ids leave the map, the rows go back on the free stack."""
        if not rows.numel():
            return
        self.table.delete(self.row_id[rows])
        self.used[rows] = False
        top = self._get("free")
        self.free[top : top + rows.numel()] = rows
        self._add("free", rows.numel())
        self._add("evicted", rows.numel())

    # -- inspection and state ----------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """rows_used (admitted ids plus the shared rows), admitted, evicted, default_lookups
        (lookups that read a shared row)."""
        return {
            "rows_used": self.ids_held + self.shared,
            "admitted": self._get("admitted"),
            "evicted": self._get("evicted"),
            "default_lookups": self._get("default_lookups"),
        }

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, rows) of every admitted id, sorted by id: what serving searches."""
        keys, rows = self.table.items()
        order = torch.argsort(keys)
        return keys[order], rows[order]

    def state(self) -> dict[str, torch.Tensor]:
        """Every tensor of the map, by name (views), for checkpoints; fixed shapes."""
        out = {f"table.{k}": v for k, v in self.table.state().items()}
        if self.sketch is not None:
            out.update({f"sketch.{k}": v for k, v in self.sketch.state().items()})
        out.update(
            row_id=self.row_id,
            used=self.used,
            last=self.last,
            uses=self.uses,
            free=self.free,
            counters=self.counters,
        )
        return out

    def load(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`state` returned (of a map of the same rows and settings)."""
        self.table.load({k[6:]: v for k, v in state.items() if k.startswith("table.")})
        if self.sketch is not None:
            self.sketch.load({k[7:]: v for k, v in state.items() if k.startswith("sketch.")})
        for name in ("row_id", "used", "last", "uses", "free", "counters"):
            getattr(self, name).copy_(state[name])
