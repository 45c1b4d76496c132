"""The optimizers' settings and state shapes: what configs, planners and checkpoints need to know
about them, without torch (so that ``dlrm --help`` and config errors answer at once); the
kernels are in :mod:`embedding_server.kernels.optimizers`."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class DenseOptimizerConfig(BaseModel):
    """Optimizer of the dense parameters (MLPs and interaction; tower modules on the servers)."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True
    )

    kind: Literal["adam", "adagrad", "sgd"] = "adam"
    """adam, adagrad or sgd."""
    lr: float = Field(default=3e-3, gt=0)
    """Learning rate of the dense parameters."""
    weight_decay: float = Field(default=0.0, ge=0)
    """L2 weight decay of the dense parameters."""
    eps: float = Field(default=1e-8, gt=0)
    """Denominator epsilon of Adam/Adagrad."""


SparseOptimizerKind = Literal["rowwise_adagrad", "adagrad", "adam", "sgd"]


class SparseOptimizerConfig(BaseModel):
    """The optimizer that embedding shards apply to their rows in backward."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    kind: SparseOptimizerKind = "adagrad"
    """adagrad (one accumulator per element: the default), rowwise_adagrad (one per row: 4
    bytes/row of state, TorchRec's DLRM recipe; about half the parameter-server memory), adam
    (two per element) or sgd (no state). Per-element state gives each id's first-order scalar
    (``model.first_order``) its own step instead of the one its row's vector shares: on the
    nine data sets of bench/defaults.py mean test AUC 0.7074 against 0.7035 row-wise, higher on
    8 of 9, validation log loss lower on 7 (2026-12-07; without the first-order column the two
    tie, 0.6801 vs 0.6806 on one table)."""
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
    weight_decay: float = Field(default=0.0, ge=0, lt=1)
    """Decoupled weight decay of the rows a training batch touches (0: none): each such row
    shrinks by a factor (1 - weight_decay) before its update, so frequent ids are pulled
    toward zero more often than rare ones (fbgemm's ``WeightDecayMode.DECOUPLE`` with
    lr x decay = ``weight_decay``, applied by the shard for every kernel and optimizer)."""


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
    return 4 * sum(math.prod(s[1:]) for s in state_shapes(kind, 1, dim).values())
