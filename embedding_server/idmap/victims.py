"""lru / ttl victims of a group of maps without ranking every row each step: a sorted list of the
old rows, read from its head.

The victims of table t are its n_t movable rows of smallest (last, row). A refill sorts every
movable row of the group's tables by (table, last, row) once; later steps read each table's list
from its head, skipping the entries no longer true (the row was freed, or used since: ``last``
only ever moves to the current clock, so an entry that stopped matching never matches again).
Every movable row missing from the list was used after the refill, so it is more recent than
every listed row: the first n_t true entries are exactly the n_t rows a full ranking would
choose. A table whose list runs out refills the lists (at most once a lookup). The list is no
part of the map's state: a load forgets it (the next choice refills), checkpoints ignore it.

Bounded memory: the list holds at most one entry per row of the group. The keys pack (table,
last, row) in bit fields, so they are distinct (an unstable sort is exact) and unpacked by shifts.

Shape letters: M tables of the group, R rows each, m tables asked, q entries read.
"""

from __future__ import annotations

import torch

from embedding_server.idmap.fast import bits, sort_distinct, where_true
from embedding_server.idmap.native import take as native_take

READ = 2
"""Entries read per victim needed in a first pass (plus SLACK); a table short of true entries then
reads the rest of its list."""
SLACK = 64


def spans(start: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions start[i] .. start[i] + length[i] - 1 of every i, concatenated -> (positions [q],
    owner i of each [q])."""
    first = torch.cumsum(length, 0) - length  # [m] where each i's run begins
    q = int(first[-1] + length[-1]) if length.numel() else 0
    begins = first[1:]
    mark = torch.zeros(q, dtype=torch.int64).index_add_(
        0, begins[begins < q], torch.ones_like(begins[begins < q])
    )
    # [q] (a run of length 0 owns nothing: the next run's mark counts it)
    owner = torch.cumsum(mark, 0)
    return (start - first).index_select(0, owner).add_(torch.arange(q)), owner


class RecentVictims:
    """The victim lists of a group of ``count`` maps of ``rows`` rows each."""

    def __init__(self, count: int, rows: int) -> None:
        self.count, self.rows = count, rows
        self.forget()

    def forget(self) -> None:
        """Drop the lists (the rows' last uses were loaded): the next choice refills."""
        self.keys = torch.zeros(0, dtype=torch.int64)  # [Q] packed (table, last, row), ascending
        self.head = torch.zeros(self.count, dtype=torch.int64)  # [M] each table's next unread entry
        self.end = torch.zeros(self.count, dtype=torch.int64)  # [M] its list's end
        self.row_bits = bits(self.rows - 1)
        # key = table << (W + B) | last << B | row; clock of the refill
        self.when_bits, self.built = 1, -1

    def fits(self, clock: int) -> bool:
        """Whether packed keys of this clock fit in int64."""
        return bits(self.count) + bits(clock + 1) + self.row_bits < 63

    def choose(
        self,
        tabs: torch.Tensor,
        n: torch.Tensor,
        last: torch.Tensor,
        used: torch.Tensor,
        top: int,
        clock: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Up to n[i] movable rows of table tabs[i] (ascending), least recent first, ties lowest
        row (``last``, ``used`` [M, R]: every table's; movable: used and last <= ``top``) -> (tables
        [v], rows [v], rank within its table [v]), by table then rank. The rows are to be freed."""
        if self.built < 0 or self.built > clock:  # none yet, or an earlier state was loaded
            self._refill(last, used, top, clock)
        got = self._take(tabs, n, last, used, strict=self.built != clock)
        if got is None:  # a list ran out: refill, then the lists hold every movable row
            self._refill(last, used, top, clock)
            got = self._take(tabs, n, last, used, strict=False)
        return got

    def _refill(self, last: torch.Tensor, used: torch.Tensor, top: int, clock: int) -> None:
        b = self.row_bits
        at = where_true((last <= top).logical_and_(used).view(-1))  # [c] movable, by table
        t = torch.div(at, self.rows, rounding_mode="floor")
        self.when_bits = bits(clock + 1)  # last <= top < clock + 1
        packed = (t << (self.when_bits + b)).bitwise_or_(last.view(-1).index_select(0, at) << b)
        self.keys = sort_distinct(packed.bitwise_or_(at - t * self.rows))
        self.end = torch.cumsum(torch.bincount(t, minlength=self.count), 0)
        self.head = torch.cat([torch.zeros(1, dtype=torch.int64), self.end[:-1]])
        self.built = clock

    def _take(self, tabs, n, last, used, strict: bool):
        """The victims from the lists' heads; None where ``strict`` and a list ran out."""
        fast = native_take(
            self.keys,
            self.head,
            self.end,
            tabs.contiguous(),
            n.contiguous(),
            used,
            last,
            self.row_bits,
            self.when_bits,
            strict,
        )
        if fast is not None:  # in C: each list walked from its head
            return None if isinstance(fast, str) else fast
        # [m]
        head, avail = self.head.index_select(0, tabs), (self.end - self.head).index_select(0, tabs)
        read = torch.minimum(avail, n * READ + SLACK)
        while True:
            pos, owner = spans(head, read)  # [q]
            key = self.keys.index_select(0, pos)
            b = self.row_bits
            # [q] last use the entry was listed with
            when = (key >> b) & ((1 << self.when_bits) - 1)
            tab, row = key >> (self.when_bits + b), key & ((1 << b) - 1)  # [q] each
            flat = tab * self.rows + row
            true = (
                used.view(-1)
                .index_select(0, flat)
                .logical_and_(last.view(-1).index_select(0, flat) == when)
            )
            have = torch.zeros_like(n).index_add_(0, owner, true.to(torch.int64))  # [m]
            more = (have < n) & (read < avail)
            if not bool(more.any()):
                break
            read = torch.where(more, avail, read)
        if strict and bool((have < n).any()):
            return None
        before = torch.cumsum(true, 0) - true.to(torch.int64)  # [q] true entries before each
        # [q] within its table
        rank = before - (torch.cumsum(have, 0) - have).index_select(0, owner)
        chosen = where_true(true & (rank < n.index_select(0, owner)))  # [v]
        # Heads move past the last victim (entries before it are victims or no longer true).
        stop = torch.zeros_like(head).scatter_reduce_(
            0,
            owner.index_select(0, chosen),
            pos.index_select(0, chosen) + 1,
            "amax",
            include_self=False,
        )
        stop = torch.where(have >= n, torch.maximum(stop, head), head + read)
        self.head.index_copy_(0, tabs, stop)
        return (
            tab.index_select(0, chosen),
            row.index_select(0, chosen),
            rank.index_select(0, chosen),
        )
