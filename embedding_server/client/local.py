"""The in-process embedding client: a whole model's tables in one :class:`EmbeddingShard`
inside the trainer process (``dlrm train`` without servers, tests, benchmarks)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from dlrm_core.batch import SparseFeatures
from dlrm_core.schema import TableSpec
from embedding_server.checkpoint.snapshot import CutRequest, snapshot_tables
from embedding_server.checkpoint.tables import CheckpointTables
from embedding_server.client.base import EmbeddingClient
from embedding_server.idmap.ahead import RemapAhead
from embedding_server.kernels.optimizers import SparseOptimizerConfig
from embedding_server.local_table import LocalTable
from embedding_server.shard import EmbeddingShard


class InProcessEmbeddingClient(EmbeddingClient):
    """All tables in one :class:`EmbeddingShard` inside the trainer process.

    Args:
        tables: the model's tables.
        feature_tables: the table of each categorical feature (None: one feature per table).
        remap_ahead: dynamic tables remap the next batch's ids during this step when it is
            prefetched (``idmap/ahead.py``; the trainer passes
            :func:`~embedding_server.idmap.ahead.overlaps`).
    """

    def __init__(
        self,
        tables: list[TableSpec],
        optimizer: SparseOptimizerConfig,
        device: torch.device | str = "cpu",
        seed: int = 0,
        init_scale: float | None = None,
        feature_tables: list[int] | None = None,
        remap_ahead: bool = True,
    ) -> None:
        self.tables, self.remap_ahead = tables, remap_ahead
        self.feature_tables = (
            list(range(len(tables))) if feature_tables is None else list(feature_tables)
        )
        self.shard = EmbeddingShard(
            [LocalTable(t, i) for i, t in enumerate(tables)],
            optimizer,
            device,
            seed,
            init_scale,
            self.feature_tables,
        )
        self.device = torch.device(device)
        self._ahead: RemapAhead | None = None  # the next lookup's ids, remapped meanwhile

    @property
    def can_prefetch(self) -> bool:
        """With dynamic tables on the CPU: their remap of the next batch runs during this step."""
        return self.remap_ahead and bool(self.shard.id_maps) and self.device.type == "cpu"

    def prefetch(self, sparse: SparseFeatures) -> None:
        if self.can_prefetch and torch.is_grad_enabled():
            self._ahead = RemapAhead(self.shard.id_maps, sparse)

    def lookup(self, sparse: SparseFeatures) -> torch.Tensor:
        if torch.is_grad_enabled():
            self.shard.set_lr_factor(self.lr_factor)  # for this lookup's update, in backward
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            return self.shard(sparse, ahead.take(sparse))
        return self.shard(sparse.to(self.device, non_blocking=True))

    def _settled(self) -> EmbeddingShard:
        """The shard, no remap running ahead (its state is read or replaced)."""
        if self._ahead is not None:
            raise RuntimeError("the tables' state was read while the next batch was remapped ahead")
        return self.shard

    def export_state(self) -> dict[str, torch.Tensor]:
        """Every table's weights and optimizer state, by ``<table>.<name>`` (views)."""
        return self._settled().export_state()

    def import_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`export_state` returned."""
        self._settled().import_state(state)

    def table_weights(self) -> dict[str, torch.Tensor]:
        """Each table's weights (views), by name: what live updates push."""
        return self._settled().table_weights()

    def id_rows(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per dynamic table: (admitted ids sorted, their rows); empty without dynamic tables."""
        maps = self._settled().id_maps
        return maps.id_rows() if maps else {}

    def id_owners(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per dynamic table: (row_id int64 [R], used bool [R]) views, the id each row holds."""
        return self._settled().id_owners()

    def id_stats(self) -> dict[str, dict[str, int]]:
        if self._ahead is not None:  # progress output between steps: the next batch's remap counted
            self._ahead.wait()
        return self.shard.id_stats()

    def trained_rows(self, sparse: SparseFeatures) -> torch.Tensor:
        """The rows the last training lookup (of ``sparse``) read: its values, dynamic tables'
        ids remapped."""
        values = self.shard.trained_values
        if values is not None and values.numel() != sparse.values.numel():
            raise RuntimeError("trained_rows: the last training lookup was of another batch")
        return sparse.values if values is None else values

    def live_start(self, publish: Callable[[], str] | None) -> str:
        """One process holds everything: publishing is all there is to do."""
        return publish() if publish is not None else ""

    def checkpoint(self, cut: CutRequest) -> tuple[dict, dict]:
        """The tables are here: their trained rows (changed since the cut's base), for this
        process's writer."""
        if cut.taken:
            return {}, {}
        files, record = snapshot_tables(self._settled(), cut.base_step, "embeddings")
        self.shard.touched.close_cut(cut.step)
        return files, record

    def restore(self, checkpoint: Path) -> None:
        CheckpointTables(checkpoint).load_into(self._settled())

    @property
    def kernel(self) -> str:
        return self.shard.kernel_name
