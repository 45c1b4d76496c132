"""The trainer-side view of the embedding tables: one interface, interchangeable backends.

A trainer asks its :class:`EmbeddingClient` for the pooled embeddings of a batch; the result is
part of the autograd graph, and the backward pass hands the embedding gradients back to
whoever holds the tables, which applies the fused optimizer. Backends:

* :class:`~embedding_server.client.local.InProcessEmbeddingClient`: the tables live in this process
  (single-node training);
* :class:`~embedding_server.client.distributed.DistributedEmbeddingClient`: the tables live on
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

if TYPE_CHECKING:
    from embedding_server.checkpoint.snapshot import CutRequest
    from embedding_server.planner import ShardingPlan
    from embedding_server.towers.layout import TowerLayout


class EmbeddingClient(ABC):
    """Pooled embedding lookups with updates applied on backward: everything a trainer asks of
    whoever holds the tables."""

    tables: list[TableSpec]
    """The model's tables."""
    feature_tables: list[int]
    """The table each categorical feature of a lookup reads (index into ``tables``)."""
    lr_factor: float = 1.0
    """The learning-rate factor of the training lookups made from now on (the trainer's
    schedule): their updates step the rows by ``embedding.optimizer.lr`` x this."""

    @abstractmethod
    def lookup(self, sparse: SparseFeatures) -> torch.Tensor:
        """Ids of F features for B examples -> pooled embeddings float [B, sum(output_dims())].

        Calling ``backward`` through the result updates the tables (in training mode).
        """

    @abstractmethod
    def checkpoint(self, cut: CutRequest) -> tuple[dict, dict] | None:
        """Snapshot the tables' trained rows (and optimizer state) for checkpoint ``cut``: returns
        (files, record) for this process's writer when the tables are here, None when whoever
        holds them writes them (every trainer calls this at the same step)."""

    @abstractmethod
    def restore(self, checkpoint: Path) -> None:
        """Load the tables from a checkpoint written with any sharding."""

    def rollback(self, checkpoint: Path) -> None:
        """Load the tables of an earlier checkpoint of this job while it runs (every trainer
        calls it; the best model at the end of a run): here, the same as :meth:`restore`."""
        self.restore(checkpoint)

    @abstractmethod
    def live_start(self, publish: Callable[[], str] | None) -> str:
        """Start live updates: ``publish()`` (on the master) publishes the live version; returns its
        name, known to every process that pushes rows to it."""

    def output_dims(self) -> list[int]:
        """Dims of the vectors :meth:`lookup` returns side by side: one per feature (its table's
        dim), or, with tower modules on the servers, one per tower output."""
        return [self.tables[t].dim for t in self.feature_tables]

    @property
    def can_prefetch(self) -> bool:
        """Whether :meth:`prefetch` sends anything ahead (tables on other processes)."""
        return False

    def prefetch(self, sparse: SparseFeatures) -> None:  # noqa: B027 (nothing to send in process)
        """Start the next training lookup of ``sparse`` while the current step computes; the
        next :meth:`lookup` must be of this very batch. In process there is nothing to send."""

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

    def id_stats(self) -> dict[str, dict[str, int]]:
        """Per dynamic table: rows_used, admitted, evicted, default_lookups, as held here (a
        distributed client holds none: the servers report theirs when they stop)."""
        return {}

    @property
    @abstractmethod
    def kernel(self) -> str:
        """Name of the embedding kernel in use (``fbgemm``, ``torch``, or where it runs)."""

    def close(self) -> None:  # noqa: B027 (nothing to release in process)
        """Release connections or processes."""
