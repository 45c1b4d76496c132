"""The sharding planner: which piece of which table lives on which embedding server.

Three placements, as TorchRec names them, each in its own module under ``sharding/``:

* table-wise: a whole table on one server;
* row-wise: a table's rows split in contiguous blocks over all servers (for tables too large,
  or too hot, for one server); a dynamic table's ids are then routed by hash
  (``idmap/pieces.py``, ``sharding/hash_routed.py``);
* column-wise: a table's dims split over servers (each server holds every row, some columns).

The automatic plan places tables whole, largest first, on the server with the least expected
lookup work that still has room, and splits a table row-wise when no server can hold it; memory
counts weights and optimizer state. A model that cannot fit is refused before training, naming
the table and the shortfall.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel

from dlrm_core.errors import ConfigError
from dlrm_core.schema import FeatureSpec, TableSpec
from embedding_server.idmap.pieces import PieceLayout, row_blocks
from embedding_server.kernels.optimizers import SparseOptimizerKind, state_bytes_per_row
from embedding_server.local_table import LocalTable

ShardingKind = Literal["table_wise", "row_wise", "column_wise"]
Strategy = Literal["auto", "table_wise", "row_wise", "column_wise"]


class Piece(BaseModel):
    """One piece of one table on one server."""

    table: str
    table_index: int
    server: int
    kind: ShardingKind
    row_start: int
    rows: int
    col_start: int
    dim: int
    row_pieces: int = 1
    """Row blocks of the table (row-wise: one per server; a dynamic table's ids are routed over
    them by hash, ``idmap/pieces.py``)."""

    def local_table(self, table: TableSpec) -> LocalTable:
        pooling = "sum" if self.kind == "row_wise" else None  # the trainer normalises means
        return LocalTable(
            table,
            self.table_index,
            self.row_start,
            self.col_start,
            self.rows,
            self.dim,
            pooling,
            self.row_pieces,
        )


class ShardingPlan(BaseModel):
    num_servers: int
    pieces: list[Piece]

    def pieces_on(self, server: int) -> list[Piece]:
        """A server's pieces in its lookup order (table order, then rows/columns)."""
        mine = [p for p in self.pieces if p.server == server]
        return sorted(mine, key=lambda p: (p.table_index, p.row_start, p.col_start))

    def pieces_of(self, table: str) -> list[Piece]:
        return sorted(
            (p for p in self.pieces if p.table == table), key=lambda p: (p.row_start, p.col_start)
        )

    def kind_of(self, table: str) -> ShardingKind:
        return self.pieces_of(table)[0].kind

    def slots_on(
        self, server: int, feature_tables: list[int], chunks: int = 1
    ) -> list[tuple[int, Piece]]:
        """What ``server`` looks up for each example: (feature, piece) for every categorical
        feature whose table has a piece there, by feature, then by the table's piece order, and,
        with ``chunks`` > 1, chunk by chunk (:meth:`chunks_on`). Features sharing a table read the
        same piece in several slots."""
        mine = self.pieces_on(server)
        slots = [(f, p) for f, t in enumerate(feature_tables) for p in mine if p.table_index == t]
        if chunks <= 1:
            return slots
        return [slots[i] for group in _slot_chunks(slots, chunks) for i in group]

    def chunks_on(self, server: int, feature_tables: list[int], chunks: int) -> list[int]:
        """How many of :meth:`slots_on`'s slots (in their chunked order) each chunk holds: the
        pieces split in up to ``chunks`` groups of about equal width, a piece's slots together,
        so that a chunk's rows can be updated and looked up again while the next chunk's
        gradients are still on their way."""
        mine = self.pieces_on(server)
        slots = [(f, p) for f, t in enumerate(feature_tables) for p in mine if p.table_index == t]
        return [len(group) for group in _slot_chunks(slots, max(1, chunks))]


def _slot_chunks(slots: list[tuple[int, Piece]], chunks: int) -> list[list[int]]:
    """Slot indices per chunk: pieces (in order of first use) cut at equal shares of the width."""
    order: dict[int, list[int]] = {}
    for i, (_, p) in enumerate(slots):
        order.setdefault(id(p), []).append(i)
    groups = list(order.values())
    width = [sum(slots[i][1].dim for i in g) for g in groups]
    total = sum(width) or 1
    out: list[list[int]] = [[]]
    done = 0
    for g, w in zip(groups, width, strict=True):
        if out[-1] and done >= total * len(out) / chunks and len(out) < chunks:
            out.append([])
        out[-1].extend(g)
        done += w
    return [sorted(g) for g in out]


def table_factors(spec: FeatureSpec, feature_factors: list[float] | None) -> list[float] | None:
    """Mean ids per example of each table: the sum over the features that read it."""
    if feature_factors is None:
        return None
    out = [0.0] * len(spec.tables)
    for f, t in enumerate(spec.feature_tables):
        out[t] += feature_factors[f]
    return out


def parse_bytes(text: str) -> int:
    """'8GB', '512MiB', '1.5G', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?B?)\s*", text, re.IGNORECASE)
    if not m:
        raise ConfigError(f"--server-memory {text!r}: expected a size such as 8GB or 512MiB")
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[m.group(2).upper()]
    return int(float(m.group(1)) * scale)


def piece_bytes(rows: int, dim: int, optimizer: SparseOptimizerKind) -> int:
    return rows * (dim * 4 + state_bytes_per_row(optimizer, dim))


def _col_blocks(dim: int, parts: int) -> list[tuple[int, int]]:
    """Split dims in multiples of 4 (fbgemm's granularity) over at most ``parts`` pieces."""
    units = max(1, dim // 4)
    parts = max(1, min(parts, units))
    sizes = [4 * (units // parts + (1 if i < units % parts else 0)) for i in range(parts)]
    sizes[-1] += dim - sum(sizes)  # a dim that is not a multiple of 4 keeps its remainder last
    starts = [sum(sizes[:i]) for i in range(parts)]
    return list(zip(starts, sizes, strict=True))


def _check_row_wise(table: TableSpec, parts: int) -> None:
    """A dynamic table split by rows has its ids routed by hash (``idmap/pieces.py``): every piece
    needs a shared row and a row for an admitted id."""
    if table.dynamic is not None:
        PieceLayout.of(table.rows, table.dynamic, parts, table.name)


def plan_sharding(
    spec: FeatureSpec,
    num_servers: int,
    optimizer: SparseOptimizerKind,
    strategy: Strategy = "auto",
    server_memory: int | None = None,
    pooling_factors: list[float] | None = None,
) -> ShardingPlan:
    """Place every table of ``spec`` on ``num_servers`` servers.

    Args:
        optimizer: the sparse optimizer (its state counts against memory).
        strategy: ``auto``, or one placement for every table.
        server_memory: bytes each server may hold (None: unlimited).
        pooling_factors: mean ids per bag of each table (measured on data; default 1).

    Raises:
        ConfigError: a table cannot fit, naming it and the shortfall.
    """
    if num_servers < 1:
        raise ConfigError("at least one embedding server is needed")
    factors = pooling_factors or [1.0] * len(spec.tables)
    budget = server_memory if server_memory is not None else float("inf")
    used = [0] * num_servers
    work = [0.0] * num_servers
    pieces: list[Piece] = []

    def add(
        t: int, table: TableSpec, server: int, kind, r0, rows, c0, dim, share: float, parts: int = 1
    ) -> None:
        pieces.append(
            Piece(
                table=table.name,
                table_index=t,
                server=server,
                kind=kind,
                row_start=r0,
                rows=rows,
                col_start=c0,
                dim=dim,
                row_pieces=parts,
            )
        )
        used[server] += piece_bytes(rows, dim, optimizer)
        work[server] += factors[t] * share * dim

    def row_wise(t: int, table: TableSpec) -> None:
        blocks = row_blocks(table.rows, num_servers)
        _check_row_wise(table, len(blocks))
        for server, (_, rows) in enumerate(blocks):
            need = piece_bytes(rows, table.dim, optimizer)
            if used[server] + need > budget:
                raise ConfigError(
                    f"table {table.name} does not fit: split row-wise over {num_servers} server(s) "
                    "it needs "
                    f"{_fmt(need)} on server {server}, which has {_fmt(budget - used[server])} "
                    "left: "
                    f"{_fmt(used[server] + need - budget)} short (add servers or raise "
                    "--server-memory)"
                )
        for server, (r0, rows) in enumerate(blocks):
            add(
                t, table, server, "row_wise", r0, rows, 0, table.dim, rows / table.rows, len(blocks)
            )

    order = sorted(
        range(len(spec.tables)),
        key=lambda i: -piece_bytes(spec.tables[i].rows, spec.tables[i].dim, optimizer),
    )
    for t in order:
        table = spec.tables[t]
        size = piece_bytes(table.rows, table.dim, optimizer)
        if strategy == "row_wise" or (strategy == "auto" and num_servers > 1 and size > budget):
            row_wise(t, table)
        elif strategy == "column_wise":
            first = min(range(num_servers), key=lambda s: (used[s], s))
            for i, (c0, dim) in enumerate(_col_blocks(table.dim, num_servers)):
                add(t, table, (first + i) % num_servers, "column_wise", 0, table.rows, c0, dim, 1.0)
        else:
            fits = [s for s in range(num_servers) if used[s] + size <= budget]
            if not fits and strategy == "auto" and num_servers > 1:
                row_wise(t, table)
                continue
            if not fits:
                free = budget - min(used)
                raise ConfigError(
                    f"table {table.name} ({_fmt(size)}) does not fit on any embedding server: "
                    f"{_fmt(size - free)} short (each server holds {_fmt(budget)}; add servers, "
                    f"raise --server-memory or shrink the table)"
                )
            add(
                t,
                table,
                min(fits, key=lambda s: (work[s], used[s], s)),
                "table_wise",
                0,
                table.rows,
                0,
                table.dim,
                1.0,
            )
    over = [s for s in range(num_servers) if used[s] > budget]
    if over:
        s = over[0]
        worst = max(
            (p for p in pieces if p.server == s),
            key=lambda p: piece_bytes(p.rows, p.dim, optimizer),
        )
        raise ConfigError(
            f"embedding server {s} needs {_fmt(used[s])} but holds {_fmt(budget)}: "
            f"{_fmt(used[s] - budget)} short (largest piece: table {worst.table})"
        )
    return ShardingPlan(num_servers=num_servers, pieces=pieces)


def wire_id_bound(plan: ShardingPlan, spec: FeatureSpec) -> int:
    """Bound of the ids trainers send to servers: a piece's rows, or 2^63 when a dynamic table's
    raw 64-bit ids travel (``wire.ids_dtype`` picks int32 or int64 from it)."""
    if any(spec.tables[p.table_index].dynamic is not None for p in plan.pieces):
        return 2**63
    return max((p.rows for p in plan.pieces), default=0)


def _fmt(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n}"


def describe_plan(
    plan: ShardingPlan,
    spec: FeatureSpec,
    optimizer: SparseOptimizerKind,
    batch_size: int,
    pooling_factors: list[float] | None = None,
) -> str:
    """The plan as a table: per server, pieces, bytes and expected lookups per step; imbalance."""
    factors = pooling_factors or [1.0] * len(spec.tables)
    rows = []
    for s in range(plan.num_servers):
        mine = plan.pieces_on(s)
        nbytes = sum(piece_bytes(p.rows, p.dim, optimizer) for p in mine)
        lookups = sum(
            factors[p.table_index] * batch_size * p.rows / spec.tables[p.table_index].rows
            if p.kind == "row_wise"
            else factors[p.table_index] * batch_size
            for p in mine
        )
        names = ", ".join(
            p.table
            + {
                "table_wise": "",
                "row_wise": f"[rows {p.row_start}:{p.row_start + p.rows}]",
                "column_wise": f"[dims {p.col_start}:{p.col_start + p.dim}]",
            }[p.kind]
            for p in mine
        )
        rows.append((s, nbytes, lookups, names))
    mean_bytes = sum(r[1] for r in rows) / len(rows)
    mean_lookups = sum(r[2] for r in rows) / len(rows)
    out = ["| server | bytes | lookups/step | pieces |", "|---:|---:|---:|---|"]
    out += [f"| {s} | {_fmt(b)} | {lk:,.0f} | {n} |" for s, b, lk, n in rows]
    imb_b = max(r[1] for r in rows) / mean_bytes if mean_bytes else 1.0
    imb_l = max(r[2] for r in rows) / mean_lookups if mean_lookups else 1.0
    out.append(
        f"\nimbalance (max / mean): bytes {imb_b:.2f}, lookups {imb_l:.2f}; "
        f"total {_fmt(sum(r[1] for r in rows))} on {plan.num_servers} server(s)"
    )
    return "\n".join(out)
