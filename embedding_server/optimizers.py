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

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field


class DenseOptimizerConfig(BaseModel):
    """Optimizer of the dense parameters (MLPs and interaction; tower modules on the servers)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    kind: Literal["adam", "adagrad", "sgd"] = "adam"
    """adam, adagrad or sgd."""
    lr: float = Field(default=3e-3, gt=0)
    """Learning rate of the dense parameters."""
    weight_decay: float = Field(default=0.0, ge=0)
    """L2 weight decay of the dense parameters."""
    eps: float = Field(default=1e-8, gt=0)
    """Denominator epsilon of Adam/Adagrad."""


def build_dense_optimizer(cfg: DenseOptimizerConfig, params) -> torch.optim.Optimizer | None:
    """The dense optimizer (fused kernel where the device has one); None without parameters."""
    params = list(params)
    if not params:
        return None
    kwargs: dict[str, Any] = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    cls = {"adam": torch.optim.Adam, "adagrad": torch.optim.Adagrad, "sgd": torch.optim.SGD}[cfg.kind]
    if cfg.kind != "sgd":
        kwargs["eps"] = cfg.eps
    try:
        return cls(params, fused=True, **kwargs)
    except (RuntimeError, TypeError):  # no fused kernel for this device/dtype
        return cls(params, foreach=True, **kwargs)


SparseOptimizerKind = Literal["rowwise_adagrad", "adagrad", "adam", "sgd"]


class SparseOptimizerConfig(BaseModel):
    """The optimizer that embedding shards apply to their rows in backward."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    kind: SparseOptimizerKind = "rowwise_adagrad"
    """rowwise_adagrad (one accumulator per row: 4 bytes/row of state, the DLRM default),
    adagrad (one per element), adam (two per element) or sgd (no state)."""
    lr: float = Field(default=0.2, gt=0)
    """Learning rate of the embedding rows."""
    eps: float = Field(default=1e-8, gt=0)
    """Denominator epsilon of Adagrad/Adam."""
    initial_accumulator: float = Field(default=1e-4, ge=0)
    """Starting value of the (row-wise) Adagrad accumulators, as Keras/TF Adagrad's
    ``initial_accumulator_value``: damps the first, noisiest updates of rarely seen rows."""
    beta1: float = Field(default=0.9, ge=0, lt=1)
    """Adam's first-moment decay."""
    beta2: float = Field(default=0.999, ge=0, lt=1)
    """Adam's second-moment decay."""


def state_shapes(kind: SparseOptimizerKind, rows: int, dim: int) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the optimizer state of one table."""
    if kind == "rowwise_adagrad":
        return {"momentum1": (rows,)}
    if kind == "adagrad":
        return {"momentum1": (rows, dim)}
    if kind == "adam":
        return {"exp_avg": (rows, dim), "exp_avg_sq": (rows, dim)}
    return {}


def state_bytes_per_row(kind: SparseOptimizerKind, dim: int) -> int:
    return 4 * sum(int(torch.Size(s[1:]).numel()) for s in state_shapes(kind, 1, dim).values())


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
