"""fbgemm kernel: all tables of a shard group in one ``SplitTableBatchedEmbeddingBagsCodegen``.

One fused lookup for every table, and the optimizer applied inside the backward kernel (no
embedding gradient is ever materialised). Host memory on CPU, HBM on CUDA.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from dlrm_core.schema import TableSpec
from embedding_server.kernels.optimizers import SparseOptimizerConfig, state_shapes

log = logging.getLogger(__name__)

try:  # fbgemm is a hard requirement of the design; the torch kernel covers its absence.
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        PoolingMode,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    FBGEMM_IMPORT_ERROR: str | None = None
except Exception as exc:  # ImportError, or a CUDA/CPU build mismatch raising at import
    FBGEMM_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

_OPTIM = {
    "rowwise_adagrad": "EXACT_ROWWISE_ADAGRAD",
    "adagrad": "EXACT_ADAGRAD",
    "sgd": "EXACT_SGD",
    "adam": "ADAM",
}


def fbgemm_supports(
    cfg: SparseOptimizerConfig, device: torch.device, tables: list[TableSpec]
) -> str | None:
    """None if fbgemm can run these tables and this optimizer on this device, else why not."""
    if FBGEMM_IMPORT_ERROR is not None:
        return f"fbgemm_gpu cannot be imported ({FBGEMM_IMPORT_ERROR})"
    if device.type == "cpu" and cfg.kind == "adam":
        return "fbgemm's CPU build has no fused Adam"
    odd = [t for t in tables if t.dim % 4]
    if odd:
        return f"fbgemm needs dims that are multiples of 4 (table {odd[0].name} has {odd[0].dim})"
    return None


class TBEKernel(nn.Module):
    """Tables of one pooling mode, looked up and updated by fbgemm.

    Args:
        tables: the (local pieces of the) tables, all with the same pooling.
        optimizer: the fused sparse optimizer.
        device: cpu or cuda.
        feature_table_map: the table each input feature reads (None: one feature per table).
    """

    def __init__(
        self,
        tables: list[TableSpec],
        optimizer: SparseOptimizerConfig,
        device: torch.device,
        feature_table_map: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.tables = tables
        self.optimizer = optimizer
        on_cuda = device.type == "cuda"
        location = EmbeddingLocation.DEVICE if on_cuda else EmbeddingLocation.HOST
        compute = ComputeDevice.CUDA if on_cuda else ComputeDevice.CPU
        pooling = {"sum": PoolingMode.SUM, "mean": PoolingMode.MEAN}[tables[0].pooling]
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(t.rows, t.dim, location, compute) for t in tables],
            optimizer=getattr(EmbOptimType, _OPTIM[optimizer.kind]),
            learning_rate=optimizer.lr,
            eps=optimizer.eps,
            beta1=optimizer.beta1,
            beta2=optimizer.beta2,
            pooling_mode=pooling,
            device=device,
            feature_table_map=feature_table_map,
        )

    def forward(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """values int64 [N], offsets int64 [F*B + 1] -> pooled float [B, sum(D_f)]."""
        return self.tbe(values, offsets)

    def set_lr_factor(self, factor: float) -> None:
        """The fused optimizer's rate: ``optimizer.lr`` x ``factor``."""
        self.tbe.set_learning_rate(self.optimizer.lr * factor)

    def weights(self) -> list[torch.Tensor]:
        """Per table, a view of its weights [R_t, D_t]."""
        return list(self.tbe.split_embedding_weights())

    def states(self) -> list[dict[str, torch.Tensor]]:
        """Per table, views of its optimizer state, named and shaped as ``state_shapes``."""
        out = []
        raw = self.tbe.split_optimizer_states() if self.optimizer.kind != "sgd" else []
        for i, t in enumerate(self.tables):
            shapes = state_shapes(self.optimizer.kind, t.rows, t.dim)
            out.append(
                {name: raw[i][j].view(shape) for j, (name, shape) in enumerate(shapes.items())}
            )
        return out

    @property
    def step(self) -> int:
        return int(self.tbe.iter.item())

    @step.setter
    def step(self, value: int) -> None:
        self.tbe.iter.fill_(value)
