"""Table pieces and their initial rows.

A ``LocalTable`` is the piece of a global table one process holds (rows and columns); its
initial weights come from per-block seeds, so a row starts the same whatever the sharding, and
rows never trained can be regenerated anywhere (publishing uses it to find the trained rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dlrm_core.schema import TableSpec

INIT_BLOCK_ROWS = 65536
"""Rows initialised from one seed: any row range initialises identically whatever the sharding."""


@dataclass(frozen=True)
class LocalTable:
    """The piece of a global table that a shard holds: rows [row_start, row_start + spec.rows),
    columns [col_start, col_start + spec.dim)."""

    table: TableSpec
    """The whole table."""
    index: int
    """Position of the table in the model's feature spec (seeds its initialisation)."""
    row_start: int = 0
    col_start: int = 0
    rows: int | None = None
    dim: int | None = None
    pooling: str | None = None
    """Pooling of the piece, when it differs from the table's (row-wise pieces of a mean-pooled
    table pool with sum; the trainer divides by the whole bag's length)."""
    row_pieces: int = 1
    """Row blocks the table is split in (a dynamic table's ids are routed over them by hash:
    ``idmap/pieces.py``)."""

    @property
    def spec(self) -> TableSpec:
        """The local piece as a table of its own."""
        return self.table.model_copy(
            update={
                "rows": self.rows or self.table.rows,
                "dim": self.dim or self.table.dim,
                "pooling": self.pooling or self.table.pooling,
            }
        )


def init_rows(local: LocalTable, seed: int, init_scale: float | None = None) -> torch.Tensor:
    """Initial weights of a table piece, float [R, D]: uniform(+-init_scale), or
    uniform(+-sqrt(1/rows)) as in TorchRec and the DLRM reference when ``init_scale`` is None.

    Each block of INIT_BLOCK_ROWS rows has its own seed, so a row's initial value does not
    depend on how the table is sharded.
    """
    spec, table = local.spec, local.table
    bound = init_scale if init_scale else math.sqrt(1.0 / table.rows)
    out = torch.empty(spec.rows, spec.dim)
    first, last = local.row_start, local.row_start + spec.rows
    for block in range(first // INIT_BLOCK_ROWS, (last - 1) // INIT_BLOCK_ROWS + 1):
        lo = block * INIT_BLOCK_ROWS
        hi = min(lo + INIT_BLOCK_ROWS, table.rows)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + local.index) * 1_000_003 + block)
        full = torch.empty(hi - lo, table.dim).uniform_(-bound, bound, generator=gen)
        a, b = max(lo, first), min(hi, last)
        out[a - first : b - first] = full[
            a - lo : b - lo, local.col_start : local.col_start + spec.dim
        ]
    return out
