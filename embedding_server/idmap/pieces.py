"""A dynamic table split by rows over several embedding servers: ids routed by their hash.

A hashed table split row-wise sends each id to the block holding row ``id % R``. A dynamic
table's rows belong to ids, not to ranges, so its ids are routed by hash instead, in a way that
keeps the shared-row rule (an id without a row of its own reads shared row j = hash(id) % S)
whatever the number of pieces P:

    rows        P contiguous blocks, as a hashed table's (``row_blocks``): piece p holds global
                rows [r_p, r_p+1)
    shared      the S shared rows (S of the whole table) split in proportion to the blocks'
                rows: piece p's first s_p+1 - s_p local rows are shared indices [s_p, s_p+1)
    routing     an id goes to the piece holding its shared index j: every id reads, trains and
                is admitted on one piece, and its shared row is local there
    serving     shared row of an id without a row: r_p + (j - s_p) (P = 1: row j, as always)

Each piece has its own id map (capacity: its rows), admission and eviction; the published map
of the table is the union of the pieces' maps in global rows.

Shape letters: n ids, P pieces.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dlrm_core.errors import ConfigError
from dlrm_core.schema import DynamicIds, shared_row_count
from embedding_server.idmap.dynamic import shared_rows_of


def row_blocks(rows: int, parts: int) -> list[tuple[int, int]]:
    """(first row, rows) of each block of a table split by rows over ``parts`` pieces (fewer when
    the table has fewer rows than ``parts`` blocks of ceil(rows / parts))."""
    block = -(-rows // parts)
    return [(s, min(block, rows - s)) for s in range(0, rows, block)]


@dataclass(frozen=True)
class PieceLayout:
    """Where the rows and shared rows of a dynamic table split over P pieces are.

    Attributes:
        row_starts: first global row of each piece, and the table's rows last [P + 1].
        shared_starts: first shared index of each piece, and S last [P + 1].
    """

    row_starts: tuple[int, ...]
    shared_starts: tuple[int, ...]

    @classmethod
    def of(cls, rows: int, cfg: DynamicIds, pieces: int = 1, table: str = "") -> PieceLayout:
        """The layout of a table of ``rows`` rows over ``pieces`` row blocks (made once per
        arguments: the trainer asks for it at every routing).

        Raises:
            ConfigError: split over several pieces, one would hold no shared row, or no row for
                an admitted id.
        """
        return _layout(rows, cfg, max(1, pieces), table)

    @property
    def pieces(self) -> int:
        return len(self.row_starts) - 1

    @property
    def shared(self) -> int:
        """S, the table's shared rows (over every piece)."""
        return self.shared_starts[-1]

    @functools.cached_property
    def _bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(first shared index of pieces 1..P-1 [P - 1], global row of each piece's first shared
        index minus that index [P]), as tensors (made once: the trainer routes every step)."""
        return (
            torch.tensor(self.shared_starts[1:-1]),
            torch.tensor(self.row_starts[:-1]) - torch.tensor(self.shared_starts[:-1]),
        )

    def piece_of_index(self, j: torch.Tensor) -> torch.Tensor:
        """The piece holding each shared index j [n] (in [0, S)), int64 [n]."""
        return torch.searchsorted(self._bounds[0], j, right=True)

    def index_row(self, j: torch.Tensor) -> torch.Tensor:
        """The global row of each shared index j [n], int64 [n]."""
        return j + self._bounds[1].index_select(0, self.piece_of_index(j))

    def piece_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The piece each raw id [n] lives on, int64 [n]."""
        if self.pieces == 1:
            return torch.zeros_like(ids)
        return self.piece_of_index(shared_rows_of(ids, self.shared))

    def shared_row(self, ids: torch.Tensor) -> torch.Tensor:
        """Global shared row of each raw id [n], int64 [n] (what an id without a row reads)."""
        j = shared_rows_of(ids, self.shared)
        return j if self.pieces == 1 else self.index_row(j)

    def span(self, row_start: int, table: str = "") -> tuple[int, int, int]:
        """(shared rows, S of the table, first shared index) of the piece starting at ``row_start``:
        its ids' local shared row is hash(id) % S - first shared index.

        Raises:
            ConfigError: no piece of this layout starts there.
        """
        if row_start not in self.row_starts[:-1]:
            raise ConfigError(
                f"table {table}: no piece of its {self.pieces}-way split by rows starts at row "
                f"{row_start}"
            )
        p = self.row_starts.index(row_start)
        return self.shared_starts[p + 1] - self.shared_starts[p], self.shared, self.shared_starts[p]


@functools.lru_cache(maxsize=1024)
def _layout(rows: int, cfg: DynamicIds, pieces: int, table: str) -> PieceLayout:
    """:meth:`PieceLayout.of` (cached: the config is frozen, so hashable)."""
    blocks = row_blocks(rows, pieces)
    p, s = len(blocks), shared_row_count(rows, cfg)
    shared = _proportional(s, [n for _, n in blocks])
    for (_, n), k in zip(blocks, shared, strict=True):
        if p > 1 and (k < 1 or k >= n):
            raise ConfigError(
                f"table {table}: {rows:,} rows with {s:,} shared row(s) cannot be split by rows in "
                f"{p} blocks "
                f"(for {pieces} servers; each block needs a shared row and a row for an admitted "
                "id): raise its "
                "rows or embedding.shared_rows, or place it whole (--sharding table_wise or "
                "column_wise; "
                f"raise --server-memory if it was split because it did not fit)"
            )
    starts = [0]
    for k in shared:
        starts.append(starts[-1] + k)
    return PieceLayout(tuple(b for b, _ in blocks) + (rows,), tuple(starts))


def _proportional(s: int, sizes: list[int]) -> list[int]:
    """``s`` shared rows over blocks of ``sizes`` rows, in proportion (largest remainders first,
    ties to the first blocks), at least one each when ``s`` allows: the ids routed to a block,
    in proportion to its shared rows, then match its capacity."""
    total = sum(sizes)
    exact = [s * n / total for n in sizes]
    out = [int(x) for x in exact]
    for i in sorted(range(len(sizes)), key=lambda i: (out[i] - exact[i], i))[: s - sum(out)]:
        out[i] += 1
    for i in range(len(out)):  # a block left without one takes it from the largest share
        if out[i] == 0 and s >= len(out):
            j = max(range(len(out)), key=lambda j: (out[j], -j))
            out[j] -= 1
            out[i] += 1
    return out
