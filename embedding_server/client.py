"""The trainer-side view of the embedding tables: one interface, interchangeable backends.

A trainer asks its :class:`EmbeddingClient` for the pooled embeddings of a batch; the result is
part of the autograd graph, and the backward pass hands the embedding gradients back to
whoever holds the tables, which applies the fused optimizer. Backends:

* :class:`InProcessEmbeddingClient`: the tables live in this process (single-node training);
* :class:`~embedding_server.dist_client.DistributedEmbeddingClient`: the tables live on
  embedding servers (``torch.distributed``); the same calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dlrm_core.batch import SparseFeatures
from dlrm_core.schema import TableSpec
from embedding_server.checkpoint import save_file
from embedding_server.optimizers import SparseOptimizerConfig
from embedding_server.shard import EmbeddingShard, LocalTable
from embedding_server.table_checkpoint import CheckpointTables, shard_payload

if TYPE_CHECKING:
    from embedding_server.planner import ShardingPlan
    from embedding_server.towers.layout import TowerLayout


class EmbeddingClient(ABC):
    """Pooled embedding lookups with updates applied on backward: everything a trainer asks of
    whoever holds the tables."""

    tables: list[TableSpec]
    """The model's tables."""
    feature_tables: list[int]
    """The table each categorical feature of a lookup reads (index into ``tables``)."""

    @abstractmethod
    def lookup(self, sparse: SparseFeatures) -> torch.Tensor:
        """Ids of F features for B examples -> pooled embeddings float [B, sum(output_dims())].

        Calling ``backward`` through the result updates the tables (in training mode).
        """

    @abstractmethod
    def save(self, directory: Path, step: int) -> None:
        """Write the tables and their optimizer state into a (partial) checkpoint directory."""

    @abstractmethod
    def restore(self, checkpoint: Path) -> None:
        """Load the tables from a checkpoint written with any sharding."""

    @abstractmethod
    def live_start(self, publish: Callable[[], str] | None) -> str:
        """Start live updates: ``publish()`` (on the master) publishes the live version; returns its
        name, known to every process that pushes rows to it."""

    def output_dims(self) -> list[int]:
        """Dims of the vectors :meth:`lookup` returns side by side: one per feature (its table's
        dim), or, with tower modules on the servers, one per tower output."""
        return [self.tables[t].dim for t in self.feature_tables]

    @property
    def plan(self) -> ShardingPlan | None:
        """Where the tables live across embedding servers (None: in this process)."""
        return None

    @property
    def tower_layout(self) -> TowerLayout | None:
        """The DMT towers whose modules run where the tables live (None: the flat model)."""
        return None

    @property
    def stats(self) -> dict[str, float]:
        """Traffic and time counters of the lookups so far (empty when nothing crosses a wire)."""
        return {}

    @property
    @abstractmethod
    def kernel(self) -> str:
        """Name of the embedding kernel in use (``fbgemm``, ``torch``, or where it runs)."""

    def close(self) -> None:  # noqa: B027 (nothing to release in process)
        """Release connections or processes."""


class InProcessEmbeddingClient(EmbeddingClient):
    """All tables in one :class:`EmbeddingShard` inside the trainer process.

    Args:
        tables: the model's tables.
        feature_tables: the table of each categorical feature (None: one feature per table).
    """

    def __init__(
        self,
        tables: list[TableSpec],
        optimizer: SparseOptimizerConfig,
        device: torch.device | str = "cpu",
        seed: int = 0,
        init_scale: float | None = None,
        feature_tables: list[int] | None = None,
    ) -> None:
        self.tables = tables
        self.feature_tables = list(range(len(tables))) if feature_tables is None else list(feature_tables)
        self.shard = EmbeddingShard(
            [LocalTable(t, i) for i, t in enumerate(tables)], optimizer, device, seed, init_scale,
            self.feature_tables,
        )
        self.device = torch.device(device)

    def lookup(self, sparse: SparseFeatures) -> torch.Tensor:
        return self.shard(sparse.to(self.device, non_blocking=True))

    def export_state(self) -> dict[str, torch.Tensor]:
        """Every table's weights and optimizer state, by ``<table>.<name>`` (views)."""
        return self.shard.export_state()

    def import_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`export_state` returned."""
        self.shard.import_state(state)

    def table_weights(self) -> dict[str, torch.Tensor]:
        """Each table's weights (views), by name: what live updates push."""
        return self.shard.table_weights()

    def live_start(self, publish: Callable[[], str] | None) -> str:
        """One process holds everything: publishing is all there is to do."""
        return publish() if publish is not None else ""

    def save(self, directory: Path, step: int) -> None:
        save_file(directory, "embeddings.pt", shard_payload(self.shard))

    def restore(self, checkpoint: Path) -> None:
        CheckpointTables(checkpoint).load_into(self.shard)

    @property
    def kernel(self) -> str:
        return self.shard.kernel_name
