"""The trainer's checkpoints: what a run needs besides tensors, when to cut, and restoring it all.

A checkpoint is written by every process that holds state, each from a background thread
(``embedding_server/checkpoint/writer.py``), while training goes on: the tables' trained rows by
whoever holds them (this process, or every embedding server), the dense model, its optimizer and
:class:`TrainState` by the master trainer, whose finaliser makes the checkpoint current once
every writer has recorded its part (``embedding_server/checkpoint/finalizer.py``).

When (:class:`TrainerCheckpoints`): a *full* checkpoint every ``train.checkpoint_every_steps``
steps or ``train.checkpoint_every_s`` seconds; between them, a *delta* (the rows changed since
the last checkpoint, and the dense state) every ``train.checkpoint_delta_every_s`` seconds, a
long chain of deltas compacted by the next full one. One checkpoint is in flight at a time: one
that falls due while the previous is still being written is skipped (training never waits for
storage). The last checkpoint of a run (and the one before publishing) is full and waited for.

``--resume`` restores the latest checkpoint's chain and the loader restarts at the saved position,
so an interrupted-and-resumed run is bit-identical to an uninterrupted one; a resume after a fault
reports the steps it redoes (``OUT/last-fault.json``, left by the launcher).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from dense_trainer.config import Config
from dense_trainer.data.elastic import Consumed
from dlrm_core.batch import Position
from dlrm_core.errors import CheckpointError
from dlrm_core.schema import FeatureSpec
from embedding_server.checkpoint.files import load_file, partial_dir, read_manifest, step_name
from embedding_server.checkpoint.finalizer import Finalizer, PendingCut
from embedding_server.checkpoint.snapshot import CutRequest
from embedding_server.checkpoint.writer import CheckpointWriter
from embedding_server.client.base import EmbeddingClient
from embedding_server.planner import piece_bytes
from embedding_server.runtime.watchdog import io_bound_s

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Everything besides tensors needed to continue a run exactly."""

    step: int = 0
    samples_seen: int = 0
    position: Position = field(default_factory=Position)
    positions: list[Position] = field(default_factory=list)
    """Every data share's resume position (one per trainer; in a checkpoint, all trainers')."""
    consumed: Consumed | None = None
    """What runs with other numbers of trainers read of the current epoch (elastic restarts)."""
    block_bytes: int = 0
    """The block grid the positions refer to (``data.block_bytes`` of the run; 0: unknown)."""
    best: dict | None = None
    """The best validation evaluation so far: step (its checkpoint's name), samples, figures."""
    evals_since_best: int = 0
    """Validation evaluations since the best (early stopping's patience count)."""
    stopped_early: int | None = None
    """The step at which early stopping ended training (None: it did not)."""
    train_seconds: float = 0.0
    data_wait_seconds: float = 0.0
    history: list[dict] = field(default_factory=list)
    bad_lines: dict = field(default_factory=dict)
    parse_rows: int = 0
    parse_seconds: float = 0.0
    stream: dict | None = None
    """Online training (``online.py``): the entries to acknowledge once this checkpoint is
    durable, and the running figures (rows, progressive scores, joins)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "samples_seen": self.samples_seen,
            "position": self.position.to_dict(),
            "positions": [p.to_dict() for p in self.positions],
            "train_seconds": self.train_seconds,
            "data_wait_seconds": self.data_wait_seconds,
            "history": self.history,
            "bad_lines": self.bad_lines,
            "parse_rows": self.parse_rows,
            "parse_seconds": self.parse_seconds,
            "consumed": self.consumed.to_dict() if self.consumed is not None else None,
            "block_bytes": self.block_bytes,
            "best": self.best,
            "evals_since_best": self.evals_since_best,
            "stopped_early": self.stopped_early,
            "stream": self.stream,
        }

    @classmethod
    def from_dict(cls, t: dict[str, Any]) -> TrainState:
        return cls(
            step=t["step"],
            samples_seen=t["samples_seen"],
            position=Position(**t["position"]),
            positions=[Position(**p) for p in t.get("positions", [])],
            train_seconds=t["train_seconds"],
            data_wait_seconds=t["data_wait_seconds"],
            history=list(t["history"]),
            bad_lines=dict(t["bad_lines"]),
            parse_rows=t["parse_rows"],
            parse_seconds=t["parse_seconds"],
            consumed=Consumed.from_dict(t["consumed"]) if t.get("consumed") else None,
            block_bytes=t.get("block_bytes", 0),
            best=t.get("best"),
            evals_since_best=t.get("evals_since_best", 0),
            stopped_early=t.get("stopped_early"),
            stream=t.get("stream"),
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
    cluster: Any  # Cluster | None
    rank: int
    trainers: int
    is_master: bool
    out_dir: Path
    checkpoint_dir: Path
    checkpoints: TrainerCheckpoints

    def wait_for_master(self) -> None: ...


FAULT_FILE = "last-fault.json"
"""Left in the run's directory by the local launcher when it loses a rank."""
KINDS = {0: None, 1: "delta", 2: "full"}


SETTING_OF = {
    "embedding_dim": "embedding.dim",
    "sparse_optimizer": "embedding.optimizer.kind",
    "dense_optimizer": "optim.kind",
}
"""compat_meta keys that one setting decides: a mismatch names the flag that resumes."""


def compat_meta(trainer: Checkpointed) -> dict[str, Any]:
    """What must match between a checkpoint and the model restoring it."""
    cfg, layout = trainer.cfg, trainer.towers
    return {
        "feature_spec": trainer.spec.model_dump(),
        "model": cfg.model.model_dump(),
        "embedding_dim": cfg.embedding.dim,
        "sparse_optimizer": cfg.embedding.optimizer.kind,
        "dense_optimizer": cfg.optim.kind,
        "towers": {
            "towers": [t.model_dump() for t in layout.plan.towers],
            "out_dim": layout.out_dim,
        }
        if layout
        else None,
    }


def model_bytes(trainer: Checkpointed) -> int:
    """Bytes of every table and its optimizer state: what a checkpoint writes at most."""
    kind = trainer.cfg.embedding.optimizer.kind
    return sum(piece_bytes(t.rows, t.dim, kind) for t in trainer.spec.tables)


def storage_rate(cfg: Config) -> float:
    """The slowest write rate still counted as progress: ``dist.io_min_bytes_per_s``, or the
    checkpoint writers' own rate limit when lower."""
    limit = cfg.train.checkpoint_write_bytes_per_s
    return min(cfg.dist.io_min_bytes_per_s, limit) if limit else cfg.dist.io_min_bytes_per_s


def dense_snapshot(trainer: Checkpointed) -> dict[str, Any]:
    """Copies of the master's state at this step (written in the background)."""
    return {
        "dense.pt": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "optimizer.pt": copy.deepcopy(trainer.optimizer.state_dict()),
        "trainer.pt": copy.deepcopy(
            {**trainer.state.to_dict(), "torch_rng": torch.get_rng_state()}
        ),
    }


class TrainerCheckpoints:
    """When a trainer cuts checkpoints, and (on the master) writing and finishing them."""

    def __init__(self, trainer: Checkpointed) -> None:
        self.trainer = trainer
        self.cfg = trainer.cfg.train
        self.last_full = self.last_cut = time.monotonic()
        self.deltas = 0
        self.skipped = 0
        self._last: tuple[int, PendingCut | None] | None = None  # step and (master) cut last taken
        self._writer: CheckpointWriter | None = None
        self._finalizer: Finalizer | None = None

    @property
    def bound_s(self) -> float:
        """How long writing a checkpoint may take before it counts as stuck."""
        cfg = self.trainer.cfg
        return io_bound_s(model_bytes(self.trainer), cfg.dist.timeout_s, storage_rate(cfg))

    @property
    def finalizer(self) -> Finalizer:
        if self._finalizer is None:
            self._finalizer = Finalizer(self.trainer.checkpoint_dir, self.cfg.keep_checkpoints)
        return self._finalizer

    @property
    def writer(self) -> CheckpointWriter:
        if self._writer is None:
            self._writer = CheckpointWriter(
                f"trainer-{self.trainer.rank}", self.cfg.checkpoint_write_bytes_per_s
            )
        return self._writer

    def due(self, step: int) -> str | None:
        """The checkpoint due after ``step`` (full, delta or None), the same on every trainer."""
        c = self.cfg
        by_step = bool(c.checkpoint_every_steps) and step % c.checkpoint_every_steps == 0
        timed = bool(c.checkpoint_every_s or c.checkpoint_delta_every_s)
        if not (by_step or timed):
            return None
        code = self._decide(by_step) if self.trainer.is_master else 0
        if self.trainer.trainers > 1:  # the master decides (its clock, its checkpoint in flight)
            flag = torch.tensor([code])
            dist.broadcast(flag, src=0, group=self.trainer.cluster.trainer_cpu_group)
            code = int(flag.item())
        return KINDS[code]

    def _decide(self, by_step: bool) -> int:
        c, now = self.cfg, time.monotonic()
        full = by_step or bool(
            c.checkpoint_every_s and now - self.last_full >= c.checkpoint_every_s
        )
        delta = bool(
            c.checkpoint_delta_every_s and now - self.last_cut >= c.checkpoint_delta_every_s
        )
        if not (full or delta):
            return 0
        if self._finalizer is not None and self._finalizer.in_flight:
            self.skipped += 1  # the previous one is still being written: training does not wait
            return 0
        latest = self._finalizer.latest_step if self._finalizer else None
        return 2 if full or latest is None or self.deltas >= c.checkpoint_max_deltas else 1

    def cut(self, kind: str = "full", wait: bool = True) -> Path | None:
        """Every trainer calls this at the same step. Returns the checkpoint when ``wait``."""
        t = self.trainer
        step = t.state.step
        if self._last is not None and self._last[0] == step:  # taken at this step already
            return self._join(self._last[1]) if wait else None
        base = self.finalizer.latest_step if t.is_master and kind == "delta" else None
        kind = "delta" if base is not None else "full"
        pending = None
        if t.is_master:
            self.finalizer.check()  # a background checkpoint that failed ends the run here
            # The master empties the partial directory before anyone writes into it (servers
            # write only after the CHECKPOINT header), so no leftover of a crashed run joins it.
            directory = partial_dir(t.checkpoint_dir, step, fresh=True)
            pending = self.finalizer.begin(
                PendingCut(
                    step,
                    kind,
                    step_name(base) if base is not None else None,
                    self._writers(),
                    self._meta(kind),
                    self.bound_s,
                )
            )
        tables = t.client.checkpoint(CutRequest(step, base, wait))  # here, or on every server
        if t.is_master:
            files, record = tables or ({}, {})
            self.writer.submit(directory, {**files, **dense_snapshot(t)}, record)
        self._last = (step, pending)
        self.last_cut = time.monotonic()
        if kind == "full":
            self.last_full, self.deltas = self.last_cut, 0
        else:
            self.deltas += 1
        return self._wait(pending) if wait else None

    def _join(self, pending: PendingCut | None) -> Path:
        """Wait (with every rank) for the checkpoint already taken at this step."""
        self.trainer.client.checkpoint(
            CutRequest(self.trainer.state.step, None, wait=True, taken=True)
        )
        return self._wait(pending)

    def _wait(self, pending: PendingCut | None) -> Path:
        t = self.trainer
        path = None
        if pending is not None:  # the master: until its finaliser has made it current
            with self.phase(f"finishing checkpoint {step_name(pending.step)}"):
                path = self.finalizer.wait(pending, self.bound_s)
        t.wait_for_master()
        return path or t.checkpoint_dir / step_name(t.state.step)

    def _writers(self) -> dict[str, str]:
        t = self.trainer
        out = {f"trainer-{t.rank}": f"trainer {t.rank} (master)"}
        if t.cluster is not None:
            roles = t.cluster.roles
            out.update(
                {
                    f"server-{k}": roles.describe(roles.server_rank(k))
                    for k in range(roles.num_servers)
                }
            )
        return out

    def _meta(self, kind: str) -> dict[str, Any]:
        t = self.trainer
        plan = t.client.plan
        return {
            **compat_meta(t),
            "config": t.cfg.model_dump(mode="json"),
            "kernel": t.client.kernel,
            "plan": plan.model_dump() if plan is not None else None,
            "trainers": t.trainers,
            "cut_time": time.time(),
        }

    def phase(self, what: str):
        """A long wait of this rank on storage, bounded like a checkpoint (the heartbeat's
        phase)."""
        cluster = self.trainer.cluster
        return (
            cluster.heartbeat.phase(what, self.bound_s)
            if cluster is not None
            else contextlib.nullcontext()
        )

    def close(self) -> None:
        """Finish what is being written (bounded), then stop the threads."""
        if self._writer is not None:
            self._writer.close(self.bound_s)
        if self._finalizer is not None:
            self._finalizer.close(self.bound_s)
            self._finalizer.check()


def checkpoint_with(trainer, steps, kind: str = "full", wait: bool = True) -> Path | None:
    """Fold the loaders' counters of ``steps`` (the training ``Steps``) into the state, gather
    every trainer's positions, checkpoint; every trainer calls it at the same step. Returns the
    checkpoint when ``wait``."""
    s = trainer.state
    s.bad_lines = steps.shares[0].loader.bad_lines.state()
    rows = sum(share.loader.stats.rows for share in steps.shares)
    seconds = sum(share.loader.stats.parse_seconds for share in steps.shares)
    rows0, secs0 = trainer._parse_base
    s.parse_rows += rows - rows0
    s.parse_seconds += seconds - secs0
    trainer._parse_base = (rows, seconds)
    mine = s.positions
    if trainer.trainers > 1:  # the checkpoint holds every trainer's positions, in rank order
        parts: list = [None] * trainer.trainers
        dist.all_gather_object(
            parts, [p.to_dict() for p in mine], group=trainer.cluster.trainer_cpu_group
        )
        s.positions = [Position(**p) for part in parts for p in part]
    try:
        return trainer.save_checkpoint(kind, wait)
    finally:
        s.positions = mine


def save_checkpoint(trainer: Checkpointed, kind: str = "full", wait: bool = True) -> Path | None:
    """Every trainer calls this at the same step (see :meth:`TrainerCheckpoints.cut`)."""
    return trainer.checkpoints.cut(kind, wait)


def load_checkpoint(trainer: Checkpointed, path: Path) -> TrainState:
    """Restore tables, dense model, optimizer and RNG from ``path``; return the run's state."""
    manifest = read_manifest(path)
    saved, mine = dict(manifest["meta"]), compat_meta(trainer)
    if isinstance(saved.get("feature_spec"), dict):  # written before a field existed: its default
        saved["feature_spec"] = FeatureSpec.model_validate(saved["feature_spec"]).model_dump()
    for key, value in mine.items():
        if saved.get(key) != value:
            was = saved.get(key)
            hint = f"; resume with --set {SETTING_OF[key]}={was}" if key in SETTING_OF else ""
            raise CheckpointError(
                f"checkpoint {path} does not match this model: {key} differs "
                f"(checkpoint {json.dumps(was)[:200]}, now {json.dumps(value)[:200]}){hint}"
            )
    trainer.client.restore(path)
    trainer.model.load_state_dict(load_file(path, "dense.pt"))
    trainer.optimizer.load_state_dict(load_file(path, "optimizer.pt"))
    t = load_file(path, "trainer.pt")
    torch.set_rng_state(t["torch_rng"])
    state = TrainState.from_dict(t)
    written_by = saved.get("trainers", 1)
    elastic = (
        f"; written by {written_by} trainer(s), resumed by {trainer.trainers}"
        if written_by != trainer.trainers
        else ""
    )
    log.info(
        "resumed from %s (step %d, %d samples seen%s)",
        path,
        state.step,
        state.samples_seen,
        elastic,
    )
    return state


def restore_weights(trainer: Checkpointed, path: Path) -> None:
    """Bring the model of checkpoint ``path`` back into the running job (every trainer calls
    it): the tables wherever they live, the dense model, both optimizers' state. The run's own
    state (steps, samples, history) stays as it is."""
    trainer.client.rollback(path)
    trainer.model.load_state_dict(load_file(path, "dense.pt"))
    trainer.optimizer.load_state_dict(load_file(path, "optimizer.pt"))
    log.info("restored the best model, %s", path.name)


def fault_report(
    trainer: Checkpointed, state: TrainState, checkpoint: Path
) -> dict[str, Any] | None:
    """What the launcher recorded about the fault that ended the previous run, against the
    step resumed from: the updates redone (lost by the fault)."""
    path = trainer.out_dir / FAULT_FILE
    try:
        fault = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if fault.get("time", 0) < read_manifest(checkpoint)["meta"].get("cut_time", 0):
        return None  # an older fault: a later run wrote this checkpoint
    reached = fault.get("step")
    report = {
        **fault,
        "resumed_step": state.step,
        "steps_redone": max(0, reached - state.step) if isinstance(reached, int) else None,
    }
    log.warning(
        "the previous run lost %s (%s) at step %s; resuming from step %d: %s steps of updates "
        "redone",
        fault.get("role"),
        fault.get("how"),
        reached,
        state.step,
        report["steps_redone"],
    )
    return report
