"""A published dynamic table's id map as serving reads it, and the changes live updates carry.

A version's map is a *base* (admitted ids sorted, their rows; written at publish) and an
*overlay* of the ids changed since (sorted ids, their rows now, -1: the id lost its row). A
lookup ``searchsorted``s the overlay first, then the base; an overlay entry wins. Each live push
carries one :class:`IdMapDelta` per dynamic table: the overlay of the ids admitted and evicted
since the previous push, and the slots whose owner changed (``slots``, ``owners``: the id each
holds now, NO_OWNER: none). Merging a delta into an overlay costs O(k + c) (k overlay entries, c
changes); once the overlay passes :func:`compact_at` entries it is folded into the base (O(n)),
so the overlay stays below n / 8 + 1024 entries and folding costs O(1) per change amortised.

Owners guard readers against a map that lags the rows: a slot freed from id X and given to id Y
is rewritten with Y's row while a replica may still map X to it; readers check that the slot's
owner, read with (or after) the row, is the id they looked up, and serve the id its shared row
otherwise (:mod:`api.lookup`).

Shape letters: n base entries, k overlay entries, c changes of a delta, R rows of the table.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dlrm_core.ids import RESERVED_ID

NO_OWNER = RESERVED_ID
"""Owner of a slot that holds no admitted id (a shared row, a free row). No raw id is ever this
one: featurizing reads those 64 bits as the next id (``dlrm_core.ids.RESERVED_ID``), so a
key never passes for "none" (a Redis owner never written reads as -1, another id's)."""


@dataclass
class IdMapDelta:
    """One dynamic table's map changes of a live push.

    Attributes:
        ids: ids whose row changed, int64 [c] sorted, distinct.
        rows: each one's row now, int64 [c]; -1: evicted (serve its shared row).
        slots: rows whose owner changed, int64 [s] distinct.
        owners: the id each of ``slots`` holds now, int64 [s]; NO_OWNER: none (freed).
    """

    ids: np.ndarray
    rows: np.ndarray
    slots: np.ndarray
    owners: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def then(self, later: IdMapDelta) -> IdMapDelta:
        """This delta followed by ``later`` (a failed push merged into the next one)."""
        ids, rows = merge_overlay(self.ids, self.rows, later.ids, later.rows)
        slots, owners = _later_wins(self.slots, self.owners, later.slots, later.owners)
        return IdMapDelta(ids, rows, slots, owners)

    def to_bytes(self) -> bytes:
        """int64 little-endian: c, s, ids, rows, slots, owners."""
        head = np.array([len(self.ids), len(self.slots)], dtype="<i8")
        parts = (head, self.ids, self.rows, self.slots, self.owners)
        return b"".join(np.ascontiguousarray(p, dtype="<i8").tobytes() for p in parts)

    @classmethod
    def from_bytes(cls, blob: bytes) -> IdMapDelta:
        a = np.frombuffer(blob, dtype="<i8").astype(np.int64)
        c, s = int(a[0]), int(a[1])
        return cls(
            a[2 : 2 + c],
            a[2 + c : 2 + 2 * c],
            a[2 + 2 * c : 2 + 2 * c + s],
            a[2 + 2 * c + s : 2 + 2 * c + 2 * s],
        )


def _later_wins(a_keys: np.ndarray, a_vals: np.ndarray, b_keys: np.ndarray, b_vals: np.ndarray):
    """Union of two maps (keys distinct within each), ``b``'s value where both hold a key ->
    (keys sorted [m], values [m])."""
    keys = np.concatenate([b_keys, a_keys]).astype(np.int64)
    vals = np.concatenate([b_vals, a_vals]).astype(np.int64)
    keys, first = np.unique(keys, return_index=True)  # the first occurrence: b's
    return keys, vals[first]


def merge_overlay(ids: np.ndarray, rows: np.ndarray, new_ids: np.ndarray, new_rows: np.ndarray):
    """Overlay (ids sorted, rows) updated by a newer one -> (ids sorted, rows): O(k + c)."""
    if not len(new_ids):
        return ids, rows
    if not len(ids):
        return np.asarray(new_ids, np.int64), np.asarray(new_rows, np.int64)
    return _later_wins(ids, rows, new_ids, new_rows)


def fold(base_ids: np.ndarray, base_rows: np.ndarray, over_ids: np.ndarray, over_rows: np.ndarray):
    """The base with the overlay applied, evicted ids dropped -> (ids sorted [n'], rows [n'])."""
    ids, rows = merge_overlay(base_ids, base_rows, over_ids, over_rows)
    keep = rows >= 0
    return ids[keep], rows[keep]


def compact_at(base_entries: int) -> int:
    """Overlay entries past which a store or a reader folds the overlay into the base."""
    return base_entries // 8 + 1024


def owners_of(rows: int, ids: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Owner of every row of a table from its map: int64 [R], NO_OWNER where no id holds the row."""
    owner = np.full(rows, NO_OWNER, dtype=np.int64)
    owner[np.asarray(slots, np.int64)] = ids
    return owner


def find(ids: np.ndarray, rows: np.ndarray, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Look ``raw`` [m] up in a sorted map -> (found bool [m], row int64 [m], undefined where not
    found)."""
    if not len(ids):
        return np.zeros(len(raw), bool), np.zeros(len(raw), np.int64)
    at = np.minimum(np.searchsorted(ids, raw), len(ids) - 1)
    return ids[at] == raw, rows[at]


class IdMapView:
    """A serving replica's map of one dynamic table: base and overlay, swapped as one tuple, so a
    lookup running while a delta lands sees the map before or after it, never half of it."""

    def __init__(
        self,
        base_ids: np.ndarray,
        base_rows: np.ndarray,
        over_ids: np.ndarray | None = None,
        over_rows: np.ndarray | None = None,
    ) -> None:
        empty = np.zeros(0, np.int64)
        self._parts = (
            np.asarray(base_ids, np.int64),
            np.asarray(base_rows, np.int64),
            empty if over_ids is None else np.asarray(over_ids, np.int64),
            empty if over_rows is None else np.asarray(over_rows, np.int64),
        )

    @property
    def overlay_entries(self) -> int:
        return len(self._parts[2])

    def lookup(self, raw: np.ndarray) -> np.ndarray:
        """Row of each raw id [m], int64; -1 where the map holds no row for it."""
        base_ids, base_rows, over_ids, over_rows = self._parts
        in_over, over = find(over_ids, over_rows, raw)
        in_base, base = find(base_ids, base_rows, raw)
        return np.where(in_over, over, np.where(in_base, base, -1))

    def apply(self, delta: IdMapDelta) -> None:
        """Merge a live push's changes (O(k + c); folds into the base past :func:`compact_at`)."""
        base_ids, base_rows, over_ids, over_rows = self._parts
        over_ids, over_rows = merge_overlay(over_ids, over_rows, delta.ids, delta.rows)
        if len(over_ids) > compact_at(len(base_ids)):
            base_ids, base_rows = fold(base_ids, base_rows, over_ids, over_rows)
            over_ids = over_rows = np.zeros(0, np.int64)
        self._parts = (base_ids, base_rows, over_ids, over_rows)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids sorted, rows) of every id the map holds a row for."""
        return fold(*self._parts)
