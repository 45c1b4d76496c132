"""A vectorised open-addressing hash table in torch tensors: raw 64-bit ids -> slots.

Linear probing over ``H`` buckets (a power of two, at least three times the slots, so the live
load stays at or below one third and probe chains stay short). Every operation works on a whole
batch of keys at once: each probe
round gathers the bucket of every key still unresolved and moves the unresolved ones one bucket
on, so a batch costs (longest probe) rounds of tensor ops, never a Python loop per id.

Buckets hold a key and a slot; slot -1 is empty, -2 a tombstone (a deleted key: lookups probe
past it, inserts reuse it). When live keys plus tombstones pass half of the buckets the table
is rebuilt from its live keys.

Shape letters: H buckets, n keys in a call.
"""

from __future__ import annotations

import torch

from embedding_server.idmap.fast import where_true
from embedding_server.idmap.native import place as native_place
from embedding_server.idmap.native import probe as native_probe

EMPTY, TOMBSTONE = -1, -2
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(ids: torch.Tensor, salt: int | torch.Tensor = 0) -> torch.Tensor:
    """splitmix64's finaliser of ``ids + salt``: int64 [n] -> well-mixed int64 [n] (wrapping
    arithmetic, the same on every machine)."""
    x = ids + (_GOLDEN + salt)  # a new tensor: the rest is in place
    x.bitwise_xor_((x >> 30).bitwise_and_((1 << 34) - 1)).mul_(_M1)
    x.bitwise_xor_((x >> 27).bitwise_and_((1 << 37) - 1)).mul_(_M2)
    return x.bitwise_xor_((x >> 31).bitwise_and_((1 << 33) - 1))


def buckets_for(capacity: int) -> int:
    """H of a table of ``capacity`` keys: a power of two, at least three times the capacity."""
    return 1 << max(4, (3 * max(1, capacity) - 1).bit_length())


def probe(
    keys: torch.Tensor,
    slots: torch.Tensor,
    ids: torch.Tensor,
    base: torch.Tensor | int,
    mask: torch.Tensor | int,
    with_slots: bool = False,
):
    """Bucket of each id in ``keys``/``slots`` [H], int64 [n] (-1: absent). Id i probes buckets
    base_i + ((home + k) & mask_i): several tables laid side by side in one buffer are searched
    in one call (``base``, ``mask``: per id, or one int for a single table). ``with_slots``:
    -> (buckets [n], the slot of each id [n], -1: absent). In C where it is built
    (``native.py``)."""
    fast = native_probe(keys, slots, ids, base, mask, with_slots)
    if fast is not None:
        return fast
    pos = (mix64(ids) & mask) + base  # [n] home buckets
    s = slots.index_select(0, pos)  # index_select: far cheaper than x[index] on CPU
    # the first round over every id, most end here
    hit = (s >= 0).logical_and_(keys.index_select(0, pos) == ids)
    out = torch.where(hit, pos, -1)
    found = torch.where(hit, s, -1) if with_slots else None
    active = where_true(hit.logical_not_().logical_and_(s != EMPTY))  # [a] ids still probing
    p, a_ids = pos.index_select(0, active), ids.index_select(0, active)  # [a] each
    a_base = base.index_select(0, active) if isinstance(base, torch.Tensor) else base
    a_mask = mask.index_select(0, active) if isinstance(mask, torch.Tensor) else mask
    while active.numel():
        p = a_base + ((p - a_base + 1) & a_mask)  # the next bucket of the id's own table
        s = slots.index_select(0, p)
        hit = (s >= 0) & (keys.index_select(0, p) == a_ids)
        if bool(hit.any()):
            at = where_true(hit)
            out.index_copy_(0, active.index_select(0, at), p.index_select(0, at))
            if found is not None:
                found.index_copy_(0, active.index_select(0, at), s.index_select(0, at))
        go = where_true(~hit & (s != EMPTY))  # past a tombstone or another key: probe on
        active, p, a_ids = (
            active.index_select(0, go),
            p.index_select(0, go),
            a_ids.index_select(0, go),
        )
        if isinstance(a_base, torch.Tensor):
            a_base = a_base.index_select(0, go)
        if isinstance(a_mask, torch.Tensor):
            a_mask = a_mask.index_select(0, go)
    return (out, found) if with_slots else out


class IdHashTable:
    """Keys (raw ids, int64) -> slots (int64 >= 0), at most ``capacity`` live keys.

    Args:
        capacity: the most live keys.
        keys, slots: storage of ``buckets_for(capacity)`` buckets to use (views into a larger
            buffer, so that a shard's tables are probed together); default: its own.

    Example:
        >>> t = IdHashTable(4)
        >>> t.insert(torch.tensor([7, -3]), torch.tensor([1, 2]))
        >>> t.find(torch.tensor([-3, 5, 7]))
        tensor([ 2, -1,  1])
    """

    def __init__(
        self,
        capacity: int,
        keys: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
        counts: torch.Tensor | None = None,
    ) -> None:
        size = buckets_for(capacity)
        self.mask = size - 1
        self.keys = torch.zeros(size, dtype=torch.int64) if keys is None else keys  # [H]
        # [H]
        self.slots = torch.full((size,), EMPTY, dtype=torch.int64) if slots is None else slots
        # [2] live, tombstones
        self.counts = torch.zeros(2, dtype=torch.int64) if counts is None else counts

    @property
    def live(self) -> int:
        """Keys held."""
        return int(self.counts[0])

    @live.setter
    def live(self, value: int) -> None:
        self.counts[0] = value

    @property
    def tombstones(self) -> int:
        """Deleted buckets not yet reused."""
        return int(self.counts[1])

    @tombstones.setter
    def tombstones(self, value: int) -> None:
        self.counts[1] = value

    def _home(self, keys: torch.Tensor) -> torch.Tensor:
        return mix64(keys) & self.mask

    def positions(self, keys: torch.Tensor) -> torch.Tensor:
        """Bucket of each key, int64 [n]; -1 where the key is absent."""
        return probe(self.keys, self.slots, keys, 0, self.mask)

    def find(self, keys: torch.Tensor) -> torch.Tensor:
        """Slot of each key, int64 [n]; -1 where the key is absent."""
        pos = self.positions(keys)
        found = pos >= 0
        return torch.where(found, self.slots[pos.clamp(min=0)], torch.full_like(pos, -1))

    def insert(self, keys: torch.Tensor, slots: torch.Tensor) -> None:
        """Add ``keys`` (distinct, all absent) with their ``slots``."""
        if self.live + self.tombstones + keys.numel() > (self.mask + 1) // 2:
            self._rebuild()
        # in order, in C
        fast = native_place(self.keys, self.slots, keys, None, slots, self.mask + 1)
        if fast is not None:
            self.tombstones -= int(fast[1].sum())
            self.live += keys.numel()
            return
        pos = self._home(keys)
        active = torch.arange(keys.numel())
        while active.numel():
            p = pos[active]
            free = self.slots[p] < 0
            # Keys aiming at one free bucket: the first (lowest index) takes it, the rest probe on.
            cand, cp = active[free], p[free]
            buckets, inverse = torch.unique(cp, return_inverse=True)
            first = torch.full_like(buckets, keys.numel()).scatter_reduce_(0, inverse, cand, "amin")
            won = first[inverse] == cand
            wp, wk = cp[won], cand[won]
            self.tombstones -= int((self.slots[wp] == TOMBSTONE).sum())
            self.keys[wp], self.slots[wp] = keys[wk], slots[wk]
            taken = torch.zeros(keys.numel(), dtype=torch.bool)
            taken[wk] = True
            moved = active[~free]  # bucket held by another key: probe on
            pos[moved] = (pos[moved] + 1) & self.mask
            active = active[~taken[active]]
        self.live += keys.numel()

    def delete(self, keys: torch.Tensor) -> None:
        """Remove ``keys`` (distinct, all present)."""
        pos = self.positions(keys)
        if bool((pos < 0).any()):
            raise KeyError("IdHashTable.delete: a key is absent")
        self.slots[pos] = TOMBSTONE
        self.live -= keys.numel()
        self.tombstones += keys.numel()

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, slots) of every live entry, in bucket order."""
        live = self.slots >= 0
        return self.keys[live], self.slots[live]

    def _rebuild(self) -> None:
        keys, slots = self.items()
        self.keys.zero_()
        self.slots.fill_(EMPTY)
        self.live = self.tombstones = 0
        if keys.numel():
            self.insert(keys, slots)

    def state(self) -> dict[str, torch.Tensor]:
        """The buckets and counters as tensors (views), for checkpoints."""
        return {"keys": self.keys, "slots": self.slots, "counts": self.counts}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.keys.copy_(state["keys"])
        self.slots.copy_(state["slots"])
        self.counts.copy_(state["counts"])
