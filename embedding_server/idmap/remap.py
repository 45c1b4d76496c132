"""The dynamic tables of one embedding shard: raw ids of a lookup -> rows, before the kernels.

``EmbeddingShard.forward`` hands every lookup here first; each dynamic table's features have
their raw 64-bit ids replaced by rows, hashed tables' ids pass untouched, and the fused TBE call
then runs on rows as before. The maps' hash tables and row statistics are views into buffers
laid side by side, so the ids of every dynamic table are found, and the known ones' rows
touched, in one probe over the whole batch; the new ids of every table of a group (tables of
equal rows, dim and settings: ``batched.py``) are then admitted, and rows evicted and reset, in
one set of tensor ops, not a loop over the tables.
A lookup with gradients enabled is a training lookup (admits, evicts); one without (evaluation,
serving) only reads.

A row given to a new id starts as a copy of the id's shared row (``start_from_shared``: what the
id read until then), or from :func:`init_for_ids`: uniform(+-bound) drawn from a hash of (seed,
table, id, column). Either way an id's fresh row is the same on whatever shard or row it lands.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dlrm_core.batch import SparseFeatures
from dlrm_core.schema import shared_row_count
from embedding_server.idmap.batched import MapGroup, table_pairs
from embedding_server.idmap.dynamic import (
    COUNTERS,
    DynamicIdMap,
    has_sketch,
    shared_rows_of,
    sketch_width,
)
from embedding_server.idmap.fast import where_true
from embedding_server.idmap.hash_table import EMPTY, _shr, buckets_for, mix64, probe
from embedding_server.idmap.native import find_touch as native_find_touch
from embedding_server.idmap.pieces import PieceLayout
from embedding_server.idmap.sketch import DEPTH, sketch_cells
from embedding_server.local_table import LocalTable

RowReset = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""reset(pieces [k], rows [k], fresh weights [k, D]): row rows[i] of the shard's piece pieces[i]."""
RowRead = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""read(pieces [k], rows [k]) -> the current weights of those rows, float [k, D] (a copy)."""
RowCopy = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
"""copy(pieces [k], src [k], dst [k]): row dst[i] of piece pieces[i] reset as a copy of its row
src[i] (weights; optimizer state as new): ``reset`` of ``read`` in one pass."""


def init_for_ids(
    ids: torch.Tensor, local: LocalTable, seed: int, init_scale: float | None
) -> torch.Tensor:
    """Fresh weights of the piece's columns for ``ids`` [k] -> float [k, D_piece]."""
    where = torch.full_like(ids, local.index), torch.full_like(ids, local.col_start)
    return init_for_pieces(ids, *where, local.spec.dim, local.table.rows, seed, init_scale)


def init_for_pieces(
    ids: torch.Tensor,
    index: torch.Tensor,
    col_start: torch.Tensor,
    dim: int,
    rows: int,
    seed: int,
    init_scale: float | None,
) -> torch.Tensor:
    """:func:`init_for_ids` of ids [k] of several pieces (of tables of equal rows, pieces of
    equal dim): ``index`` [k] the table of each, ``col_start`` [k] its piece's first column."""
    bound = init_scale if init_scale else math.sqrt(1.0 / rows)
    cols = col_start[:, None] + torch.arange(dim, dtype=torch.int64)[None, :]  # [k, D]
    key = mix64(ids, salt=(seed * 1_000_003 + index) * 1_000_003)  # [k]
    bits = mix64(key[:, None] + cols)  # [k, D]
    unit = _shr(bits, 11).to(torch.float64) / float(1 << 53)  # uniform [0, 1)
    return ((unit * 2 - 1) * bound).to(torch.float32)


def _piece_of(local: LocalTable) -> dict[str, int]:
    return {} if local.row_pieces == 1 else {"row_start": local.row_start}


def merge_piece_stats(parts: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """Id-map stats of several shards (table -> counts) -> per table: the pieces of a table split
    by rows added up; a table's column pieces (identical maps) counted once."""
    pieces: dict[tuple[str, int], dict[str, int]] = {}
    for part in parts:
        for name, stats in part.items():
            counts = dict(stats)
            pieces[(name, counts.pop("row_start", 0))] = counts
    out: dict[str, dict[str, int]] = {}
    for (name, _), counts in pieces.items():
        total = out.setdefault(name, dict.fromkeys(counts, 0))
        for k, v in counts.items():
            total[k] += v
    return out


def piece_span(local: LocalTable) -> tuple[int, int, int]:
    """(shared rows S_p, S of the table, first shared index) of a dynamic table's piece: the whole
    table's (S, S, 0) unless it is split by rows (``pieces.py``)."""
    cfg = local.table.dynamic
    if local.row_pieces == 1:
        if local.row_start != 0 or local.spec.rows != local.table.rows:
            raise ValueError(
                f"table {local.table.name}: a piece of rows {local.row_start}..+{local.spec.rows} "
                "of a dynamic table needs its split (LocalTable.row_pieces)"
            )
        s = shared_row_count(local.table.rows, cfg)
        return s, s, 0
    layout = PieceLayout.of(local.table.rows, cfg, local.row_pieces, local.table.name)
    return layout.span(local.row_start, local.table.name)


class ShardIdMaps:
    """Id maps of a shard's dynamic table pieces.

    Args:
        tables: the shard's pieces (only those of dynamic tables get a map; a piece of a
            dynamic table split by rows maps the ids routed to it: ``pieces.py``).
        feature_map: the piece each feature of a lookup reads.
        reset: writes fresh weights and optimizer state into rows of a piece.
        read: reads rows of a piece (the shared rows that admitted ids start from).
        seed, init_scale: as the shard's initialisation.
        copy: resets rows as copies of other rows of their pieces, without the copy between
            (``start_from_shared``); None: ``reset`` of ``read``.
    """

    def __init__(
        self,
        tables: list[LocalTable],
        feature_map: list[int],
        reset: RowReset,
        read: RowRead,
        seed: int = 0,
        init_scale: float | None = None,
        copy: RowCopy | None = None,
    ) -> None:
        self.copy = copy
        self.tables = tables
        mine = [t for t, local in enumerate(tables) if local.table.dynamic is not None]
        # (S_p, S, first shared index) of each
        self.spans = {t: piece_span(tables[t]) for t in mine}
        # Maps of equal rows and settings are admitted together (``batched.py``): order them by
        # group.
        key_of = {
            t: (tables[t].spec.rows, tables[t].spec.dim, tables[t].table.dynamic, self.spans[t][0])
            for t in mine
        }
        kinds = list(dict.fromkeys(key_of.values()))
        mine = sorted(mine, key=lambda t: kinds.index(key_of[t]))
        rows = [tables[t].spec.rows for t in mine]
        shared = [self.spans[t][0] for t in mine]
        buckets = [buckets_for(r - s) for r, s in zip(rows, shared, strict=True)]
        # Side-by-side storage: buckets [sum H_t], row statistics [sum R_t], counters [M, 5].
        self.keys = torch.zeros(sum(buckets), dtype=torch.int64)
        self.slots = torch.full((sum(buckets),), EMPTY, dtype=torch.int64)
        self.last = torch.zeros(sum(rows), dtype=torch.int64)
        self.uses = torch.zeros(sum(rows), dtype=torch.int64)
        self.counters = torch.zeros(len(mine), len(COUNTERS), dtype=torch.int64)
        # [M]
        self.bucket_base = torch.tensor(
            [sum(buckets[:i]) for i in range(len(mine))], dtype=torch.int64
        )
        self.bucket_mask = torch.tensor([h - 1 for h in buckets], dtype=torch.int64)  # [M]
        # every map's, where all are equal
        self.one_mask = buckets[0] - 1 if len(set(buckets)) == 1 else None
        # [M]
        self.row_base = torch.tensor([sum(rows[:i]) for i in range(len(mine))], dtype=torch.int64)
        self.shared = torch.tensor(shared, dtype=torch.int64)  # [M] S_p of each map
        # [M] S of its table
        self.shared_total = torch.tensor([self.spans[t][1] for t in mine], dtype=torch.int64)
        # [M]
        self.shared_offset = torch.tensor([self.spans[t][2] for t in mine], dtype=torch.int64)
        self.maps: dict[int, DynamicIdMap] = {}
        self.groups: list[tuple[int, int, MapGroup]] = []  # (first map, last map + 1, group)
        first = 0
        for kind in kinds:
            members = [t for t in mine if key_of[t] == kind]
            last = first + len(members)
            group = self._group(members, first, buckets[first], reset, read, seed, init_scale)
            self.groups.append((first, last, group))
            first = last
        self.maps = {t: self.maps[t] for t in sorted(self.maps)}
        self.map_list = [self.maps[t] for t in mine]
        number = {t: i for i, t in enumerate(mine)}
        # [F]
        self.map_of_feature = torch.tensor(
            [number.get(t, -1) for t in feature_map], dtype=torch.int64
        )
        self.deferred: list[tuple[Callable, tuple]] | None = None
        """While a remap runs ahead (``ahead.py``): the resets of its fresh rows, in order, applied
        when its lookup comes; None: resets run as the remap makes them."""

    def _group(
        self,
        members: list[int],
        first: int,
        h: int,
        reset: RowReset,
        read: RowRead,
        seed: int,
        init_scale: float | None,
    ) -> MapGroup:
        """The maps of tables ``members`` (equal rows R, dim and settings; maps first.. of the
        shard),
        their state stacked [M, ...] in views of the side-by-side buffers (``h``: H of each)."""
        m, last = len(members), first + len(members)
        local = self.tables[members[0]]
        r, cfg = local.spec.rows, local.table.dynamic
        s = self.spans[members[0]][0]
        h0, r0 = int(self.bucket_base[first]), int(self.row_base[first])
        stacked = {
            "row_id": torch.zeros(m, r, dtype=torch.int64),
            "used": torch.zeros(m, r, dtype=torch.bool),
            "last": self.last[r0 : r0 + m * r].view(m, r),
            "uses": self.uses[r0 : r0 + m * r].view(m, r),
            "free": torch.zeros(m, r - s, dtype=torch.int64),
            "counters": self.counters[first:last],
            "table_counts": torch.zeros(m, 2, dtype=torch.int64),
        }
        width = sketch_cells(sketch_width(r))
        if has_sketch(cfg):
            stacked.update(
                sketch_counts=torch.zeros(m, DEPTH * width, dtype=torch.int32),
                sketch_added=torch.zeros(m, dtype=torch.int64),
            )
        keys, slots = self.keys[h0 : h0 + m * h], self.slots[h0 : h0 + m * h]
        maps = []
        for i, t in enumerate(members):
            views = {k: v[i] for k, v in stacked.items()}
            views.update(keys=keys[i * h : (i + 1) * h], slots=slots[i * h : (i + 1) * h])
            if has_sketch(cfg):
                views["sketch_counts"] = views["sketch_counts"].view(DEPTH, width)
            self.maps[t] = DynamicIdMap(
                r, cfg, self._resetter(t, reset, read, seed, init_scale), views, self.spans[t]
            )
            maps.append(self.maps[t])
        return MapGroup(
            maps, keys, slots, stacked, self._group_resetter(members, reset, read, seed, init_scale)
        )

    def _resetter(
        self, t: int, reset: RowReset, read: RowRead, seed: int, init_scale: float | None
    ):
        """reset(rows [k], ids [k]) of the map of piece t."""
        group = self._group_resetter([t], reset, read, seed, init_scale)
        return lambda rows, ids: group(torch.zeros_like(rows), rows, ids)

    def _group_resetter(
        self,
        members: list[int],
        reset: RowReset,
        read: RowRead,
        seed: int,
        init_scale: float | None,
    ):
        """reset(tables [k], rows [k], ids [k]) of a group of maps (pieces ``members``, of equal
        rows, dim and settings): every fresh row of a step in one read and one write."""
        pieces = torch.tensor(members, dtype=torch.int64)  # [M]
        local = self.tables[members[0]]
        if local.table.dynamic.start_from_shared:
            total = torch.tensor([self.spans[t][1] for t in members], dtype=torch.int64)  # [M]
            offset = torch.tensor([self.spans[t][2] for t in members], dtype=torch.int64)  # [M]

            def fresh(g, rows, ids):
                src = shared_rows_of(ids, total.index_select(0, g), offset.index_select(0, g))
                if self.copy is not None:
                    self.copy(pieces[g], src, rows)
                else:
                    reset(pieces[g], rows, read(pieces[g], src))
        else:
            index = torch.tensor([self.tables[t].index for t in members], dtype=torch.int64)  # [M]
            # [M]
            col_start = torch.tensor([self.tables[t].col_start for t in members], dtype=torch.int64)
            dim, rows = local.spec.dim, local.table.rows

            def fresh(g, r, ids):
                reset(
                    pieces[g],
                    r,
                    init_for_pieces(ids, index[g], col_start[g], dim, rows, seed, init_scale),
                )

        def now_or_deferred(g, rows, ids):
            if self.deferred is None:
                fresh(g, rows, ids)
            else:
                self.deferred.append((fresh, (g, rows, ids)))

        return now_or_deferred

    def __bool__(self) -> bool:
        return bool(self.maps)

    def remap(self, sparse: SparseFeatures, train: bool) -> SparseFeatures:
        """Raw ids of dynamic tables' features -> rows; everything else as it was."""
        f_count, b = self.map_of_feature.numel(), max(sparse.batch_size, 1)
        bounds = sparse.offsets[::b][: f_count + 1]  # [F + 1] each feature's span of values
        # [N], -1: hashed
        map_of_value = torch.repeat_interleave(self.map_of_feature, bounds.diff())
        where = where_true(map_of_value >= 0)  # [M_n] the dynamic tables' values
        ids, k = sparse.values.index_select(0, where), map_of_value.index_select(0, where)  # [M_n]
        if train:
            rows = self._train(ids, k)
        else:  # ids without a row read their shared row
            rows = self._find(ids, k)
            shared = shared_rows_of(
                ids, self.shared_total.index_select(0, k), self.shared_offset.index_select(0, k)
            )
            rows = torch.where(rows >= 0, rows, shared)
        values = sparse.values.clone()
        values.index_copy_(0, where, rows)
        return SparseFeatures(values, sparse.offsets, sparse.batch_size)

    def remap_deferring_resets(
        self, sparse: SparseFeatures
    ) -> tuple[SparseFeatures, list[tuple[Callable, tuple]]]:
        """A training :meth:`remap` whose fresh rows are not reset yet -> (rows, the resets to
        call, in order, once the tables may be written: ``ahead.py``)."""
        self.deferred = []
        try:
            return self.remap(sparse, train=True), self.deferred
        finally:
            self.deferred = None

    def _find(self, ids: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Row of each id [n] in map k [n] of it, int64 [n] (-1: not admitted): one probe of every
        map."""
        mask = self.one_mask if self.one_mask is not None else self.bucket_mask.index_select(0, k)
        return probe(
            self.keys, self.slots, ids, self.bucket_base.index_select(0, k), mask, with_slots=True
        )[1]

    def _train(self, ids: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """One training step of every map on ids [n] (of maps k [n]): touch known rows, admit new
        ids, count, expire -> rows int64 [n]. Known ids are probed and touched as they come
        (repeats add their uses); the absent ones are admitted as distinct (map, id) pairs (u)."""
        clock, default = COUNTERS.index("clock"), COUNTERS.index("default_lookups")
        self.counters[:, clock] += 1
        now = int(self.counters[0, clock])  # every map ticks together
        fast = native_find_touch(
            self.keys,
            self.slots,
            ids,
            k,
            self.bucket_base,
            self.bucket_mask,
            self.row_base,
            self.last,
            self.uses,
            now,
        )
        if fast is not None:  # in C: the probe and the found rows' touch in one pass
            rows, absent = fast
        else:
            rows = self._find(ids, k)  # [n]
            known = where_true(rows >= 0)
            flat = self.row_base.index_select(0, k.index_select(0, known)).add_(
                rows.index_select(0, known)
            )
            self.last.index_fill_(0, flat, now)
            self.uses.index_add_(0, flat, torch.ones_like(flat))
            absent = where_true(rows < 0)
        if absent.numel():
            uid, uk, inverse, counts = table_pairs(
                ids.index_select(0, absent), k.index_select(0, absent), len(self.map_list)
            )  # [u] by map, then id
            got = torch.empty_like(uid)
            ends = torch.searchsorted(uk, torch.tensor([b for _, b, _ in self.groups])).tolist()
            start = 0
            # every table of a group at once
            for (first, _, group), end in zip(self.groups, ends, strict=True):
                if end > start:
                    got[start:end] = group.admit_distinct(
                        uid[start:end], uk[start:end] - first, counts[start:end]
                    )
                start = end
            rows.index_copy_(0, absent, got.index_select(0, inverse))
        shared = rows < self.shared.index_select(0, k)
        self.counters[:, default] += torch.bincount(
            k.masked_select(shared), minlength=len(self.map_list)
        )
        for _, _, group in self.groups:
            group.expire()
        return rows

    def stats(self) -> dict[str, dict[str, int]]:
        """Per dynamic table: rows_used, admitted, evicted, default_lookups; a piece of a table
        split by rows also its first row, ``row_start`` (``merge_piece_stats`` adds pieces up)."""
        return {
            self.tables[t].table.name: {**m.stats(), **_piece_of(self.tables[t])}
            for t, m in self.maps.items()
        }

    def id_rows(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per dynamic table: (admitted ids sorted, their rows)."""
        return {self.tables[t].table.name: m.items() for t, m in self.maps.items()}

    def owners(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per dynamic table: (row_id int64 [R], used bool [R]) views: the id each row holds
        where ``used`` (what live updates compare between pushes)."""
        return {self.tables[t].table.name: (m.row_id, m.used) for t, m in self.maps.items()}

    def state(self) -> dict[str, torch.Tensor]:
        """``<table>.idmap.<name>`` -> tensor (views), for the shard's export_state."""
        return {
            f"{self.tables[t].table.name}.idmap.{k}": v
            for t, m in self.maps.items()
            for k, v in m.state().items()
        }

    def load(self, state: dict[str, torch.Tensor]) -> None:
        for t, m in self.maps.items():
            prefix = f"{self.tables[t].table.name}.idmap."
            m.load({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)})
        for _, _, group in self.groups:  # the rows' last uses changed under the victim lists
            group.recent.forget()
