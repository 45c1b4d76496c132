"""The dynamic tables of one embedding shard: raw ids of a lookup -> rows, before the kernels.

``EmbeddingShard.forward`` hands every lookup here first; each dynamic table's features have
their raw 64-bit ids replaced by rows (one vectorised map lookup per table, over the whole
batch), hashed tables' ids pass untouched, and the fused TBE call then runs on rows as before.
A lookup with gradients enabled is a training lookup (admits, evicts); one without (evaluation,
serving) only reads.

A row given to a new id starts from :func:`init_for_ids`: uniform(+-bound) drawn from a hash of
(seed, table, id, column), so an id's fresh row is the same on whatever shard or row it lands.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dlrm_core.batch import SparseFeatures
from embedding_server.idmap.dynamic import DynamicIdMap
from embedding_server.idmap.hash_table import _shr, mix64
from embedding_server.local_table import LocalTable

RowReset = Callable[[int, torch.Tensor, torch.Tensor], None]
"""reset(piece, rows [k], fresh weights [k, D]) on the shard's piece ``piece``."""


def init_for_ids(ids: torch.Tensor, local: LocalTable, seed: int, init_scale: float | None) -> torch.Tensor:
    """Fresh weights of the piece's columns for ``ids`` [k] -> float [k, D_piece]."""
    table, spec = local.table, local.spec
    bound = init_scale if init_scale else math.sqrt(1.0 / table.rows)
    cols = torch.arange(local.col_start, local.col_start + spec.dim, dtype=torch.int64)  # [D]
    key = mix64(ids, salt=(seed * 1_000_003 + local.index) * 1_000_003)  # [k]
    bits = mix64(key[:, None] + cols[None, :])  # [k, D]
    unit = _shr(bits, 11).to(torch.float64) / float(1 << 53)  # uniform [0, 1)
    return ((unit * 2 - 1) * bound).to(torch.float32)


class ShardIdMaps:
    """Id maps of a shard's dynamic table pieces.

    Args:
        tables: the shard's pieces (only those of dynamic tables get a map; a dynamic table is
            never split by rows, so a piece holds all the table's rows).
        feature_map: the piece each feature of a lookup reads.
        reset: writes fresh weights and optimizer state into rows of a piece.
        seed, init_scale: as the shard's initialisation.
    """

    def __init__(self, tables: list[LocalTable], feature_map: list[int], reset: RowReset,
                 seed: int = 0, init_scale: float | None = None) -> None:
        self.tables = tables
        self.maps: dict[int, DynamicIdMap] = {}
        for t, local in enumerate(tables):
            if local.table.dynamic is None:
                continue
            if local.row_start != 0 or local.spec.rows != local.table.rows:
                raise ValueError(f"table {local.table.name}: dynamic ids need whole rows on one shard")
            self.maps[t] = DynamicIdMap(local.spec.rows, local.table.dynamic, self._resetter(t, reset, seed, init_scale))
        self.feature_map = torch.tensor(feature_map, dtype=torch.int64)  # [F]

    def _resetter(self, t: int, reset: RowReset, seed: int, init_scale: float | None):
        local = self.tables[t]
        return lambda rows, ids: reset(t, rows, init_for_ids(ids, local, seed, init_scale))

    def __bool__(self) -> bool:
        return bool(self.maps)

    def remap(self, sparse: SparseFeatures, train: bool) -> SparseFeatures:
        """Raw ids of dynamic tables' features -> rows; everything else as it was."""
        f_count, b = self.feature_map.numel(), max(sparse.batch_size, 1)
        bounds = sparse.offsets[:: b][: f_count + 1]  # [F + 1] each feature's span of values
        piece_of_value = torch.repeat_interleave(self.feature_map, bounds.diff())  # [N]
        values = sparse.values.clone()
        for t, id_map in self.maps.items():
            mine = piece_of_value == t
            values[mine] = id_map.lookup(values[mine], train)
        return SparseFeatures(values, sparse.offsets, sparse.batch_size)

    def stats(self) -> dict[str, dict[str, int]]:
        """Per dynamic table: rows_used, admitted, evicted, default_lookups."""
        return {self.tables[t].table.name: m.stats() for t, m in self.maps.items()}

    def id_rows(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per dynamic table: (admitted ids sorted, their rows)."""
        return {self.tables[t].table.name: m.items() for t, m in self.maps.items()}

    def state(self) -> dict[str, torch.Tensor]:
        """``<table>.idmap.<name>`` -> tensor (views), for the shard's export_state."""
        return {f"{self.tables[t].table.name}.idmap.{k}": v for t, m in self.maps.items() for k, v in m.state().items()}

    def load(self, state: dict[str, torch.Tensor]) -> None:
        for t, m in self.maps.items():
            prefix = f"{self.tables[t].table.name}.idmap."
            m.load({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
