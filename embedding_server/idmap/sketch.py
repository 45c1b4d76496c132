"""A count-min sketch in torch tensors: approximate occurrence counts of raw ids in bounded memory.

``depth`` rows of ``width`` int32 counters; an id adds to one counter per row (each row its own
hash) and its estimate is the smallest of them, never below its true count. Counters halve once
the increments since the last halving reach ``RESET_FACTOR * width`` (TinyLFU's reset), so the
counts
follow the recent stream and the sketch never saturates, whatever the number of distinct ids.

Shape letters: d rows (depth), W counters per row (width), n ids in a call.
"""

from __future__ import annotations

import torch

from embedding_server.idmap.hash_table import mix64

DEPTH = 4
"""Rows (hashes) of a sketch."""
RESET_FACTOR = 2
"""Increments per counter (on average) between two halvings: low, so that collisions add little
to an estimate (TinyLFU's sample is 10x its cache; our sketch is wider instead)."""


def sketch_cells(width: int) -> int:
    """W of a sketch asked for ``width`` counters per row: the next power of two (at least 16)."""
    return 1 << max(4, (width - 1).bit_length())


def sketch_cells_of(ids: torch.Tensor, width: int, depth: int) -> torch.Tensor:
    """Counter of each id in each row of a [depth, width] sketch, flat int64 [d, n]: double
    hashing, h1 + r * h2 from the two 32-bit halves of one mixed hash (Kirsch & Mitzenmacher)."""
    h = mix64(ids, salt=1)
    h1, h2 = h & 0xFFFFFFFF, (h >> 32) | 1  # [n] each
    r = torch.arange(depth, dtype=torch.int64)[:, None]  # [d, 1]
    return ((h1 + r * h2) & (width - 1)) + r * width


class CountMinSketch:
    """Approximate counts of int64 ids.

    Example:
        >>> s = CountMinSketch(width=1024)
        >>> s.add(torch.tensor([5, 9]), torch.tensor([3, 1]))
        (tensor([3, 1], dtype=torch.int32), False)
    """

    def __init__(
        self,
        width: int,
        depth: int = DEPTH,
        counts: torch.Tensor | None = None,
        added: torch.Tensor | None = None,
    ) -> None:
        self.width = sketch_cells(width)  # W, a power of two
        self.depth = depth
        # counts, added: storage to use (views, so that a shard's sketches are updated together).
        # [d, W]
        self.counts = (
            torch.zeros(depth, self.width, dtype=torch.int32) if counts is None else counts
        )
        # increments since the last halving
        self.added = torch.zeros((), dtype=torch.int64) if added is None else added

    def _cells(self, ids: torch.Tensor) -> torch.Tensor:
        """Flat counter index of each id in each row, int64 [d, n]."""
        return sketch_cells_of(ids, self.width, self.depth)

    def estimate(self, ids: torch.Tensor) -> torch.Tensor:
        """Estimated count of each id, int32 [n] (never below the true count since the last
        halving)."""
        return self.counts.view(-1)[self._cells(ids)].amin(dim=0)

    def add(self, ids: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """Add ``counts`` [n] occurrences of distinct ``ids`` [n]; -> (their new estimates [n],
        whether the counters were halved just now)."""
        cells = self._cells(ids)
        flat = self.counts.view(-1)
        flat.scatter_add_(0, cells.reshape(-1), counts.to(torch.int32).repeat(self.depth))
        self.added += counts.sum()
        out = flat[cells].amin(dim=0)
        halve = int(self.added) >= RESET_FACTOR * self.width
        if halve:
            self.counts >>= 1
            self.added.zero_()
        return out, halve

    def state(self) -> dict[str, torch.Tensor]:
        return {"counts": self.counts, "added": self.added}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        self.counts.copy_(state["counts"])
        self.added.copy_(state["added"])
