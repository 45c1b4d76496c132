"""The embedding server: the parameter node's loop.

It holds its pieces of the tables (:class:`EmbeddingShard`, fbgemm TBE with the fused
optimizer) and answers the trainers in lockstep, one command per round (see ``wire.py``):

    LOOKUP_TRAIN   ids in -> one fused lookup over every trainer's examples -> pooled out ->
                   gradients in -> backward, which applies the optimizer to the touched rows
    LOOKUP_EVAL    the same without gradients
    CHECKPOINT     snapshot the pieces' trained rows and optimizer state; a background thread
                   writes them into the partial checkpoint (``server_checkpoint.py``)
    LIVE_START     start pushing changed rows to the serving store's current (live) version
    STOP           report timings and leave

What happens between the lookup and the trainers is the server's *stage*: here the flat one
(each trainer gets the pooled vectors of its own examples); DMT's tower stage
(``towers/stage.py``) runs a tower module first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dlrm_core.batch import SparseFeatures
from dlrm_core.schema import FeatureSpec
from embedding_server.ckpt_writer import CheckpointWriter
from embedding_server.cluster import Cluster
from embedding_server.config import DistConfig, EmbeddingConfig, LiveConfig
from embedding_server.live import LivePusher
from embedding_server.planner import ShardingPlan
from embedding_server.server_checkpoint import ServerCheckpoints
from embedding_server.shard import EmbeddingShard
from embedding_server.table_checkpoint import CheckpointTables
from embedding_server.table_snapshot import CutRequest
from embedding_server.wire import EXCHANGE_DTYPES, HEADER, Command, ids_dtype, unpack_ids

log = logging.getLogger(__name__)


class ServerStage(Protocol):
    """What a server does with its pooled embeddings: answer the trainers, take their gradients."""

    def respond(self, pooled: torch.Tensor, batches: list[int], train: bool) -> None:
        """pooled float [sum_r B_r, width] (rows by trainer); batches: B_r of each trainer."""

    def snapshot(self) -> dict[str, Any]:
        """Copies of the stage's own state (if any): checkpoint file name -> object."""

    def restore(self, checkpoint: Path) -> None:
        """Restore the stage's own state (if any)."""


class FlatStage:
    """The flat model: trainer r gets its rows of the pooled vectors [B_r, width] and returns their
    gradient, which runs the fused optimizer."""

    def __init__(self, server: EmbeddingServer) -> None:
        self.server = server

    def respond(self, pooled: torch.Tensor, batches: list[int], train: bool) -> None:
        s = self.server
        world, trainers = s.roles.world_size, s.roles.num_trainers
        send = pooled.detach().to(s.wire_dtype).contiguous()
        out_splits = [0] * world
        in_splits = [b * s.width for b in batches] + [0] * (world - trainers)
        t0 = time.perf_counter()
        s.exchange.all_to_all(torch.empty(0, dtype=s.wire_dtype), send.view(-1), out_splits, in_splits)
        if not train:
            s.timings["wait_s"] += time.perf_counter() - t0
            return
        total = sum(batches)
        grads = torch.empty(total * s.width, dtype=s.wire_dtype)
        s.exchange.all_to_all(grads, torch.empty(0, dtype=s.wire_dtype), in_splits, out_splits)
        s.timings["wait_s"] += time.perf_counter() - t0
        t1 = time.perf_counter()
        if s.shard is not None and total > 0:
            pooled.backward(grads.view(total, s.width).to(pooled.dtype))  # fused optimizer step
        s.timings["update_s"] += time.perf_counter() - t1

    def snapshot(self) -> dict[str, Any]:
        return {}

    def restore(self, checkpoint: Path) -> None:
        pass


class EmbeddingServer:
    """One parameter node of a job.

    Args:
        cluster: this rank's place in the world.
        plan: the sharding plan (this server holds ``plan.pieces_on(its index)``).
        spec: the model's features and tables.
        embedding / dist / live: the config sections (tables and optimizer, wire dtype, live store).
        seed: initialisation seed of the tables.
        checkpoint_root: the job's checkpoints directory.
        stage: builds the stage from this server (default: the flat one).
        writer: its background checkpoint writer (default: unthrottled).
    """

    def __init__(self, cluster: Cluster, plan: ShardingPlan, spec: FeatureSpec, embedding: EmbeddingConfig,
                 dist: DistConfig, live: LiveConfig, seed: int, checkpoint_root: Path,
                 stage: Callable[[EmbeddingServer], ServerStage] | None = None,
                 writer: CheckpointWriter | None = None) -> None:
        self.cluster = cluster
        self.roles = cluster.roles
        self.index = self.roles.server_index(cluster.rank)
        self.pieces = plan.pieces_on(self.index)
        # What it looks up per example: (feature, piece) slots; features sharing a table share pieces.
        self.slots = plan.slots_on(self.index, spec.feature_tables)
        self.slot_piece = [self.pieces.index(p) for _, p in self.slots]
        self.local_tables = [p.local_table(spec.tables[p.table_index]) for p in self.pieces]
        self.shard = EmbeddingShard(self.local_tables, embedding.optimizer, "cpu", seed,
                                    embedding.init_scale or None, self.slot_piece) if self.slots else None
        self.width = sum(p.dim for _, p in self.slots)
        self.checkpoints = ServerCheckpoints(checkpoint_root, self.index, writer)
        self.wire_dtype = EXCHANGE_DTYPES[dist.exchange_dtype]
        self.timings = {"lookup_s": 0.0, "update_s": 0.0, "wait_s": 0.0}
        self.steps = 0
        self.live_config = live
        self.live: LivePusher | None = None
        self.exchange = cluster.exchange
        self.id_dtype = ids_dtype(max((p.rows for p in plan.pieces), default=0))  # as the trainers send
        self.stage: ServerStage = (stage or FlatStage)(self)

    def restore(self, checkpoint: Path) -> None:
        if self.shard is not None:
            CheckpointTables(checkpoint).load_into(self.shard)
            log.info("server %d restored %d pieces from %s", self.index, len(self.pieces), checkpoint)
        self.stage.restore(checkpoint)

    def serve(self) -> dict:
        """Answer commands until STOP; return this server's timings."""
        world = self.roles.world_size
        while True:
            t0 = time.perf_counter()
            headers = torch.zeros(world * HEADER, dtype=torch.int64)
            self.exchange.all_to_all(headers, torch.zeros(world * HEADER, dtype=torch.int64), [HEADER] * world,
                                     [HEADER] * world)
            self.timings["wait_s"] += time.perf_counter() - t0
            h = headers.view(world, HEADER)[: self.roles.num_trainers]
            command = Command(int(h[0, 0]))
            if not bool((h[:, 0] == h[0, 0]).all()):
                raise RuntimeError(f"server {self.index}: trainers disagree on the command: {h[:, 0].tolist()}")
            if command == Command.STOP:
                self.checkpoints.close(self.cluster.slow_timeout_s or 600.0)
                if self.live is not None:
                    self.live.close()
                return {"server": self.index, "steps": self.steps, **self.timings, **self.exchange.stats}
            if command == Command.LIVE_START:
                holder = [None]  # the version the master publishes now (it may take minutes)
                dist.broadcast_object_list(holder, src=0, group=self.cluster.slow_group)
                self.start_live(holder[0])
                continue
            if command == Command.CHECKPOINT:  # the master's header carries the cut
                cut = CutRequest.from_header(int(h[0, 1]), int(h[0, 2]), int(h[0, 3]))
                if not cut.taken:
                    self.checkpoints.cut(self, cut)
                if cut.wait:
                    dist.barrier(group=self.cluster.slow_group)  # while the master finishes it
                continue
            self.lookup(h, train=command == Command.LOOKUP_TRAIN)

    def lookup(self, headers: torch.Tensor, train: bool) -> None:
        """Ids from every trainer -> one fused lookup -> the stage answers (and updates)."""
        world, trainers = self.roles.world_size, self.roles.num_trainers
        counts = [int(c) for c in headers[:, 2]] + [0] * (world - trainers)
        batches = [int(b) for b in headers[:, 3]]
        received = torch.empty(sum(counts), dtype=self.id_dtype)
        t0 = time.perf_counter()
        self.exchange.all_to_all(received, torch.zeros(0, dtype=self.id_dtype), counts, [0] * world)
        self.timings["wait_s"] += time.perf_counter() - t0
        # One fused lookup over all trainers' examples: slot k's bags are trainer 0's, then 1's...
        per_trainer = []
        pos = 0
        slots = len(self.slots)
        for t in range(trainers):
            per_trainer.append(unpack_ids(received[pos : pos + counts[t]], batches[t], slots))
            pos += counts[t]
        total = sum(batches)
        t1 = time.perf_counter()
        if self.shard is not None and total > 0:
            values = torch.cat([per_trainer[t][k][0] for k in range(slots) for t in range(trainers)])
            lengths = torch.stack([torch.cat([per_trainer[t][k][1] for t in range(trainers)]) for k in range(slots)])
            with torch.set_grad_enabled(train):
                pooled = self.shard(SparseFeatures.from_lengths(values, lengths))  # [sum B_t, width]
        else:
            pooled = torch.zeros(total, self.width, requires_grad=train)
        self.timings["lookup_s"] += time.perf_counter() - t1
        self.stage.respond(pooled, batches, train)
        if train:
            self._after_update(per_trainer)

    def _after_update(self, per_trainer: list) -> None:
        self.steps += 1
        if self.live is not None and self.shard is not None:
            for k, p in enumerate(self.slot_piece):
                self.live.mark(p, torch.cat([ids[k][0] for ids in per_trainer]).numpy())
            self.live.maybe_push()

    def start_live(self, version: str) -> None:
        """Push this server's changed rows to ``version``, which the master just published."""
        if self.shard is None or not self.live_config.store:
            return
        from embedding_server.stores import open_store

        store = open_store(self.live_config.store)
        names = [p.table for p in self.pieces]
        self.live = LivePusher(
            store, version, [(p.table, p.row_start, p.rows) for p in self.pieces],
            lambda: [self.shard.table_weights()[n] for n in names], self.live_config.push_every_s,
        )
        log.info("server %d pushes live updates to %s (version %s)", self.index, store.url, version)
