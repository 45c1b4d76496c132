"""An embedding shard: the tables (or table pieces) one process holds, with a fused optimizer.

This is the module an embedding server runs, and the module the single-process trainer embeds.
Tables are grouped by pooling mode; each group is one kernel (fbgemm TBE when it can run the
configured optimizer on the device, else the PyTorch kernel, said loudly in the log), so a
lookup is one fused call per group.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from dlrm_core.batch import SparseFeatures
from dlrm_core.schema import TableSpec
from embedding_server.optimizers import SparseOptimizerConfig
from embedding_server.tbe import TBEKernel, fbgemm_supports
from embedding_server.torch_kernel import TorchKernel

log = logging.getLogger(__name__)

INIT_BLOCK_ROWS = 65536
"""Rows initialised from one seed: any row range initialises identically whatever the sharding."""


@dataclass(frozen=True)
class LocalTable:
    """The piece of a global table that a shard holds: rows [row_start, row_start + spec.rows),
    columns [col_start, col_start + spec.dim)."""

    table: TableSpec
    """The whole table."""
    index: int
    """Position of the table in the model's feature spec (seeds its initialisation)."""
    row_start: int = 0
    col_start: int = 0
    rows: int | None = None
    dim: int | None = None
    pooling: str | None = None
    """Pooling of the piece, when it differs from the table's (row-wise pieces of a mean-pooled
    table pool with sum; the trainer divides by the whole bag's length)."""

    @property
    def spec(self) -> TableSpec:
        """The local piece as a table of its own."""
        return self.table.model_copy(
            update={
                "rows": self.rows or self.table.rows,
                "dim": self.dim or self.table.dim,
                "pooling": self.pooling or self.table.pooling,
            }
        )


def init_rows(local: LocalTable, seed: int, init_scale: float | None = None) -> torch.Tensor:
    """Initial weights of a table piece, float [R, D]: uniform(+-init_scale), or
    uniform(+-sqrt(1/rows)) as in TorchRec and the DLRM reference when ``init_scale`` is None.

    Each block of INIT_BLOCK_ROWS rows has its own seed, so a row's initial value does not
    depend on how the table is sharded.
    """
    spec, table = local.spec, local.table
    bound = init_scale if init_scale else math.sqrt(1.0 / table.rows)
    out = torch.empty(spec.rows, spec.dim)
    first, last = local.row_start, local.row_start + spec.rows
    for block in range(first // INIT_BLOCK_ROWS, (last - 1) // INIT_BLOCK_ROWS + 1):
        lo = block * INIT_BLOCK_ROWS
        hi = min(lo + INIT_BLOCK_ROWS, table.rows)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + local.index) * 1_000_003 + block)
        full = torch.empty(hi - lo, table.dim).uniform_(-bound, bound, generator=gen)
        a, b = max(lo, first), min(hi, last)
        out[a - first : b - first] = full[a - lo : b - lo, local.col_start : local.col_start + spec.dim]
    return out


class EmbeddingShard(nn.Module):
    """Table pieces held by one process, looked up and updated together.

    Args:
        tables: the pieces.
        optimizer: fused sparse optimizer.
        device: where the tables live (``cpu``: host memory).
        seed: initialisation seed.
        init_scale: initial weights are uniform(+-init_scale); None: +-sqrt(1/rows).
        feature_map: the piece each input feature of a lookup reads (several features may read
            one table); None: one feature per piece, in order.

    Example:
        >>> from dlrm_core.schema import TableSpec
        >>> shard = EmbeddingShard([LocalTable(TableSpec(name="C1", rows=10, dim=4), 0)],
        ...                        SparseOptimizerConfig())
        >>> shard(SparseFeatures.one_hot(torch.tensor([[1, 2, 3]]))).shape
        torch.Size([3, 4])
    """

    def __init__(
        self,
        tables: list[LocalTable],
        optimizer: SparseOptimizerConfig,
        device: torch.device | str = "cpu",
        seed: int = 0,
        init_scale: float | None = None,
        feature_map: list[int] | None = None,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.init_scale = init_scale
        self.local_tables = tables
        self.optimizer_config = optimizer
        self.feature_map = list(range(len(tables))) if feature_map is None else list(feature_map)
        reason = fbgemm_supports(optimizer, device, [t.spec for t in tables])
        if reason is not None:
            log.warning(
                "EMBEDDING KERNEL FALLBACK: %s; using the PyTorch kernel (same maths, slower).",
                reason,
            )
        self.kernel_name = "fbgemm" if reason is None else "torch"
        kernel_cls = TBEKernel if reason is None else TorchKernel

        # One kernel per pooling mode (in order of first appearance), over the features whose
        # table pools that way; a table belongs to exactly one kernel.
        pooling = [tables[t].spec.pooling for t in self.feature_map]
        poolings = list(dict.fromkeys(pooling))
        self.group_features = [[i for i, p in enumerate(pooling) if p == mode] for mode in poolings]
        self.group_tables = [list(dict.fromkeys(self.feature_map[i] for i in feats)) for feats in self.group_features]
        self.kernels = nn.ModuleList(
            kernel_cls([tables[t].spec for t in group], optimizer, device,
                       [group.index(self.feature_map[i]) for i in feats])
            for feats, group in zip(self.group_features, self.group_tables, strict=True)
        )
        dims = [tables[t].spec.dim for t in self.feature_map]
        starts = [sum(dims[:i]) for i in range(len(dims))]
        group_cols = [
            torch.cat([torch.arange(starts[i], starts[i] + dims[i]) for i in feats])
            for feats in self.group_features
        ]
        # Column permutation from grouped output back to feature order (None: already in order).
        order = torch.cat(group_cols) if group_cols else torch.zeros(0, dtype=torch.int64)
        self._unpermute = (
            None
            if len(self.kernels) <= 1
            else torch.empty_like(order).scatter_(0, order, torch.arange(order.numel())).to(device)
        )
        self.reset_parameters(seed)

    @property
    def output_dim(self) -> int:
        return sum(self.local_tables[t].spec.dim for t in self.feature_map)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Seeded initial weights; optimizer state zero (Adagrad accumulators at their start value)."""
        weights = self._table_views()
        for local, w in zip(self.local_tables, weights, strict=True):
            w.copy_(init_rows(local, seed, self.init_scale))
        start = self.optimizer_config.initial_accumulator
        for state in self._state_views():
            for name, tensor in state.items():
                tensor.fill_(start if name == "momentum1" else 0.0)

    def forward(self, sparse: SparseFeatures) -> torch.Tensor:
        """Pooled embeddings of every bag: ids of F features for B examples -> float [B, sum(D_f)]."""
        if len(self.kernels) == 1:
            return self.kernels[0](sparse.values, sparse.offsets)
        outs = [
            kernel(sub.values, sub.offsets)
            for kernel, sub in zip(
                self.kernels, (sparse.select_features(f) for f in self.group_features), strict=True
            )
        ]
        return torch.cat(outs, dim=1).index_select(1, self._unpermute)  # [B, sum(D_f)]

    # -- state ------------------------------------------------------------------------------

    def _table_views(self) -> list[torch.Tensor]:
        views: list[torch.Tensor | None] = [None] * len(self.local_tables)
        for kernel, group in zip(self.kernels, self.group_tables, strict=True):
            for t, w in zip(group, kernel.weights(), strict=True):
                views[t] = w
        return views  # type: ignore[return-value]

    def _state_views(self) -> list[dict[str, torch.Tensor]]:
        views: list[dict[str, torch.Tensor]] = [{} for _ in self.local_tables]
        for kernel, group in zip(self.kernels, self.group_tables, strict=True):
            for t, s in zip(group, kernel.states(), strict=True):
                views[t] = s
        return views

    def table_weights(self) -> dict[str, torch.Tensor]:
        """Each table piece's weights (views, not copies), by table name."""
        return {t.table.name: w for t, w in zip(self.local_tables, self._table_views(), strict=True)}

    def export_state(self) -> dict[str, torch.Tensor]:
        """Weights, optimizer state and step as flat named tensors (views), for checkpoints."""
        out: dict[str, torch.Tensor] = {}
        for t, w, s in zip(self.local_tables, self._table_views(), self._state_views(), strict=True):
            out[f"{t.table.name}.weight"] = w
            for name, tensor in s.items():
                out[f"{t.table.name}.{name}"] = tensor
        out["step"] = torch.tensor(self.kernels[0].step if len(self.kernels) else 0)
        return out

    @torch.no_grad()
    def import_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a state written by :meth:`export_state` (of either kernel) into this shard."""
        mine = self.export_state()
        missing = sorted(set(mine) - set(state))
        if missing:
            raise KeyError(f"checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        for name, dst in mine.items():
            if name == "step":
                continue
            src = state[name]
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)}, model {tuple(dst.shape)}")
            dst.copy_(src)
        for kernel in self.kernels:
            kernel.step = int(state["step"])
