"""The Redis store's row layout: each table in fixed-size blocks of rows, one string key a block.

Block ``b`` of a table holds rows ``[b * R, (b + 1) * R)`` as stored (``wire.encode_rows``),
back to back, ``R = block_rows(row bytes)``: as many rows as fit in ``BLOCK_BYTES``, so that a
block with its string header fills one 16 KiB allocation of Redis's allocator (jemalloc) and a
key's own overhead (dict entry, object, key name: ~100 B) is spread over a block: memory per row
stays within a few percent of the payload (one hash field per row cost 2x: 131 B a 64-byte row).

A row that is not in the store reads as ``ABSENT`` bytes (all 0xFF: a NaN scale or value in
every dtype, which a trained row never is): the rows of a block nobody wrote (the block key does
not exist: training never touched its rows) and the rows a publisher left out of a written block
(``--rows trained``). Readers serve the table's default row for them.

Reads gather only the rows asked for, with ``GETRANGE`` inside a read-only script (``GATHER`` in
``redis_scripts.py``, sent with ``EVALSHA_RO``): one reply of concatenated rows, in one round
trip, never a whole block.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

BLOCK_BYTES = 16_368
"""Bytes of rows in a block: 16 KiB less the string header and terminator (sdshdr16: 5 B, NUL: 1 B),
rounded down to a multiple of 8."""
ABSENT = 0xFF
"""Every byte of a row the store does not hold."""
GATHER_KEYS = 4096
"""Rows per gather script call (the calls of one lookup are pipelined: still one round trip);
bounds how long one call holds Redis."""


def block_rows(row_bytes: int) -> int:
    """Rows a block holds."""
    return max(1, BLOCK_BYTES // row_bytes)


def block_len(block: int, rows_per_block: int, table_rows: int) -> int:
    """Rows in ``block`` (the last block of a table may hold fewer)."""
    return min(rows_per_block, table_rows - block * rows_per_block)


def absent(raw: np.ndarray) -> np.ndarray:
    """Stored rows [n, W] -> bool [n], True where the store held no row."""
    return (raw.view(np.uint8).reshape(len(raw), -1) == ABSENT).all(axis=1)


class BlockBuffer:
    """Rows of one table on their way into blocks: a block is handed out (``take``) once all its
    rows were given, or at ``drain`` (rows never given stay ``ABSENT``). Publishers stream rows in
    order, so at most one block per table is held at a time."""

    def __init__(self, table_rows: int, row_bytes: int) -> None:
        self.rows, self.row_bytes = table_rows, row_bytes
        self.per_block = block_rows(row_bytes)
        # block -> (bytes [len, W], [given, kept])
        self._open: dict[int, tuple[np.ndarray, list[int]]] = {}

    def add(self, start: int, enc: np.ndarray, keep: np.ndarray | None) -> list[tuple[int, bytes]]:
        """Rows ``[start, start + n)`` as stored (uint8 view [n, W]); ``keep``: bool [n], the rows
        to store (None: all). -> the blocks completed, (block, bytes), those with a row kept."""
        if keep is not None:
            enc = np.where(keep[:, None], enc, np.uint8(ABSENT))
        done = []
        stop, r = start + len(enc), start
        while r < stop:
            b = r // self.per_block
            lo, n = r - b * self.per_block, block_len(b, self.per_block, self.rows)
            hi = min(n, lo + stop - r)
            if lo == 0 and hi == n and b not in self._open:  # a whole block at once: no copy
                piece = enc[r - start : r - start + n]
                kept = n if keep is None else int(keep[r - start : r - start + n].sum())
                if kept:
                    done.append((b, piece.tobytes()))
            else:
                buf, counts = self._open.setdefault(
                    b, (np.full((n, self.row_bytes), ABSENT, np.uint8), [0, 0])
                )
                buf[lo:hi] = enc[r - start : r - start + hi - lo]
                counts[0] += hi - lo
                counts[1] += (
                    (hi - lo) if keep is None else int(keep[r - start : r - start + hi - lo].sum())
                )
                if counts[0] >= n:
                    del self._open[b]
                    if counts[1]:
                        done.append((b, buf.tobytes()))
            r += hi - lo
        return done

    def drain(self) -> list[tuple[int, bytes]]:
        out = [(b, buf.tobytes()) for b, (buf, counts) in self._open.items() if counts[1]]
        self._open.clear()
        return out


def rows_by_block(
    ids: np.ndarray, enc: np.ndarray, rows_per_block: int
) -> dict[int, list[tuple[int, bytes]]]:
    """Rows to rewrite (ids int64 [n], stored bytes uint8 [n, W]) -> block -> [(byte offset, row
    bytes)]."""
    out: dict[int, list[tuple[int, bytes]]] = defaultdict(list)
    width = enc.shape[1]
    for i, row in enumerate(ids.tolist()):
        b = row // rows_per_block
        out[b].append(((row - b * rows_per_block) * width, enc[i].tobytes()))
    return out
