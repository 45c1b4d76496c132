"""PyTorch kernel: the fallback where fbgemm cannot run (not installed, or Adam on CPU).

Same interface, maths, state names and shapes as :mod:`embedding_server.kernels.tbe`; the optimizer
is
fused into backward the same way (a custom autograd function that updates the rows in place
and returns no gradient for the tables).
"""

from __future__ import annotations

import torch
import torch.nn.functional as nnf
from torch import nn

from dlrm_core.schema import TableSpec
from embedding_server.kernels.optimizers import (
    SparseOptimizerConfig,
    apply_sparse_update,
    state_shapes,
)


class _FusedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, placeholder, kernel, values, offsets):  # noqa: ARG004 (placeholder)
        ctx.kernel = kernel
        ctx.settings = kernel.scaled  # the rate at the lookup is its update's, as fbgemm's TBE
        ctx.save_for_backward(values, offsets)
        return kernel.lookup(values, offsets)

    @staticmethod
    def backward(ctx, grad_out):
        values, offsets = ctx.saved_tensors
        ctx.kernel.update(values, offsets, grad_out, ctx.settings)
        return None, None, None, None


class TorchKernel(nn.Module):
    """Tables of one pooling mode as plain tensors, looked up with ``F.embedding_bag``."""

    def __init__(
        self,
        tables: list[TableSpec],
        optimizer: SparseOptimizerConfig,
        device: torch.device,
        feature_table_map: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.tables = tables
        self.feature_table_map = (
            list(range(len(tables))) if feature_table_map is None else list(feature_table_map)
        )
        self.optimizer = optimizer
        self.scaled = optimizer
        """The settings the updates use: the rate scaled by the schedule's factor."""
        self.mode = tables[0].pooling
        self._weights = [torch.zeros(t.rows, t.dim, device=device) for t in tables]
        self._states = [
            {
                name: torch.zeros(shape, device=device)
                for name, shape in state_shapes(optimizer.kind, t.rows, t.dim).items()
            }
            for t in tables
        ]
        # Autograd only calls backward if some input requires grad: this empty tensor does.
        self._placeholder = torch.zeros(0, device=device, requires_grad=True)
        self._step = 0

    def set_lr_factor(self, factor: float) -> None:
        """The optimizer's rate: ``optimizer.lr`` x ``factor`` (the configured settings kept)."""
        self.scaled = self.optimizer.model_copy(update={"lr": self.optimizer.lr * factor})

    def forward(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """values int64 [N], offsets int64 [T*B + 1] -> pooled float [B, sum(D_t)]."""
        if torch.is_grad_enabled():
            return _FusedLookup.apply(self._placeholder, self, values, offsets)
        return self.lookup(values, offsets)

    def _bags(self, offsets: torch.Tensor):
        """(feature, its table, its B + 1 offsets) of every input feature."""
        b = (offsets.numel() - 1) // len(self.feature_table_map)
        for f, t in enumerate(self.feature_table_map):
            yield f, t, offsets[f * b : (f + 1) * b + 1]

    def lookup(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        outs = []
        for _, t, offs in self._bags(offsets):
            ids = values[offs[0] : offs[-1]]
            outs.append(
                nnf.embedding_bag(
                    ids, self._weights[t], offs - offs[0], mode=self.mode, include_last_offset=True
                )
            )  # [B, D_t]
        return torch.cat(outs, dim=1)  # [B, sum(D_f)]

    @torch.no_grad()
    def update(
        self,
        values: torch.Tensor,
        offsets: torch.Tensor,
        grad_out: torch.Tensor,
        settings: SparseOptimizerConfig,
    ) -> None:
        """Sum each table's gradients over every feature that read it, then step its rows once
        (``settings``: the optimizer's as at the lookup)."""
        self._step += 1
        col = 0
        per_table: dict[int, tuple[list, list]] = {}
        for _, t, offs in self._bags(offsets):
            dim = self.tables[t].dim
            grad = grad_out[:, col : col + dim]  # [B, D_t]
            col += dim
            ids = values[offs[0] : offs[-1]]
            if ids.numel() == 0:
                continue
            lengths = offs[1:] - offs[:-1]  # [B]
            bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=ids.device), lengths)
            per_id = grad[bag]  # [n, D_t]
            if self.mode == "mean":
                per_id = per_id / lengths[bag].unsqueeze(1).to(per_id.dtype)
            per_table.setdefault(t, ([], []))[0].append(ids)
            per_table[t][1].append(per_id)
        for t, (ids, grads) in sorted(per_table.items()):
            rows, inverse = torch.unique(torch.cat(ids), return_inverse=True)
            summed = torch.zeros(
                rows.numel(), self.tables[t].dim, dtype=grad_out.dtype, device=grad_out.device
            )
            summed.index_add_(0, inverse, torch.cat(grads))  # [U, D_t]
            apply_sparse_update(
                settings, self._weights[t], self._states[t], rows, summed, self._step
            )

    def weights(self) -> list[torch.Tensor]:
        return list(self._weights)

    def states(self) -> list[dict[str, torch.Tensor]]:
        return self._states

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value
