"""The trainer-side view of the embedding tables: one interface, interchangeable backends.

A trainer asks its :class:`EmbeddingClient` for the pooled embeddings of a batch; the result is
part of the autograd graph, and the backward pass hands the embedding gradients back to
whoever holds the tables, which applies the fused optimizer. Backends:

* :class:`InProcessEmbeddingClient`: the tables live in this process (single-node training);
* a distributed client (embedding servers over ``torch.distributed``) implements the same calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch

from embedding_server.checkpoint import save_file
from embedding_server.features import TableSpec
from embedding_server.optimizers import SparseOptimizerConfig
from embedding_server.shard import EmbeddingShard, LocalTable
from embedding_server.sparse import SparseFeatures
from embedding_server.table_checkpoint import CheckpointTables, shard_payload


class EmbeddingClient(ABC):
    """Pooled embedding lookups with updates applied on backward."""

    tables: list[TableSpec]

    @abstractmethod
    def lookup(self, sparse: SparseFeatures) -> torch.Tensor:
        """Ids of F tables for B examples -> pooled embeddings float [B, sum(D_t)], table order.

        Calling ``backward`` through the result updates the tables (in training mode).
        """

    @abstractmethod
    def export_state(self) -> dict[str, torch.Tensor]:
        """Every table's weights and optimizer state, by ``<table>.<name>``."""

    @abstractmethod
    def import_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what :meth:`export_state` returned."""

    @abstractmethod
    def save(self, directory: Path, step: int) -> None:
        """Write the tables and their optimizer state into a (partial) checkpoint directory."""

    @abstractmethod
    def restore(self, checkpoint: Path) -> None:
        """Load the tables from a checkpoint written with any sharding."""

    def output_dims(self) -> list[int]:
        """Dims of the vectors :meth:`lookup` returns side by side: one per table, or, with
        tower modules on the servers, one per tower output."""
        return [t.dim for t in self.tables]

    @property
    def kernel(self) -> str:
        """Name of the embedding kernel in use (``fbgemm`` or ``torch``)."""
        return "unknown"

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections or processes."""


class InProcessEmbeddingClient(EmbeddingClient):
    """All tables in one :class:`EmbeddingShard` inside the trainer process."""

    def __init__(
        self,
        tables: list[TableSpec],
        optimizer: SparseOptimizerConfig,
        device: torch.device | str = "cpu",
        seed: int = 0,
        init_scale: float | None = None,
    ) -> None:
        self.tables = tables
        self.shard = EmbeddingShard(
            [LocalTable(t, i) for i, t in enumerate(tables)], optimizer, device, seed, init_scale
        )
        self.device = torch.device(device)

    def lookup(self, sparse: SparseFeatures) -> torch.Tensor:
        return self.shard(sparse.to(self.device, non_blocking=True))

    def export_state(self) -> dict[str, torch.Tensor]:
        return self.shard.export_state()

    def import_state(self, state: dict[str, torch.Tensor]) -> None:
        self.shard.import_state(state)

    def save(self, directory: Path, step: int) -> None:
        save_file(directory, "embeddings.pt", shard_payload(self.shard))

    def restore(self, checkpoint: Path) -> None:
        CheckpointTables(checkpoint).load_into(self.shard)

    @property
    def kernel(self) -> str:
        return self.shard.kernel_name
