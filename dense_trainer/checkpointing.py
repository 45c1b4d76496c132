"""The trainer's checkpoints: what a run needs besides tensors, and writing / restoring it all.

A checkpoint is written by every process that holds state (``embedding_server.checkpoint`` has
the atomic format): the tables by whoever holds them (this process, or every embedding server),
the dense model, its optimizer and :class:`TrainState` by the master trainer, which then makes
the checkpoint current. ``--resume`` restores all of it and the loader restarts at the saved
position, so an interrupted-and-resumed run is bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from dense_trainer.config import Config
from dlrm_core.batch import Position
from dlrm_core.errors import CheckpointError
from dlrm_core.schema import FeatureSpec
from embedding_server.checkpoint import (
    finalize_checkpoint,
    load_file,
    partial_dir,
    read_manifest,
    save_file,
)
from embedding_server.client import EmbeddingClient

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Everything besides tensors needed to continue a run exactly."""

    step: int = 0
    samples_seen: int = 0
    position: Position = field(default_factory=Position)
    positions: list[Position] = field(default_factory=list)
    """Every data share's resume position (one per trainer; in a checkpoint, all trainers')."""
    train_seconds: float = 0.0
    data_wait_seconds: float = 0.0
    history: list[dict] = field(default_factory=list)
    bad_lines: dict = field(default_factory=dict)
    parse_rows: int = 0
    parse_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step, "samples_seen": self.samples_seen, "position": self.position.to_dict(),
            "positions": [p.to_dict() for p in self.positions],
            "train_seconds": self.train_seconds, "data_wait_seconds": self.data_wait_seconds,
            "history": self.history, "bad_lines": self.bad_lines, "parse_rows": self.parse_rows,
            "parse_seconds": self.parse_seconds,
        }

    @classmethod
    def from_dict(cls, t: dict[str, Any]) -> TrainState:
        return cls(
            step=t["step"], samples_seen=t["samples_seen"], position=Position(**t["position"]),
            positions=[Position(**p) for p in t.get("positions", [])],
            train_seconds=t["train_seconds"], data_wait_seconds=t["data_wait_seconds"],
            history=list(t["history"]), bad_lines=dict(t["bad_lines"]), parse_rows=t["parse_rows"],
            parse_seconds=t["parse_seconds"],
        )


class Checkpointed(Protocol):
    """What a checkpoint is made of: the trainer (``train.py``) as seen from here."""

    cfg: Config
    spec: FeatureSpec
    client: EmbeddingClient
    model: nn.Module
    optimizer: torch.optim.Optimizer
    state: TrainState
    towers: Any  # TowerLayout | None
    is_master: bool
    checkpoint_dir: Path

    def wait_for_master(self) -> None: ...


def compat_meta(trainer: Checkpointed) -> dict[str, Any]:
    """What must match between a checkpoint and the model restoring it."""
    cfg, layout = trainer.cfg, trainer.towers
    return {
        "feature_spec": trainer.spec.model_dump(),
        "model": cfg.model.model_dump(),
        "embedding_dim": cfg.embedding.dim,
        "sparse_optimizer": cfg.embedding.optimizer.kind,
        "dense_optimizer": cfg.optim.kind,
        "towers": {"towers": [t.model_dump() for t in layout.plan.towers], "out_dim": layout.out_dim}
        if layout else None,
    }


def save_checkpoint(trainer: Checkpointed) -> Path:
    """Every trainer calls this at the same step; the master makes the checkpoint current."""
    s = trainer.state
    # The master empties the partial directory before anyone writes into it (servers write
    # only after the master's CHECKPOINT header), so no leftover of a crashed run joins it.
    directory = partial_dir(trainer.checkpoint_dir, s.step, fresh=trainer.is_master)
    trainer.client.save(directory, s.step)  # the tables: here, or on every embedding server
    if not trainer.is_master:
        trainer.wait_for_master()
        return trainer.checkpoint_dir / f"step-{s.step:010d}"
    save_file(directory, "dense.pt", trainer.model.state_dict())
    save_file(directory, "optimizer.pt", trainer.optimizer.state_dict())
    save_file(directory, "trainer.pt", {**s.to_dict(), "torch_rng": torch.get_rng_state()})
    plan = trainer.client.plan
    meta = {**compat_meta(trainer), "config": trainer.cfg.model_dump(mode="json"), "kernel": trainer.client.kernel,
            "plan": plan.model_dump() if plan is not None else None}
    path = finalize_checkpoint(trainer.checkpoint_dir, s.step, meta, keep=trainer.cfg.train.keep_checkpoints)
    trainer.wait_for_master()
    log.info("checkpoint written: %s", path)
    return path


def load_checkpoint(trainer: Checkpointed, path: Path) -> TrainState:
    """Restore tables, dense model, optimizer and RNG from ``path``; return the run's state."""
    manifest = read_manifest(path)
    saved, mine = manifest["meta"], compat_meta(trainer)
    for key, value in mine.items():
        if saved.get(key) != value:
            raise CheckpointError(
                f"checkpoint {path} does not match this model: {key} differs "
                f"(checkpoint {json.dumps(saved.get(key))[:200]}, now {json.dumps(value)[:200]})"
            )
    trainer.client.restore(path)
    trainer.model.load_state_dict(load_file(path, "dense.pt"))
    trainer.optimizer.load_state_dict(load_file(path, "optimizer.pt"))
    t = load_file(path, "trainer.pt")
    torch.set_rng_state(t["torch_rng"])
    state = TrainState.from_dict(t)
    log.info("resumed from %s (step %d, %d samples seen)", path, state.step, state.samples_seen)
    return state
