"""Embedding tables in checkpoints, in any sharding, read back in any other.

Every process that holds tables writes, per table piece, the rows it trained
(``checkpoint/snapshot.py``); the manifest's ``writers`` describe every piece of every writer. A
table is read as its initial state (regenerated from the per-block seeds, the optimizer's start
values) with the saved rows of the checkpoint's chain laid over it: the full checkpoint first,
then each delta. :class:`CheckpointTables` indexes the pieces from the manifests alone, opens a
piece's file (memory-mapped, digest verified) only when a read overlaps it, and assembles any
row/column range of any table from whichever pieces overlap it. That is resharding: a
checkpoint written by 2 servers restores onto 1 or 3, or onto a single process, reading only
the pieces each needs; publishing streams full tables from it in chunks.

Row-wise Adagrad keeps one accumulator per row and piece. A column-wise piece's accumulator
averages g^2 over its own columns; reassembling a whole row takes the dim-weighted mean of the
column pieces' accumulators, which is exactly the whole row's.

Checkpoints of the previous format (one file per writer, every row) are read as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from dlrm_core.errors import CheckpointError
from dlrm_core.schema import TableSpec
from embedding_server.checkpoint.files import checkpoint_chain, load_file, read_manifest
from embedding_server.idmap.pieces import PieceLayout
from embedding_server.idmap.reshard import move_piece
from embedding_server.local_table import INIT_BLOCK_ROWS, LocalTable, init_rows

CHUNK_ROWS = 16 * INIT_BLOCK_ROWS
"""Rows restored at once (whole seed blocks): bounds the memory a restore adds."""


@dataclass(frozen=True)
class SavedPiece:
    """A table piece as one writer saved it in one checkpoint of a chain."""

    layer: Path
    file: str | None
    """Its file (None: no row of it was written)."""
    row_start: int
    rows: int
    col_start: int
    dim: int
    legacy: int | None = None
    """Previous format: the piece's number in its writer's file (every row saved)."""


@dataclass(frozen=True)
class TableInfo:
    index: int
    rows: int
    dim: int


class CheckpointTables:
    """Every table piece of a checkpoint (and of the checkpoints it is a delta of), readable by
    row and column range."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.chain = checkpoint_chain(self.path)
        self.tables: dict[str, TableInfo] = {}
        # seed, init_scale, initial states, row states (None: every row saved)
        self.init: dict | None = None
        self.step = 0  # the fused optimizer's step count
        self.layers = [self._index(layer) for layer in self.chain]
        self.last_step = int(read_manifest(self.path)["step"])
        for layer in self.layers:
            self._check_coverage(layer)
        self._files: dict[tuple[Path, str], dict] = {}

    # -- the index ------------------------------------------------------------------------------

    def _index(self, layer: Path) -> dict[str, list[SavedPiece]]:
        manifest = read_manifest(layer)
        out: dict[str, list[SavedPiece]] = {}
        if "writers" not in manifest:
            return self._index_legacy(layer, manifest)
        for record in manifest["writers"].values():
            if "init" in record:
                self.init = record["init"]
                self.step = int(record.get("kernel_step", 0))
            for p in record.get("pieces", []):
                self.tables[p["table"]] = TableInfo(p["index"], p["table_rows"], p["table_dim"])
                out.setdefault(p["table"], []).append(
                    SavedPiece(
                        layer, p["file"], p["row_start"], p["rows"], p["col_start"], p["dim"]
                    )
                )
        if not out:
            raise CheckpointError(f"checkpoint {layer} holds no embedding tables")
        return out

    def _index_legacy(self, layer: Path, manifest: dict) -> dict[str, list[SavedPiece]]:
        names = sorted(n for n in manifest["files"] if n.startswith("embeddings"))
        if not names:
            raise CheckpointError(f"checkpoint {layer} holds no embedding tables")
        out: dict[str, list[SavedPiece]] = {}
        for name in names:
            payload = self._load(layer, name)
            self.step = max(self.step, int(payload.get("step", 0)))
            for table, pieces in payload["pieces"].items():
                for i, (r0, rows, c0, dim) in enumerate(pieces):
                    out.setdefault(table, []).append(
                        SavedPiece(layer, name, r0, rows, c0, dim, legacy=i)
                    )
        for table, pieces in out.items():
            self.tables[table] = TableInfo(
                -1,
                max(p.row_start + p.rows for p in pieces),
                max(p.col_start + p.dim for p in pieces),
            )
        return out

    def _check_coverage(self, layer: dict[str, list[SavedPiece]]) -> None:
        for table, pieces in layer.items():
            info = self.tables[table]
            for i, a in enumerate(pieces):
                for b in pieces[i + 1 :]:
                    if (
                        a.row_start < b.row_start + b.rows
                        and b.row_start < a.row_start + a.rows
                        and a.col_start < b.col_start + b.dim
                        and b.col_start < a.col_start + a.dim
                    ):
                        raise CheckpointError(
                            f"checkpoint {a.layer}: table {table} has overlapping pieces (stale "
                            "files?)"
                        )
            if sum(p.rows * p.dim for p in pieces) != info.rows * info.dim:
                raise CheckpointError(
                    f"checkpoint {pieces[0].layer}: table {table} rows 0..{info.rows} are not all "
                    "saved (a writer is missing)"
                )

    def _load(self, layer: Path, name: str) -> dict:
        key = (layer, name)
        if key not in self._files:
            self._files[key] = load_file(layer, name, mmap=True)  # digest verified once
        return self._files[key]

    # -- reading --------------------------------------------------------------------------------

    def _rows(
        self, p: SavedPiece, table: str, state: str, lo: int, hi: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Saved local rows of ``p`` in [lo, hi) and their ``state`` values."""
        payload = self._load(p.layer, p.file)
        if p.legacy is not None:
            values = payload["tensors"].get(f"{table}.{state}@{p.legacy}")
            ids = torch.arange(lo, hi)
            values = values[lo:hi] if values is not None else None
        else:
            all_ids = payload["ids"]
            i0, i1 = (int(x) for x in torch.searchsorted(all_ids, torch.tensor([lo, hi])))
            ids, values = all_ids[i0:i1], payload[state][i0:i1] if state in payload else None
        if values is None:
            raise CheckpointError(f"checkpoint {p.layer}: table {table} has no {state!r} state")
        return ids, values

    def _initial(
        self,
        table: str,
        state: str,
        row_start: int,
        rows: int,
        col_start: int,
        dim: int,
        per_row: bool,
    ) -> torch.Tensor:
        info = self.tables[table]
        if self.init is None:  # previous format: every row is saved
            return torch.zeros((rows,) if per_row else (rows, dim))
        if state == "weight":
            local = LocalTable(
                TableSpec(name=table, rows=info.rows, dim=info.dim),
                info.index,
                row_start,
                col_start,
                rows,
                dim,
            )
            return init_rows(local, self.init["seed"], self.init["init_scale"])
        return torch.full(
            (rows,) if per_row else (rows, dim), float(self.init["initial"].get(state, 0.0))
        )

    def is_row_state(self, state: str) -> bool:
        if self.init is not None:
            return state in self.init.get("row_states", [])
        return state == "momentum1" and self._legacy_row_state(state)

    def _legacy_row_state(self, state: str) -> bool:
        for layer in self.layers:
            for table, pieces in layer.items():
                p = pieces[0]
                t = self._load(p.layer, p.file)["tensors"].get(f"{table}.{state}@{p.legacy}")
                return t is not None and t.dim() == 1
        return False

    def read(
        self,
        table: str,
        state: str,
        row_start: int,
        rows: int,
        col_start: int = 0,
        dim: int | None = None,
        initial: bool = True,
    ) -> torch.Tensor:
        """``state`` of rows [row_start, +rows) and columns [col_start, +dim) of ``table``.

        Returns float [rows, dim] (or [rows] for row-wise states). ``initial=False``: rows that
        no checkpoint saved are left at zero (for a caller that holds them already).
        """
        info = self.tables.get(table)
        if info is None:
            raise CheckpointError(f"checkpoint {self.path} has no table {table}")
        dim = info.dim - col_start if dim is None else dim
        per_row = self.is_row_state(state)
        out = (
            self._initial(table, state, row_start, rows, col_start, dim, per_row)
            if initial
            else torch.zeros((rows,) if per_row else (rows, dim))
        )
        for layer in self.layers:
            self._overlay(
                out, layer.get(table, []), table, state, row_start, rows, col_start, dim, per_row
            )
        return out

    def _overlay(self, out, pieces, table, state, row_start, rows, col_start, dim, per_row) -> None:
        """Lay one checkpoint's saved rows over ``out``."""
        acc = torch.zeros(rows, dtype=torch.float64) if per_row else None
        weight = torch.zeros(rows, dtype=torch.float64) if per_row else None
        for p in pieces:
            a, b = max(p.row_start, row_start), min(p.row_start + p.rows, row_start + rows)
            ca, cb = max(p.col_start, col_start), min(p.col_start + p.dim, col_start + dim)
            if a >= b or p.file is None or (not per_row and ca >= cb):
                continue
            ids, values = self._rows(p, table, state, a - p.row_start, b - p.row_start)
            at = ids + (p.row_start - row_start)  # positions in out
            if per_row:  # every column piece of the row counts, weighted by its dim
                acc[at] += values.double() * p.dim
                weight[at] += p.dim
            else:
                out[at, ca - col_start : cb - col_start] = values[
                    :, ca - p.col_start : cb - p.col_start
                ].float()
        if per_row:
            have = weight > 0
            out[have] = (acc[have] / weight[have]).float()

    def saved_rows(self, table: str, row_start: int, rows: int) -> torch.Tensor:
        """Rows of [row_start, +rows) that some checkpoint of the chain saved (local, sorted)."""
        found = []
        for layer in self.layers:
            for p in layer.get(table, []):
                a, b = max(p.row_start, row_start), min(p.row_start + p.rows, row_start + rows)
                if a < b and p.file is not None:
                    ids, _ = self._rows(p, table, "weight", a - p.row_start, b - p.row_start)
                    found.append(ids + (p.row_start - row_start))
        return torch.unique(torch.cat(found)) if found else torch.zeros(0, dtype=torch.int64)

    def state_for(
        self, tables: list[LocalTable], state_names: tuple[str, ...]
    ) -> dict[str, torch.Tensor]:
        """The import_state() dict of a shard holding ``tables`` (any sharding)."""
        out: dict[str, torch.Tensor] = {"step": torch.tensor(self.step)}
        for local in tables:
            spec = local.spec
            name = local.table.name
            for state in ("weight", *state_names):
                out[f"{name}.{state}"] = self.read(
                    name, state, local.row_start, spec.rows, local.col_start, spec.dim
                )
            if local.table.dynamic is not None:
                out.update(self.id_map(name, local.row_start, spec.rows))
        return out

    def id_map(
        self, table: str, row_start: int = 0, rows: int | None = None
    ) -> dict[str, torch.Tensor]:
        """A dynamic table's id map as of the checkpoint, ``<table>.idmap.<name>`` -> tensor
        (every cut writes it whole; column pieces of a table hold identical maps); of its piece
        of rows [row_start, +rows) when it is split by rows (each piece maps its own ids). Empty
        when the checkpoint has none.

        Raises:
            CheckpointError: the checkpoint split the table's rows otherwise (its ids would
                have to move between pieces).
        """
        saved, n = self.row_pieces(table), rows or self.tables[table].rows
        if saved and (row_start, n) not in saved:
            raise CheckpointError(
                f"checkpoint {self.path}: dynamic table {table} has no piece of rows "
                f"{row_start}..{row_start + n} "
                f"(it is {'whole' if len(saved) == 1 else f'split by rows in {len(saved)} pieces'} "
                "there): restore "
                f"it with load_into, which moves its ids between pieces"
            )
        for layer in reversed(self.layers):
            for p in layer.get(table, []):
                if p.file is None or p.legacy is not None or p.row_start != row_start:
                    continue
                payload = self._load(p.layer, p.file)
                maps = {f"{table}.{k}": v for k, v in payload.items() if k.startswith("idmap.")}
                if maps:
                    return maps
        return {}

    def moves_ids(self, local: LocalTable) -> bool:
        """Whether ``local`` is a piece of a dynamic table that the checkpoint split by rows
        otherwise (its ids then move between pieces: ``idmap/reshard.py``)."""
        table = local.table
        if table.dynamic is None or table.name not in self.tables:
            return False
        saved = PieceLayout.of(
            table.rows, table.dynamic, len(self.row_pieces(table.name)), table.name
        )
        return saved != PieceLayout.of(table.rows, table.dynamic, local.row_pieces, table.name)

    def _load_moved(
        self, state: dict[str, torch.Tensor], shard, i: int, local: LocalTable
    ) -> dict[str, torch.Tensor]:
        """Piece ``i`` of ``shard`` restored from a checkpoint that split its dynamic table
        otherwise:
        its rows from wherever their ids (and shared indices) were, one old piece's chunk at a
        time; -> its id map."""
        spec, name = local.spec, local.table.name
        plan = move_piece(self, local)
        order = torch.argsort(plan.sources)
        # by old row: a chunk's are a run
        sources, targets = plan.sources[order], plan.targets[order]
        chunks = [
            (c, min(CHUNK_ROWS, start + n - c))
            for start, n in self.row_pieces(name)
            for c in range(start, start + n, CHUNK_ROWS)
        ]
        for st in ("weight", *shard.state_names()):
            dst = state[f"{name}.{st}"]
            for c, m in chunks:
                a, b = (int(x) for x in torch.searchsorted(sources, torch.tensor([c, c + m])))
                if b > a:
                    part = self.read(name, st, c, m, local.col_start, spec.dim)
                    dst[targets[a:b]] = part[sources[a:b] - c].to(dst.dtype)
        return plan.state

    def row_pieces(self, table: str) -> list[tuple[int, int]]:
        """(first row, rows) of each row block of ``table`` in the newest checkpoint of the chain
        (one for a whole or column-split table), in order; empty when it holds no such table."""
        pieces = self.layers[-1].get(table, []) if self.layers else []
        return sorted({(p.row_start, p.rows) for p in pieces})

    @torch.no_grad()
    def load_into(self, shard) -> None:
        """Restore a freshly built shard (any sharding), a chunk of rows at a time. Rows no
        checkpoint saved keep the shard's own initial state when it was seeded as the run was;
        else they are regenerated."""
        same_init = (
            self.init is not None
            and shard.touched.count() == 0
            and shard.seed == self.init["seed"]
            and shard.init_scale == self.init["init_scale"]
        )
        state = shard.export_state()  # views
        moved: dict[str, dict[str, torch.Tensor]] = {}  # dynamic tables split otherwise: their maps
        for i, local in enumerate(shard.local_tables):
            spec, name = local.spec, local.table.name
            if self.moves_ids(local):
                moved[name] = self._load_moved(state, shard, i, local)
                continue
            saved = self.saved_rows(name, local.row_start, spec.rows)
            for st in ("weight", *shard.state_names()):
                dst = state[f"{name}.{st}"]
                for r in range(0, spec.rows, CHUNK_ROWS):
                    n = min(CHUNK_ROWS, spec.rows - r)
                    if same_init:  # only the saved rows change
                        sel = saved[(saved >= r) & (saved < r + n)]
                        if sel.numel():
                            part = self.read(
                                name,
                                st,
                                local.row_start + r,
                                n,
                                local.col_start,
                                spec.dim,
                                initial=False,
                            )
                            dst[sel] = part[sel - r].to(dst.dtype)
                    else:
                        dst[r : r + n] = self.read(
                            name, st, local.row_start + r, n, local.col_start, spec.dim
                        )
            shard.touched.restored(i, saved, self.last_step)
        # after every restored(): a generation past its cut
        for i, local in enumerate(shard.local_tables):
            # every row rewritten by the next checkpoint (delta or not):
            if local.table.name in moved:
                # its global rows hold others' here
                shard.touched.mark(i, torch.arange(local.spec.rows))
        dynamic = [local for local in shard.local_tables if local.table.dynamic is not None]
        if dynamic:  # their id maps
            shard.load_id_maps(
                {
                    k: v
                    for local in dynamic
                    for k, v in (
                        moved.get(local.table.name)
                        or self.id_map(local.table.name, local.row_start, local.spec.rows)
                    ).items()
                }
            )
        for kernel in shard.kernels:
            kernel.step = self.step
