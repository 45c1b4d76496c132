"""The learning-rate schedule (``[schedule]``): one factor per step, applied to both sides, the
dense optimizer's rate (``optim.lr``) and the embedding rows' (``embedding.optimizer.lr``).

    factor(step, epoch) = warm-up(step) x decay(step, epoch)

    warm-up   linear from 1/warmup_steps to 1 over the first ``warmup_steps`` steps
    decay     none; linear or cosine from 1 at ``decay_start_step`` to ``min_factor``
              ``decay_steps`` later (then flat), as TorchRec's DLRM example and MLPerf's
              DLRM-DCNv2 recipe; or epoch: ``epoch_gamma`` ** epoch (0-based), at least
              ``min_factor``: for a few passes over a small table, where the best model usually
              comes at the end of an early epoch

A step's factor is a function of its number and epoch alone, so a resumed run continues the same
schedule. The trainer sets the dense rate before each step; the embedding rate travels with the
step's training lookup (``EmbeddingClient.lr_factor``): the in-process tables apply it to their
kernels, the embedding servers receive it in the lookup's message and apply it to that step's
update, even when the update runs after the next lookup (pipelining).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from dlrm_core.config import Section


class ScheduleConfig(Section):
    """The learning-rate schedule of both the dense and the embedding optimizer."""

    warmup_steps: int = Field(default=0, ge=0)
    """Steps of linear warm-up (0: none)."""
    decay: Literal["none", "linear", "cosine", "epoch"] = "none"
    """none; linear or cosine over ``decay_steps`` from ``decay_start_step``; epoch: times
    ``epoch_gamma`` per finished epoch."""
    decay_start_step: int = Field(default=0, ge=0)
    """linear / cosine: the step the decay starts at."""
    decay_steps: int = Field(default=0, ge=0)
    """linear / cosine: steps from full rate to ``min_factor``."""
    min_factor: float = Field(default=0.0, ge=0, le=1)
    """The smallest factor the decay reaches (0: down to no learning at all)."""
    epoch_gamma: float = Field(default=0.5, gt=0, le=1)
    """epoch: the factor each finished epoch multiplies the rate by."""

    @model_validator(mode="after")
    def _steps_given(self) -> ScheduleConfig:
        if self.decay in ("linear", "cosine") and self.decay_steps == 0:
            raise ValueError(f"schedule.decay = {self.decay!r} needs schedule.decay_steps > 0")
        return self

    @property
    def constant(self) -> bool:
        return self.warmup_steps == 0 and self.decay == "none"


def lr_factor(cfg: ScheduleConfig, step: int, epoch: int) -> float:
    """The factor of the rates for step ``step`` (1-based) of epoch ``epoch`` (0-based)."""
    warm = min(1.0, step / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    if cfg.decay == "epoch":
        return warm * max(cfg.min_factor, cfg.epoch_gamma**epoch)
    if cfg.decay == "none":
        return warm
    t = min(1.0, max(0.0, (step - cfg.decay_start_step) / cfg.decay_steps))
    if cfg.decay == "linear":
        shape = 1.0 - t
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * t))
    return warm * (cfg.min_factor + (1.0 - cfg.min_factor) * shape)


def set_dense_rate(optimizer, factor: float) -> None:
    """Set every parameter group's rate to its initial rate x ``factor``."""
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        base = group.setdefault("initial_lr", group["lr"])
        group["lr"] = base * factor
