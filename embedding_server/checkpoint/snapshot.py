"""What a shard writes into a checkpoint: only the rows it trained.

A row never looked up in training still holds exactly its initial state (its weights come from
its block's seed, ``local_table.init_rows``; its optimizer state is the optimizer's start
value), so a checkpoint leaves it out and a restore regenerates it: checkpoint bytes grow with
the rows trained, not the rows allocated.

:class:`TouchedRows` keeps, per row of each piece, the *generation* of its last training lookup
(-1: never). Every checkpoint cut closes a generation, so the rows changed since cut ``b`` are
those whose generation is above ``b``'s: a full checkpoint writes every trained row, a delta the
rows changed since its base. A piece's file (one per piece, so that a restore reads only the
pieces it needs)::

    {"ids": int64 [n] local rows (sorted), "weight": [n, D], "<state>": [n] or [n, D], ...}

and the writer's record (``checkpoint/writer.py``) describes every piece, with or without a file::

    {"table", "index", "table_rows", "table_dim", "row_start", "rows", "col_start", "dim",
     "file" (or None: no row to write), "n"}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from embedding_server.kernels.optimizers import state_bytes_per_row, state_shapes


@dataclass(frozen=True)
class CutRequest:
    """One checkpoint cut as the trainers order it (``wire.py``: the CHECKPOINT header)."""

    step: int
    """Global step of the state to save."""
    base_step: int | None = None
    """A delta's base (rows changed since that cut); None: a full checkpoint."""
    wait: bool = False
    """Everyone waits until it is current (the last checkpoint of a run, before publishing)."""
    taken: bool = False
    """The cut of this step was already taken (in the background): only wait for it."""

    def message(self) -> tuple[int, list[int]]:
        """(argument, payload) of the CHECKPOINT message: the step; [the base + 1 (0: full),
        0 (async), 1 (wait) or 3 (wait for the cut already taken)]."""
        return self.step, [
            0 if self.base_step is None else self.base_step + 1,
            int(self.wait) | 2 * int(self.taken),
        ]

    @classmethod
    def from_message(cls, arg: int, payload: list[int]) -> CutRequest:
        base, flags = int(payload[0]), int(payload[1])
        return cls(arg, None if base == 0 else base - 1, bool(flags & 1), bool(flags & 2))


class TouchedRows:
    """Generation of the last training lookup of every row of some pieces (-1: never)."""

    def __init__(self, sizes: list[int]) -> None:
        self.last = [torch.full((n,), -1, dtype=torch.int32) for n in sizes]
        self.generation = 0
        self.cut_generation: dict[int, int] = {}
        """Cut step -> the last generation it contains."""

    def mark(self, piece: int, ids: torch.Tensor) -> None:
        self.last[piece][ids] = self.generation

    def since(self, piece: int, base_step: int | None) -> torch.Tensor:
        """Local rows to write: changed since cut ``base_step`` (None, or a cut this process did
        not make: every trained row, a superset that is always correct)."""
        g = self.cut_generation.get(base_step) if base_step is not None else None
        last = self.last[piece]
        return torch.nonzero(last > g if g is not None else last >= 0).view(-1)

    def close_cut(self, step: int) -> None:
        """A cut at ``step`` took the rows as they are: later lookups open the next generation."""
        self.cut_generation[step] = self.generation
        # a base is one of the last cuts (else: superset)
        for old in sorted(self.cut_generation)[:-8]:
            del self.cut_generation[old]
        self.generation += 1

    def restored(self, piece: int, ids: torch.Tensor, step: int) -> None:
        """Rows a restore read from checkpoint ``step``: trained, and unchanged since that cut."""
        self.last[piece][ids] = 0
        self.cut_generation[step] = 0
        self.generation = max(self.generation, 1)

    def count(self) -> int:
        return sum(int((t >= 0).sum()) for t in self.last)


def piece_file(prefix: str, local) -> str:
    return f"{prefix}.t{local.index}.r{local.row_start}.c{local.col_start}.pt"


@torch.no_grad()
def snapshot_tables(
    shard, base_step: int | None, prefix: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Copies of ``shard``'s rows changed since ``base_step`` (all trained rows when None):
    (files to write, the record of its pieces). Taken between steps; the copies are what the
    background writer writes while training goes on."""
    state = shard.export_state()
    touched: TouchedRows = shard.touched
    files: dict[str, Any] = {}
    pieces = []
    kind = shard.optimizer_config.kind
    for i, local in enumerate(shard.local_tables):
        spec, name = local.spec, local.table.name
        ids = touched.since(i, base_step)
        entry = {
            "table": name,
            "index": local.index,
            "table_rows": local.table.rows,
            "table_dim": local.table.dim,
            "row_start": local.row_start,
            "rows": spec.rows,
            "col_start": local.col_start,
            "dim": spec.dim,
            "file": None,
            "n": int(ids.numel()),
            "bytes_allocated": spec.rows * (spec.dim * 4 + state_bytes_per_row(kind, spec.dim)),
        }
        # A dynamic table's id map (raw id -> row) is written whole with every cut.
        maps = {
            key[len(name) + 1 :]: value.clone()
            for key, value in state.items()
            if key.startswith(f"{name}.idmap.")
        }
        if ids.numel() or maps:
            payload = {"ids": ids.to(torch.int64), **maps}
            for key, value in state.items():
                if key.startswith(f"{name}.") and not key.startswith(f"{name}.idmap."):
                    payload[key[len(name) + 1 :]] = value.index_select(0, ids)  # a copy
            entry["file"] = piece_file(prefix, local)
            files[entry["file"]] = payload
        pieces.append(entry)
    opt = shard.optimizer_config
    record = {
        "pieces": pieces,
        "kernel_step": int(state["step"]),
        "init": {
            "seed": shard.seed,
            "init_scale": shard.init_scale,
            "initial": {
                name: (opt.initial_accumulator if name == "momentum1" else 0.0)
                for name in shard.state_names()
            },
            "row_states": [n for n, shape in state_shapes(kind, 1, 1).items() if len(shape) == 1],
        },
        "rows_written": sum(p["n"] for p in pieces),
        "rows_allocated": sum(p["rows"] for p in pieces),
        "bytes_allocated": sum(p["bytes_allocated"] for p in pieces),
    }
    return files, record
