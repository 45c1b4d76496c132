"""Optimizers, from one place: the sparse (embedding) optimizers fused into the backward pass of a
shard, and the dense optimizer factory used by the trainers' networks and the tower modules.

Each optimizer exists twice with the same maths, state names and state shapes:
in fbgemm's TBE kernels (``EmbOptimType``) and in :func:`apply_sparse_update`, the PyTorch
version used where fbgemm cannot run it (no fbgemm installed, or Adam on CPU, which fbgemm's CPU
build lacks). Because names and shapes agree, a checkpoint written by one loads into the other.

All updates are "exact": gradients of an id that occurs several times in a batch are summed
first, and only rows that occur in the batch are touched (lazy state, as in TorchRec).
"""

from __future__ import annotations

from typing import Any

import torch

from embedding_server.kernels.optimizer_config import (  # noqa: F401 (the optimizers' settings, re-exported)
    DenseOptimizerConfig,
    SparseOptimizerConfig,
    SparseOptimizerKind,
    state_bytes_per_row,
    state_shapes,
)


def build_dense_optimizer(cfg: DenseOptimizerConfig, params) -> torch.optim.Optimizer | None:
    """The dense optimizer (fused kernel where the device has one); None without parameters."""
    params = list(params)
    if not params:
        return None
    kwargs: dict[str, Any] = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    cls = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[
        cfg.kind
    ]
    if cfg.kind != "sgd":
        kwargs["eps"] = cfg.eps
    try:
        return cls(params, fused=True, **kwargs)
    except (RuntimeError, TypeError):  # no fused kernel for this device/dtype
        return cls(params, foreach=True, **kwargs)


@torch.no_grad()
def apply_sparse_update(
    cfg: SparseOptimizerConfig,
    weight: torch.Tensor,
    state: dict[str, torch.Tensor],
    rows: torch.Tensor,
    grad: torch.Tensor,
    step: int,
) -> None:
    """Update the given rows of one table in place.

    Args:
        weight: float [R, D], the table.
        state: the table's optimizer state, shapes as :func:`state_shapes`.
        rows: int64 [U], distinct rows touched by the batch.
        grad: float [U, D], summed gradient of each row.
        step: 1-based optimizer step (Adam's bias correction).
    """
    if cfg.kind == "sgd":
        weight.index_add_(0, rows, grad, alpha=-cfg.lr)
        return
    if cfg.kind == "rowwise_adagrad":
        acc = state["momentum1"]
        new_acc = acc[rows] + grad.pow(2).mean(dim=1)  # [U]
        acc[rows] = new_acc
        scale = cfg.lr / (new_acc.sqrt() + cfg.eps)  # [U]
        weight.index_add_(0, rows, grad * scale.unsqueeze(1), alpha=-1.0)
        return
    if cfg.kind == "adagrad":
        acc = state["momentum1"]
        new_acc = acc[rows] + grad.pow(2)  # [U, D]
        acc[rows] = new_acc
        weight.index_add_(0, rows, grad / (new_acc.sqrt() + cfg.eps), alpha=-cfg.lr)
        return
    if cfg.kind == "adam":
        m = state["exp_avg"][rows].mul_(cfg.beta1).add_(grad, alpha=1 - cfg.beta1)
        v = state["exp_avg_sq"][rows].mul_(cfg.beta2).addcmul_(grad, grad, value=1 - cfg.beta2)
        state["exp_avg"][rows] = m
        state["exp_avg_sq"][rows] = v
        m_hat = m / (1 - cfg.beta1**step)
        v_hat = v / (1 - cfg.beta2**step)
        weight.index_add_(0, rows, m_hat / (v_hat.sqrt() + cfg.eps), alpha=-cfg.lr)
        return
    raise ValueError(f"unknown sparse optimizer {cfg.kind!r}")
