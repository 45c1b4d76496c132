"""Embedding tables in checkpoints, in any sharding, read back in any other.

Each process that holds tables writes one file (``embeddings.pt`` for a single process,
``embeddings-server-<k>.pt`` for embedding server k)::

    {"pieces": {table: [[row_start, rows, col_start, dim], ...]},   # what this file holds
     "tensors": {"<table>.<state>@<i>": tensor},                      # i-th piece of the table
     "step": int}

:class:`CheckpointTables` indexes every such file of a checkpoint (memory-mapped, so nothing is
read until asked) and assembles any row/column range of any table from whichever pieces overlap
it. That is resharding: a checkpoint written by 2 servers restores onto 1 or 3, or onto a single
process, and publishing streams full tables from it in chunks.

Row-wise Adagrad keeps one accumulator per row and piece. A column-wise piece's accumulator
averages g^2 over its own columns; reassembling a whole row takes the dim-weighted mean of the
column pieces' accumulators, which is exactly the whole row's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dlrm_core.errors import CheckpointError
from embedding_server.checkpoint import load_file, read_manifest
from embedding_server.local_table import LocalTable

ROW_STATES = {"momentum1"}
"""States with one value per row (row-wise Adagrad); others are [rows, dim]."""


def shard_payload(shard) -> dict:
    """What an embedding shard (``shard.EmbeddingShard``) writes into a checkpoint (views, not copies)."""
    state = shard.export_state()
    pieces: dict[str, list[list[int]]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for local in shard.local_tables:
        name = local.table.name
        spec = local.spec
        i = len(pieces.setdefault(name, []))
        pieces[name].append([local.row_start, spec.rows, local.col_start, spec.dim])
        for key, value in state.items():
            if key.startswith(f"{name}."):
                tensors[f"{key}@{i}"] = value
    return {"pieces": pieces, "tensors": tensors, "step": int(state["step"])}


class CheckpointTables:
    """Every table piece of a checkpoint, readable by row and column range."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        names = [n for n in read_manifest(self.path)["files"] if n.startswith("embeddings")]
        if not names:
            raise CheckpointError(f"checkpoint {self.path} holds no embedding tables")
        self.files = [load_file(self.path, n, mmap=True) for n in sorted(names)]
        self.index: dict[str, list[tuple[int, int, int, int, dict, int]]] = {}
        for payload in self.files:
            for table, pieces in payload["pieces"].items():
                for i, (r0, rows, c0, dim) in enumerate(pieces):
                    self.index.setdefault(table, []).append((r0, rows, c0, dim, payload["tensors"], i))
        self.step = max(int(p.get("step", 0)) for p in self.files)

    def read(self, table: str, state: str, row_start: int, rows: int, col_start: int = 0, dim: int | None = None) -> torch.Tensor:
        """``state`` of rows [row_start, +rows) and columns [col_start, +dim) of ``table``.

        Returns float [rows, dim] (or [rows] for row-wise states).
        """
        pieces = self.index.get(table)
        if not pieces:
            raise CheckpointError(f"checkpoint {self.path} has no table {table}")
        table_dim = max(c0 + d for _, _, c0, d, _, _ in pieces)
        if dim is None:
            dim = table_dim - col_start
        per_row = state in ROW_STATES
        out = torch.zeros((rows,) if per_row else (rows, dim))
        weight = torch.zeros(rows)  # per-row states: the columns their pieces span
        # Which pieces hold each cell: every column of the table for per-row states (a row's
        # accumulator is the dim-weighted mean over all its column pieces), else the asked ones.
        c_lo, c_hi = (0, table_dim) if per_row else (col_start, col_start + dim)
        covered = torch.zeros((rows, c_hi - c_lo), dtype=torch.int16)
        for r0, prow, c0, pdim, tensors, i in pieces:
            a, b = max(r0, row_start), min(r0 + prow, row_start + rows)
            ca, cb = max(c0, c_lo), min(c0 + pdim, c_hi)
            if a >= b or ca >= cb:
                continue
            src = tensors.get(f"{table}.{state}@{i}")
            if src is None:
                raise CheckpointError(f"checkpoint {self.path}: table {table} has no {state!r} state")
            if per_row:
                out[a - row_start : b - row_start] += src[a - r0 : b - r0].float() * pdim
                weight[a - row_start : b - row_start] += pdim
            else:
                out[a - row_start : b - row_start, ca - col_start : cb - col_start] = src[a - r0 : b - r0, ca - c0 : cb - c0]
            covered[a - row_start : b - row_start, ca - c_lo : cb - c_lo] += 1
        if bool((covered > 1).any()):
            raise CheckpointError(f"checkpoint {self.path}: table {table} has overlapping pieces (stale files?)")
        if not bool((covered == 1).all()):
            raise CheckpointError(f"checkpoint {self.path}: table {table} rows {row_start}..{row_start + rows} are not all saved")
        if per_row:
            out /= weight
        return out

    def state_for(self, tables: list[LocalTable], state_names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """The import_state() dict of a shard holding ``tables`` (any sharding)."""
        out: dict[str, torch.Tensor] = {"step": torch.tensor(self.step)}
        for local in tables:
            spec = local.spec
            name = local.table.name
            for state in ("weight", *state_names):
                out[f"{name}.{state}"] = self.read(name, state, local.row_start, spec.rows, local.col_start, spec.dim)
            if local.table.dynamic is not None:
                out.update(self.id_map(name))
        return out

    def id_map(self, table: str) -> dict[str, torch.Tensor]:
        """A dynamic table's id map, ``<table>.idmap.<name>`` -> tensor (column pieces of a
        table hold identical maps; the first is read). Empty when the checkpoint has none."""
        _, _, _, _, tensors, i = self.index[table][0]
        prefix = f"{table}.idmap."
        out = {}
        for key, value in tensors.items():
            name, _, piece = key.rpartition("@")
            if name.startswith(prefix) and piece == str(i):
                out[name] = value
        return out

    def load_into(self, shard) -> None:
        from embedding_server.optimizers import state_shapes

        names = tuple(state_shapes(shard.optimizer_config.kind, 1, 1))
        shard.import_state(self.state_for(shard.local_tables, names))
