"""Admission and eviction for a group of id maps at once: one set of tensor ops per step, not a
Python loop per table.

A shard's dynamic tables of equal rows and settings form a group; their maps' state is stacked
(views of the shard's side-by-side buffers, ``remap.py``), and one training step's new ids of every
table of the group are handled together. Each operation keeps the per-table meaning of
:class:`~embedding_server.idmap.dynamic.DynamicIdMap` exactly (the same ids admitted, the same
rows given and freed, in the same order, the same hash-table buckets): the group's key space is
(table, id), every sort is by table first and then by the per-table order, and every "first n" is
counted within a table.

Shape letters: M tables in the group, R rows each (S shared), H hash buckets each, d x W
sketch counters each, n ids in a call (u distinct (table, id) pairs, k candidates).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from embedding_server.idmap.dynamic import (
    COUNTERS,
    EVICT_CHUNK,
    DynamicIdMap,
    has_sketch,
    shared_rows_of,
)
from embedding_server.idmap.fast import bits, sort_distinct, where_true
from embedding_server.idmap.hash_table import EMPTY, TOMBSTONE, mix64, probe
from embedding_server.idmap.native import place as native_place
from embedding_server.idmap.native import rebuild as native_rebuild
from embedding_server.idmap.native import release as native_release
from embedding_server.idmap.native import sketch_add as native_sketch_add
from embedding_server.idmap.native import victims as native_victims
from embedding_server.idmap.sketch import RESET_FACTOR, sketch_cells_of
from embedding_server.idmap.victims import RecentVictims

CLOCK, FREE, ADMITTED, EVICTED = (
    COUNTERS.index(n) for n in ("clock", "free", "admitted", "evicted")
)
NO_KEY = torch.iinfo(torch.int64).max
"""Sort key of rows that may not be evicted."""
NO_INDEX = torch.iinfo(torch.int32).max
"""A bucket no key aims at (the insert's scratch)."""
FEW = 4
"""Victims are chosen by sorting the movable rows when at most 1/FEW of the rows are movable
(lfu's candidates can beat few rows), by a top-k over every row otherwise."""


def ranks_within(groups: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``groups`` int64 [n] sorted ascending: (position of each element within its group [n],
    elements per group [count])."""
    per = torch.bincount(groups, minlength=count)
    start = torch.cumsum(per, 0) - per
    return torch.arange(groups.numel()) - start[groups], per


def _pairs_in_order(ids: torch.Tensor, tables: torch.Tensor, order: torch.Tensor):
    """The distinct (table, id) pairs of ``order`` (a permutation [n] that puts equal pairs next
    to each other), in that order -> (ids [u], tables [u], inverse [n], occurrences [u])."""
    si, st = ids.index_select(0, order), tables.index_select(0, order)
    first = torch.ones_like(si, dtype=torch.bool)
    first[1:] = (si[1:] != si[:-1]) | (st[1:] != st[:-1])
    which = torch.cumsum(first, 0) - 1  # [n] pair of each sorted element
    inverse = torch.empty_like(which).scatter_(0, order, which)
    at = where_true(first)
    return (
        si.index_select(0, at),
        st.index_select(0, at),
        inverse,
        torch.bincount(which, minlength=at.numel()),
    )


def unique_pairs(ids: torch.Tensor, tables: torch.Tensor, count: int):
    """Distinct (table, id) pairs sorted by table, then id -> (ids [u], tables [u], inverse [n],
    occurrences [u])."""
    order = torch.argsort(ids)  # equal pairs may come in any order: their pair is the same
    order = order.index_select(0, torch.argsort(tables.index_select(0, order), stable=True))
    return _pairs_in_order(ids, tables, order)


def table_pairs(ids: torch.Tensor, tables: torch.Tensor, count: int):
    """:func:`unique_pairs` (sorted by table, then id) by numpy's sorts on CPU: a vectorised
    unstable one by id, then a stable (radix, on int16 table numbers) one by table, several times
    cheaper than torch's at a training step's tens of thousands of ids; torch's on other devices
    or past 2^15 tables."""
    if ids.device.type != "cpu" or count > 1 << 15:
        return unique_pairs(ids, tables, count)
    by_id = np.argsort(ids.numpy())  # equal ids may come in any order: their pair is the same
    order = by_id[np.argsort(tables.numpy()[by_id].astype(np.int16), kind="stable")]
    return _pairs_in_order(ids, tables, torch.from_numpy(order.astype(np.int64, copy=False)))


def by_table_then_priority(
    tables: torch.Tensor, priority: torch.Tensor, count: int
) -> torch.Tensor:
    """Order of k candidates by table, then priority descending, then position (``tables`` [k],
    ``priority`` [k] >= 0) -> int64 [k]: one sort of keys packing (table, top - priority,
    position) in bit fields where they fit in int64, else two stable sorts."""
    k = tables.numel()
    top = int(priority.max())
    pb, kb = bits(top), bits(k - 1)
    if bits(count) + pb + kb < 63:
        # distinct keys
        key = (tables << (pb + kb)).bitwise_or_((top - priority) << kb).bitwise_or_(torch.arange(k))
        return sort_distinct(key).bitwise_and_((1 << kb) - 1)
    order = torch.argsort(-priority, stable=True)
    return order.index_select(0, torch.argsort(tables.index_select(0, order), stable=True))


GroupReset = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""reset(tables [a], rows [a], ids [a]): rows of the group's tables given to new ids."""


class MapGroup:
    """M maps of equal rows and settings, stacked.

    Args:
        maps: the group's maps, in order (their storage: views of the buffers below).
        keys, slots: the group's hash buckets side by side, int64 [M * H].
        stacked: the maps' state as [M, ...] views: row_id, used, last, uses [M, R]; free
            [M, R - S]; counters [M, len(COUNTERS)]; table_counts [M, 2]; sketch_counts
            [M, d * W] and sketch_added [M] (when the maps count).
        reset: fresh weights and optimizer state for rows given to new ids.
    """

    def __init__(
        self,
        maps: list[DynamicIdMap],
        keys: torch.Tensor,
        slots: torch.Tensor,
        stacked: dict[str, torch.Tensor],
        reset: GroupReset | None = None,
    ) -> None:
        m0 = maps[0]
        self.maps, self.cfg, self.rows, self.shared = maps, m0.cfg, m0.rows, m0.shared
        # Each map's shared rule (pieces of tables split over servers: ``pieces.py``): hash % S_t -
        # o_t.
        self.shared_total = torch.tensor([m.shared_total for m in maps], dtype=torch.int64)  # [M]
        self.shared_offset = torch.tensor([m.shared_offset for m in maps], dtype=torch.int64)  # [M]
        self.whole = all(m.shared_offset == 0 and m.shared_total == m0.shared for m in maps)
        self.count, self.buckets = len(maps), m0.table.mask + 1
        self.keys, self.slots = keys, slots
        self.s, self.reset = stacked, reset
        self.sketch = m0.sketch if has_sketch(self.cfg) else None
        # [M * H] scratch of _insert
        self.first = torch.full_like(slots, NO_INDEX, dtype=torch.int32)
        # [M * R] the bucket of each row's id, as _insert placed it (a cache, checked before use:
        # -1 or stale after a rebuild or a load; _release then probes for those rows).
        self.bucket_of = torch.full((self.count * self.rows,), -1, dtype=torch.int64)
        # lru / ttl victims from the oldest rows only
        self.recent = RecentVictims(self.count, self.rows)

    def admit(self, ids: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Rows of ids [n] not in their table's map (``tables`` [n]: the table of each, in the
        group): those admitted now get one, the rest their shared row -> int64 [n]."""
        uniq, ut, inverse, counts = unique_pairs(ids, tables, self.count)  # [u] each
        return self.admit_distinct(uniq, ut, counts).index_select(0, inverse)

    def admit_distinct(
        self, uniq: torch.Tensor, ut: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`admit` of distinct pairs (``uniq`` [u] of tables ``ut`` [u], each table's in id
        order; ``counts`` [u]: their occurrences) -> rows int64 [u]."""
        rows = self.local_shared(uniq, ut)  # [u]
        cand, priority = torch.arange(uniq.numel()), counts
        if self.sketch is not None:
            priority = self._count(uniq, ut, counts)
            ok = priority >= self.cfg.admit_after
            cand, priority = cand[ok], priority[ok]
        # by table, then most frequent first (ties: lower id, as torch.unique sorts)
        if cand.numel():
            order = by_table_then_priority(ut.index_select(0, cand), priority, self.count)
            cand, priority = cand.index_select(0, order), priority.index_select(0, order)
            taken, slots = self._admit(
                uniq.index_select(0, cand), ut.index_select(0, cand), priority
            )
            rows.index_copy_(0, cand.index_select(0, taken), slots)
        return rows

    def local_shared(self, ids: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Shared row of each of ids [n] in its map (``tables`` [n], in the group), int64 [n]."""
        if self.whole:
            return shared_rows_of(ids, self.shared)
        return shared_rows_of(
            ids,
            self.shared_total.index_select(0, tables),
            self.shared_offset.index_select(0, tables),
        )

    def _count(self, uniq: torch.Tensor, ut: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Add the occurrences to each table's sketch -> estimates int64 [u]; halve the sketches
        (and use counts) of the tables that reached their reset."""
        width, depth = self.sketch.width, self.sketch.depth
        added = self.s["sketch_added"]
        # [u]
        estimate = native_sketch_add(self.s["sketch_counts"], added, uniq, ut, counts, width, depth)
        if estimate is None:
            cells = sketch_cells_of(uniq, width, depth) + ut * (depth * width)  # [d, u]
            flat = self.s["sketch_counts"].view(-1)  # [M * d * W]
            flat.scatter_add_(0, cells.reshape(-1), counts.to(torch.int32).repeat(depth))
            added.index_add_(0, ut, counts)
            estimate = (
                flat.index_select(0, cells.view(-1)).view(cells.shape).amin(dim=0).to(torch.int64)
            )
        halve = where_true(added >= RESET_FACTOR * width)
        if halve.numel():
            self.s["sketch_counts"][halve] = self.s["sketch_counts"][halve] >> 1
            added[halve] = 0
            self.s["uses"][halve] = self.s["uses"][halve] >> 1
        return estimate

    def _admit(self, ids: torch.Tensor, tables: torch.Tensor, priority: torch.Tensor):
        """Rows for candidates ``ids`` [k] of ``tables`` [k] (by table, most frequent first)
        -> (positions of those admitted [a], their rows [a])."""
        counters, clock = self.s["counters"], int(self.s["counters"][0, CLOCK])
        rank, k_t = ranks_within(tables, self.count)  # [k], [M]
        free_t = counters[:, FREE].clone()  # [M]
        need = where_true(k_t > free_t)  # tables with more candidates than free rows
        if self.cfg.evict == "lfu":
            take = rank < free_t.index_select(0, tables)
            if need.numel():
                # [M] each table's first candidate without a free row
                out = torch.cumsum(k_t, 0) - k_t + free_t
                vt, vrow, vrank = self._victims(
                    need, k_t[need] - free_t[need], clock, below=priority.index_select(0, out[need])
                )
                faced = out.index_select(0, vt) + vrank  # the candidate each victim faces
                used = self.s["uses"].view(-1).index_select(0, vt * self.rows + vrow)
                wins = where_true(priority.index_select(0, faced) > used)
                self._release(vt.index_select(0, wins), vrow.index_select(0, wins))
                take.index_fill_(0, faced.index_select(0, wins), True)
        else:
            if need.numel():
                chunk = (self.rows - self.shared) // EVICT_CHUNK
                vt, vrow, _ = self._victims(
                    need, (k_t[need] - free_t[need]).clamp(min=chunk), clock
                )
                self._release(vt, vrow)
            take = rank < torch.minimum(k_t, counters[:, FREE])[tables]
        taken = where_true(take)  # [a] by table, then rank
        if not taken.numel():
            return taken, taken
        tt = tables.index_select(0, taken)
        j, n_t = ranks_within(tt, self.count)
        free_flat = tt * (self.rows - self.shared) + counters[:, FREE].index_select(0, tt) - 1 - j
        slots = self.s["free"].view(-1).index_select(0, free_flat)  # [a] popped, top first
        counters[:, FREE] -= n_t
        chosen = ids.index_select(0, taken)
        self._insert(chosen, tt, slots, n_t)
        flat = tt * self.rows + slots  # [a] distinct
        self.s["row_id"].view(-1).index_copy_(0, flat, chosen)
        self.s["used"].view(-1).index_fill_(0, flat, True)
        self.s["last"].view(-1).index_fill_(0, flat, clock)
        self.s["uses"].view(-1).index_copy_(0, flat, priority.index_select(0, taken))
        if self.reset is not None:  # fresh weights and optimizer state, every table at once
            self.reset(tt, slots, chosen)
        counters[:, ADMITTED] += n_t
        return taken, slots

    def _victims(
        self, tabs: torch.Tensor, n: torch.Tensor, clock: int, below: torch.Tensor | None = None
    ):
        """Up to n[i] rows of table tabs[i] that the policy frees now, least recent first (lru,
        ttl) or least used, then least recent (lfu); ties: lowest row; ``below`` [len(tabs)]: lfu,
        only rows used fewer times -> (tables [v], rows [v], rank within its table [v])."""
        # movable: last <= top
        top = clock - self.cfg.ttl_steps if self.cfg.evict == "ttl" else clock - 2
        # lru, ttl: from the lists
        if below is None and int(n.max()) < self.rows and self.recent.fits(clock):
            return self.recent.choose(tabs, n, self.s["last"], self.s["used"], top, clock)
        # packed keys fit in int64
        fits = below is None or int(below.max()) * (clock + 2) * self.rows < 1 << 62
        # key (uses, last, row) / (last, row)
        lfu = (clock + 1) * self.rows if below is not None else 0
        if fits:  # in C where it is built
            fast = native_victims(
                self.s["last"],
                self.s["used"],
                self.s["uses"],
                tabs.contiguous(),
                n.contiguous(),
                None if below is None else below.contiguous(),
                top,
                lfu,
            )
            if fast is not None:
                return fast
        every = tabs.numel() == self.count  # tabs is 0..M-1: no copies
        last, used, uses = (
            (self.s[n] if every else self.s[n].index_select(0, tabs))
            for n in ("last", "used", "uses")
        )  # [m, R]
        movable = (last <= top).logical_and_(used)  # lru: this and the previous lookup's rows stay
        if below is not None:
            movable.logical_and_(uses < below[:, None])
            if not fits:
                return self._victims_sorted(tabs, n, movable, last, uses)
        if int(movable.sum()) * FEW <= movable.numel():
            return self._victims_few(tabs, n, movable, last, uses, lfu)
        row = torch.arange(self.rows, dtype=torch.int64)
        key = (last * self.rows).add_(row)  # (last, row), exact below 2^63
        if lfu:
            key.add_(uses, alpha=lfu)
        key = torch.where(movable, key, NO_KEY)  # (2x faster than masked_fill_ on CPU)
        most = min(int(n.max()), self.rows)
        vals, rows = torch.topk(key, most, dim=1, largest=False, sorted=True)  # [m, most]
        keep = (torch.arange(most)[None, :] < n[:, None]) & (vals != NO_KEY)
        ranks = torch.arange(most).expand_as(rows)
        return tabs[:, None].expand_as(rows)[keep], rows[keep], ranks[keep]

    def _victims_few(self, tabs, n, movable, last, uses, lfu: int):
        """:meth:`_victims` where few rows are movable: their keys sorted, not a top-k of every
        row."""
        at = where_true(movable.view(-1))  # [c] movable (table, row), by table
        i = torch.div(at, self.rows, rounding_mode="floor")  # [c] position in tabs
        row = at - i * self.rows
        key = last.reshape(-1).index_select(0, at) * self.rows + row
        if lfu:
            key = uses.reshape(-1).index_select(0, at) * lfu + key
        order = torch.argsort(key)  # keys are distinct within a table
        order = order.index_select(0, torch.argsort(i.index_select(0, order), stable=True))
        i, row = i.index_select(0, order), row.index_select(0, order)
        rank, _ = ranks_within(i, tabs.numel())
        ok = where_true(rank < n.index_select(0, i))
        return (
            tabs.index_select(0, i.index_select(0, ok)),
            row.index_select(0, ok),
            rank.index_select(0, ok),
        )

    def _victims_sorted(self, tabs, n, movable, last, uses):
        """:meth:`_victims` for lfu by stable sorts, where the packed key would overflow."""
        order = torch.argsort(torch.where(movable, last, NO_KEY), dim=1, stable=True)
        score = torch.where(movable, uses, NO_KEY).gather(1, order)
        order = order.gather(1, torch.argsort(score, dim=1, stable=True))
        ok = movable.gather(1, order) & (torch.arange(self.rows)[None, :] < n[:, None])
        ranks = torch.arange(self.rows).expand_as(order)
        return tabs[:, None].expand_as(order)[ok], order[ok], ranks[ok]

    def _release(self, tables: torch.Tensor, rows: torch.Tensor) -> None:
        """Free ``rows`` [v] of ``tables`` [v] (by table): their ids leave the maps, the rows go
        back on the free stacks in this order."""
        if not rows.numel():
            return
        if native_release(
            self.keys,
            self.slots,
            self.s,
            self.bucket_of,
            tables.contiguous(),
            rows.contiguous(),
            self.shared,
            (FREE, EVICTED),
        ):
            return
        pos = self._buckets_of(tables, rows)
        self.slots.index_fill_(0, pos, TOMBSTONE)
        j, r_t = ranks_within(tables, self.count)
        self.s["table_counts"] += torch.stack([-r_t, r_t], 1)
        self.s["used"].view(-1).index_fill_(0, tables * self.rows + rows, False)
        counters = self.s["counters"]
        free_flat = (
            tables * (self.rows - self.shared) + counters[:, FREE].index_select(0, tables) + j
        )
        self.s["free"].view(-1).index_copy_(0, free_flat, rows)
        counters[:, FREE] += r_t
        counters[:, EVICTED] += r_t

    def _buckets_of(self, tables: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Bucket (in ``keys``/``slots``) of the id each of ``rows`` [v] of ``tables`` [v] holds,
        int64 [v]: from :attr:`bucket_of` where that bucket still holds the row's id, else
        probed."""
        flat = tables * self.rows + rows  # [v]
        ids = self.s["row_id"].view(-1).index_select(0, flat)
        pos = self.bucket_of.index_select(0, flat).clamp(min=0)
        ok = (
            (self.slots.index_select(0, pos) == rows)
            & (self.keys.index_select(0, pos) == ids)
            # a live bucket of the id, in its table
            & (torch.div(pos, self.buckets, rounding_mode="floor") == tables)
        )
        stale = where_true(~ok)
        if stale.numel():
            st = tables.index_select(0, stale)
            found = probe(
                self.keys,
                self.slots,
                ids.index_select(0, stale),
                st * self.buckets,
                self.buckets - 1,
            )
            if bool((found < 0).any()):
                raise KeyError("MapGroup: a freed row's id is not in its map")
            pos = pos.index_copy(0, stale, found)
        return pos

    def _insert(
        self, keys: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor, n_t: torch.Tensor
    ) -> None:
        """Add ``keys`` [a] (distinct and absent, by table) with their ``slots`` to the maps'
        hash tables: IdHashTable.insert for every table at once."""
        counts = self.s["table_counts"]  # [M, 2] live, tombstones
        rebuild = where_true((n_t > 0) & (counts.sum(1) + n_t > self.buckets // 2))
        if rebuild.numel():  # the tables whose tombstones piled up: IdHashTable._rebuild of each
            self._rebuild(rebuild)
        self._place(keys, tables, slots)
        counts[:, 0] += n_t

    def _rebuild(self, tabs: torch.Tensor) -> None:
        """Rebuild the hash tables of ``tabs`` [m] from their live keys, re-placed in bucket order
        (as IdHashTable._rebuild does, every table at once; in C where it is built)."""
        if native_rebuild(
            self.keys,
            self.slots,
            tabs,
            self.buckets,
            self.rows,
            self.bucket_of,
            self.s["table_counts"],
        ):
            return
        h = self.buckets
        mine = torch.zeros(self.count, dtype=torch.bool).index_fill_(0, tabs, True)
        live = where_true((self.slots >= 0) & mine.repeat_interleave(h))  # [l] by table, bucket
        keys, slots = self.keys.index_select(0, live), self.slots.index_select(0, live)
        at = (tabs[:, None] * h + torch.arange(h)[None, :]).view(-1)  # [m * H] their buckets
        self.keys.index_fill_(0, at, 0)
        self.slots.index_fill_(0, at, EMPTY)
        counts = self.s["table_counts"]
        counts.index_fill_(0, tabs, 0)
        tables = torch.div(live, h, rounding_mode="floor")
        self._place(keys, tables, slots)
        counts[:, 0] += torch.bincount(tables, minlength=self.count)

    def _place(self, keys: torch.Tensor, tables: torch.Tensor, slots: torch.Tensor) -> None:
        """Put ``keys`` [a] (distinct and absent, by table) with their ``slots`` in free buckets of
        their tables (linear probing; keys aiming at one bucket: the first takes it); tombstones
        reused are counted off. Each round claims buckets in ``slots`` only; the keys, the row ->
        bucket cache and the counts are written once at the end."""
        # in order, in C
        fast = native_place(self.keys, self.slots, keys, tables, slots, self.buckets)
        if fast is not None:
            self._placed(tables, slots, *fast)
            return
        mask = self.buckets - 1
        active = torch.arange(keys.numel())  # [a] keys still looking for a bucket
        # [a] the bucket each tries
        p = (tables * self.buckets).add_(mix64(keys).bitwise_and_(mask))
        placed, at_key, reused = [], [], []
        while active.numel():
            s = self.slots.index_select(0, p)
            free = s < 0
            at = where_true(free)
            # Keys aiming at one free bucket: the first (lowest index) takes it, the rest probe on.
            cand, cp = active.index_select(0, at), p.index_select(0, at)
            first = self.first.scatter_reduce_(0, cp, cand.to(torch.int32), "amin")  # [M * H]
            won = first.index_select(0, cp) == cand
            first.index_fill_(0, cp, NO_INDEX)  # the scratch back as it was
            wi = where_true(won)
            wp, wk = cp.index_select(0, wi), cand.index_select(0, wi)
            self.slots.index_copy_(0, wp, slots.index_select(0, wk))
            placed.append(wp)
            at_key.append(wk)
            reused.append(s.index_select(0, at.index_select(0, wi)) == TOMBSTONE)
            # bucket held by another key: probe on (within its table); lost the race: the same again
            p = torch.where(free, p, (p & ~mask).bitwise_or_((p + 1).bitwise_and_(mask)))
            go = where_true(torch.ones_like(free).index_fill_(0, at.index_select(0, wi), False))
            active, p = active.index_select(0, go), p.index_select(0, go)
        if not placed:
            return
        wp, wk, reused = torch.cat(placed), torch.cat(at_key), torch.cat(reused)
        self.keys.index_copy_(0, wp, keys.index_select(0, wk))
        self._placed(tables.index_select(0, wk), slots.index_select(0, wk), wp, reused)

    def _placed(
        self, tables: torch.Tensor, slots: torch.Tensor, buckets: torch.Tensor, reused: torch.Tensor
    ) -> None:
        """Keys of ``tables`` [a] with ``slots`` [a] now in ``buckets`` [a] (``reused`` [a]: the
        bucket was a tombstone): tombstones counted off, the row -> bucket cache pointed at them."""
        self.s["table_counts"][:, 1] -= torch.bincount(
            tables.masked_select(reused), minlength=self.count
        )
        self.bucket_of.index_copy_(0, (tables * self.rows).add_(slots), buckets)

    def expire(self) -> None:
        """ttl: every ttl_steps lookups, the ids unused for ttl_steps lose their rows."""
        clock = int(self.s["counters"][0, CLOCK])
        if self.cfg.evict == "ttl" and clock % self.cfg.ttl_steps == 0:
            tabs = torch.arange(self.count)
            vt, vrow, _ = self._victims(tabs, torch.full_like(tabs, self.rows), clock)
            self._release(vt, vrow)
