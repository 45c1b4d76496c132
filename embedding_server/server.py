"""The embedding server: the parameter node's loop.

It holds its pieces of the tables (:class:`EmbeddingShard`, fbgemm TBE with the fused
optimizer) and answers the trainers in lockstep, one command per round (see ``wire.py``):

    LOOKUP_TRAIN   ids in -> one fused lookup over every trainer's examples -> pooled out ->
                   gradients in -> backward, which applies the optimizer to the touched rows
    LOOKUP_EVAL    the same without gradients
    CHECKPOINT     save the pieces and their optimizer state into the partial checkpoint
    LIVE_START     start pushing changed rows to the serving store's current (live) version
    STOP           report timings and leave
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from embedding_server.checkpoint import partial_dir, save_file
from embedding_server.cluster import Cluster
from embedding_server.features import FeatureSpec
from embedding_server.live import LivePusher
from embedding_server.optimizers import SparseOptimizerConfig
from embedding_server.planner import ShardingPlan
from embedding_server.shard import EmbeddingShard
from embedding_server.sparse import SparseFeatures
from embedding_server.table_checkpoint import CheckpointTables, shard_payload
from embedding_server.wire import EXCHANGE_DTYPES, HEADER, Command, unpack_ids

log = logging.getLogger(__name__)


class EmbeddingServer:
    def __init__(
        self,
        cluster: Cluster,
        plan: ShardingPlan,
        spec: FeatureSpec,
        optimizer: SparseOptimizerConfig,
        seed: int,
        init_scale: float | None,
        checkpoint_root: Path,
        exchange_dtype: str = "fp32",
        live_store: str | None = None,
        live_push_every_s: float = 1.0,
    ) -> None:
        self.cluster = cluster
        self.roles = cluster.roles
        self.index = self.roles.server_index(cluster.rank)
        self.pieces = plan.pieces_on(self.index)
        self.local_tables = [p.local_table(spec.tables[p.table_index]) for p in self.pieces]
        self.shard = EmbeddingShard(self.local_tables, optimizer, "cpu", seed, init_scale) if self.pieces else None
        self.width = sum(p.dim for p in self.pieces)
        self.checkpoint_root = Path(checkpoint_root)
        self.wire_dtype = EXCHANGE_DTYPES[exchange_dtype]
        self.timings = {"lookup_s": 0.0, "update_s": 0.0, "wait_s": 0.0}
        self.steps = 0
        self.live_store, self.live_push_every_s = live_store, live_push_every_s
        self.live: LivePusher | None = None

    def restore(self, checkpoint: Path) -> None:
        if self.shard is not None:
            CheckpointTables(checkpoint).load_into(self.shard)
            log.info("server %d restored %d pieces from %s", self.index, len(self.pieces), checkpoint)

    def serve(self) -> dict:
        """Answer commands until STOP; return this server's timings."""
        world = self.roles.world_size
        while True:
            t0 = time.perf_counter()
            headers = torch.zeros(world * HEADER, dtype=torch.int64)
            dist.all_to_all_single(headers, torch.zeros(world * HEADER, dtype=torch.int64))
            self.timings["wait_s"] += time.perf_counter() - t0
            h = headers.view(world, HEADER)[: self.roles.num_trainers]
            command = Command(int(h[0, 0]))
            if not bool((h[:, 0] == h[0, 0]).all()):
                raise RuntimeError(f"server {self.index}: trainers disagree on the command: {h[:, 0].tolist()}")
            if command == Command.STOP:
                if self.live is not None:
                    self.live.close()
                return {"server": self.index, "steps": self.steps, **self.timings}
            if command == Command.LIVE_START:
                holder = [None]  # the version the master publishes now (it may take minutes)
                dist.broadcast_object_list(holder, src=0, group=self.cluster.slow_group)
                self.start_live(holder[0])
                continue
            if command == Command.CHECKPOINT:
                self.save(int(h[0, 1]))
                dist.barrier()
                dist.barrier(group=self.cluster.slow_group)  # while the master finalises it
                continue
            self.lookup(h, train=command == Command.LOOKUP_TRAIN)

    def lookup(self, headers: torch.Tensor, train: bool) -> None:
        world, trainers = self.roles.world_size, self.roles.num_trainers
        counts = [int(c) for c in headers[:, 2]] + [0] * (world - trainers)
        batches = [int(b) for b in headers[:, 3]]
        received = torch.empty(sum(counts), dtype=torch.int64)
        t0 = time.perf_counter()
        dist.all_to_all_single(received, torch.zeros(0, dtype=torch.int64), counts, [0] * world)
        self.timings["wait_s"] += time.perf_counter() - t0
        # One fused lookup over all trainers' examples: piece p's bags are trainer 0's, then 1's...
        per_trainer = []
        pos = 0
        for t in range(trainers):
            per_trainer.append(unpack_ids(received[pos : pos + counts[t]], batches[t], len(self.pieces)))
            pos += counts[t]
        total = sum(batches)
        t1 = time.perf_counter()
        if self.shard is not None and total > 0:
            values = torch.cat([per_trainer[t][p][0] for p in range(len(self.pieces)) for t in range(trainers)])
            lengths = torch.stack([torch.cat([per_trainer[t][p][1] for t in range(trainers)]) for p in range(len(self.pieces))])
            with torch.set_grad_enabled(train):
                pooled = self.shard(SparseFeatures.from_lengths(values, lengths))  # [sum B_t, width]
        else:
            pooled = torch.zeros(total, self.width, requires_grad=train)
        self.timings["lookup_s"] += time.perf_counter() - t1
        send = pooled.detach().to(self.wire_dtype).contiguous()
        out_splits = [0] * world
        in_splits = [b * self.width for b in batches] + [0] * (world - trainers)
        t2 = time.perf_counter()
        dist.all_to_all_single(torch.empty(0, dtype=self.wire_dtype), send.view(-1), out_splits, in_splits)
        if train:
            grads = torch.empty(total * self.width, dtype=self.wire_dtype)
            dist.all_to_all_single(grads, torch.empty(0, dtype=self.wire_dtype), in_splits, out_splits)
            self.timings["wait_s"] += time.perf_counter() - t2
            t3 = time.perf_counter()
            if self.shard is not None and total > 0:
                pooled.backward(grads.view(total, self.width).to(pooled.dtype))  # fused optimizer step
                if self.live is not None:
                    for p in range(len(self.pieces)):
                        self.live.mark(p, torch.cat([per_trainer[t][p][0] for t in range(trainers)]).numpy())
                    self.live.maybe_push()
            self.timings["update_s"] += time.perf_counter() - t3
            self.steps += 1
        else:
            self.timings["wait_s"] += time.perf_counter() - t2

    def start_live(self, version: str) -> None:
        """Push this server's changed rows to ``version``, which the master just published."""
        if self.shard is None or not self.live_store:
            return
        from embedding_server.stores import open_store

        store = open_store(self.live_store)
        names = [p.table for p in self.pieces]
        self.live = LivePusher(
            store, version, [(p.table, p.row_start, p.rows) for p in self.pieces],
            lambda: [self.shard.table_weights()[n] for n in names], self.live_push_every_s,
        )
        log.info("server %d pushes live updates to %s (version %s)", self.index, self.live_store, version)

    def save(self, step: int) -> None:
        directory = partial_dir(self.checkpoint_root, step)
        if self.shard is not None:
            save_file(directory, f"embeddings-server-{self.index}.pt", shard_payload(self.shard))
