"""The embedding server: the parameter node's loop.

It holds its pieces of the tables (:class:`EmbeddingShard`, fbgemm TBE with the fused
optimizer) and answers the trainers, one id message from every trainer per round (``wire.py``):

    LOOKUP_TRAIN   ids in -> one fused lookup over every trainer's examples -> pooled out ->
                   gradients in -> backward, which applies the optimizer to the touched rows,
                   at the rate factor the message's argument carries (the trainer's schedule)
    LOOKUP_EVAL    the same without gradients
    CHECKPOINT     snapshot the pieces' trained rows and optimizer state; a background thread
                   writes them into the partial checkpoint (``checkpoint/server.py``)
    LIVE_START     start pushing changed rows to the serving store's current (live) version
    STOP           report timings and leave

The next round's id messages are received while the current one is worked on. With
``pipeline = exact`` the lookup of step i+1 runs as soon as its ids arrive, before step i's
update; once the update is applied, the bags it changed are looked up again and sent as a
correction (``correction.py``), so every trainer sees the rows a lockstep run would (chunks
where that does not apply wait for the update, then look up). With ``semi-sync`` the early
lookup is not corrected (the rows are one step stale).

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
from embedding_server.checkpoint.server import ServerCheckpoints
from embedding_server.checkpoint.snapshot import CutRequest
from embedding_server.checkpoint.tables import CheckpointTables
from embedding_server.checkpoint.writer import CheckpointWriter
from embedding_server.config import DistConfig, EmbeddingConfig, LiveConfig
from embedding_server.planner import ShardingPlan, wire_id_bound
from embedding_server.runtime.cluster import Cluster
from embedding_server.runtime.correction import Corrector
from embedding_server.runtime.pipelining import pipelining
from embedding_server.runtime.transport import GRADS, POOLED
from embedding_server.shard import EmbeddingShard, ShardSet
from embedding_server.stores.live import LivePusher
from embedding_server.wire import (
    EXCHANGE_DTYPES,
    Command,
    ids_dtype,
    lr_of,
    parse_id_message,
    unpack_ids,
)

log = logging.getLogger(__name__)

Update = Callable[[], None]
"""What is left of a training lookup once its outputs are sent: take the gradients, step."""


class ServerStage(Protocol):
    """What a server does with its pooled embeddings: answer the trainers, take their gradients."""

    deferrable: bool
    """Whether the update may run after the next lookup (semi-synchronous pipelining)."""

    def respond(self, pooled: torch.Tensor, batches: list[int], train: bool) -> Update | None:
        """pooled float [sum_r B_r, width] (rows by trainer); batches: B_r of each trainer.
        Returns the update still to run (None when there is none)."""

    def snapshot(self) -> dict[str, Any]:
        """Copies of the stage's own state (if any): checkpoint file name -> object."""

    def restore(self, checkpoint: Path) -> None:
        """Restore the stage's own state (if any)."""


class FlatStage:
    """The flat model: trainer r gets its rows of the pooled vectors [B_r, width] and returns their
    gradient, which runs the fused optimizer."""

    deferrable = True

    def __init__(self, server: EmbeddingServer) -> None:
        self.server = server
        self.trainers = list(range(server.roles.num_trainers))

    def respond(self, pooled: torch.Tensor, batches: list[int], train: bool) -> Update | None:
        """One chunk's pooled vectors [sum_r B_r, width_k] out, its gradients' receive posted."""
        s = self.server
        width = pooled.shape[1]
        send = pooled.detach().to(s.wire_dtype).contiguous()
        parts = list(torch.split(send, batches))  # [B_r, width_k] per trainer
        t0 = time.perf_counter()
        sent = s.transport.send_floats(self.trainers, [p.reshape(-1) for p in parts], POOLED)
        if not train:
            sent.wait()
            s.timings["wait_s"] += time.perf_counter() - t0
            return None
        grads = s.transport.recv_floats(
            self.trainers, [b * width for b in batches], s.wire_dtype, GRADS
        )

        def update() -> None:
            t1 = time.perf_counter()
            received = grads.wait()
            sent.wait()
            s.timings["wait_s"] += time.perf_counter() - t1
            t2 = time.perf_counter()
            total = sum(batches)
            if total > 0 and pooled.requires_grad and pooled.grad_fn is not None:
                g = (
                    (received[0] if len(received) == 1 else torch.cat(received))
                    .view(total, width)
                    .to(pooled.dtype)
                )
                pooled.backward(g)  # fused optimizer step
            s.timings["update_s"] += time.perf_counter() - t2

        return update

    def snapshot(self) -> dict[str, Any]:
        return {}

    def restore(self, checkpoint: Path) -> None:
        pass


class EmbeddingServer:
    """One parameter node of a job.

    Args:
        cluster: this rank's place in the world (its transport carries the messages).
        plan: the sharding plan (this server holds ``plan.pieces_on(its index)``).
        spec: the model's features and tables.
        embedding / dist / live: the config sections (tables and optimizer, wire dtype and
            pipelining, live store).
        seed: initialisation seed of the tables.
        checkpoint_root: the job's checkpoints directory.
        stage: builds the stage from this server (default: the flat one).
        chunks: gradient / pooled messages per trainer and step (``transport.exchange_chunks``).
        writer: its background checkpoint writer (default: unthrottled).
    """

    def __init__(
        self,
        cluster: Cluster,
        plan: ShardingPlan,
        spec: FeatureSpec,
        embedding: EmbeddingConfig,
        dist: DistConfig,
        live: LiveConfig,
        seed: int,
        checkpoint_root: Path,
        stage: Callable[[EmbeddingServer], ServerStage] | None = None,
        chunks: int = 1,
        writer: CheckpointWriter | None = None,
    ) -> None:
        self.cluster = cluster
        self.roles = cluster.roles
        self.index = self.roles.server_index(cluster.rank)
        self.pieces = plan.pieces_on(self.index)
        # What it looks up per example: (feature, piece) slots, chunk by chunk; features sharing a
        # table share pieces. One shard per chunk: a chunk is updated, then looked up again, alone.
        self.slots = plan.slots_on(self.index, spec.feature_tables, chunks)
        sizes = plan.chunks_on(self.index, spec.feature_tables, chunks) if self.slots else []
        self.chunks = [(sum(sizes[:k]), sum(sizes[: k + 1])) for k in range(len(sizes))]
        self.slot_piece = [self.pieces.index(p) for _, p in self.slots]
        self.local_tables = [p.local_table(spec.tables[p.table_index]) for p in self.pieces]
        self.shards = [self._chunk_shard(a, b, embedding, seed) for a, b in self.chunks]
        self.shard = ShardSet(self.shards) if self.shards else None
        self.width = sum(p.dim for _, p in self.slots)
        self.checkpoint_root = Path(checkpoint_root)
        self.checkpoints = ServerCheckpoints(checkpoint_root, self.index, writer)
        self.wire_dtype = EXCHANGE_DTYPES[dist.exchange_dtype]
        self.timings = {"lookup_s": 0.0, "update_s": 0.0, "wait_s": 0.0}
        self.steps = 0
        self.live_config = live
        self.live: LivePusher | None = None
        self.transport = cluster.transport
        self.id_dtype = ids_dtype(wire_id_bound(plan, spec))  # as the trainers send
        self.stage: ServerStage = (stage or FlatStage)(self)
        schedule = pipelining(dist).schedule(
            self.stage.deferrable, self.transport.pipelined, bool(self.shards)
        )
        self.semi_sync = schedule.stale
        # Lockstep applies each update as soon as its gradients arrive; pipelined runs keep it
        # until the next step's ids are in, to interleave it chunk by chunk with their lookup.
        self.eager = schedule.eager
        # per chunk: the last step's update
        self._pending: list[Update | None] = [None] * max(1, len(self.chunks))
        # exact: early lookups corrected once the update is in (the trainers expect it alike).
        self.corrector = (
            Corrector(
                self.shards,
                [[p.dim for _, p in self.slots[a:b]] for a, b in self.chunks],
                list(range(self.roles.num_trainers)),
                self.wire_dtype,
                self.transport,
                self.timings,
            )
            if schedule.corrected
            else None
        )

    def _chunk_shard(self, a: int, b: int, embedding: EmbeddingConfig, seed: int) -> EmbeddingShard:
        """The shard of slots [a, b): its pieces, each feature slot reading its piece."""
        pieces = list(dict.fromkeys(self.slot_piece[a:b]))
        return EmbeddingShard(
            [self.local_tables[p] for p in pieces],
            embedding.optimizer,
            "cpu",
            seed,
            embedding.init_scale or None,
            [pieces.index(p) for p in self.slot_piece[a:b]],
        )

    def restore(self, checkpoint: Path) -> None:
        if self.shard is not None:
            CheckpointTables(checkpoint).load_into(self.shard)
            log.info(
                "server %d restored %d pieces from %s", self.index, len(self.pieces), checkpoint
            )
        self.stage.restore(checkpoint)

    def serve(self) -> dict:
        """Answer commands until STOP; return this server's timings."""
        incoming = self.transport.post_recv_ids()
        while True:
            t0 = time.perf_counter()
            messages = [parse_id_message(m) for m in self.transport.finish_ids(incoming)]
            self.timings["wait_s"] += time.perf_counter() - t0
            command = messages[0][0]
            if any(m[0] != command for m in messages):
                raise RuntimeError(
                    f"server {self.index}: trainers disagree on the command: "
                    f"{[m[0] for m in messages]}"
                )
            if command != Command.STOP:
                # the next round arrives while this one runs
                incoming = self.transport.post_recv_ids()
            if command != Command.LOOKUP_TRAIN:
                self._flush()  # every command but a training lookup sees all updates applied
            if command == Command.STOP:
                if self.corrector is not None:
                    self.corrector.close()
                self.checkpoints.close(self.cluster.slow_timeout_s or 600.0)
                if self.live is not None:
                    self.live.close()
                ids = self.shard.id_stats() if self.shard is not None else {}
                live = {"live": self.live.stats()} if self.live is not None else {}
                return {
                    "server": self.index,
                    "steps": self.steps,
                    "ids": ids,
                    **live,
                    **self.timings,
                    **self.transport.stats,
                }
            if command == Command.LIVE_START:
                holder = [None]  # the version the master publishes now (it may take minutes)
                dist.broadcast_object_list(holder, src=0, group=self.cluster.slow_group)
                self.start_live(holder[0])
            elif command == Command.RESTORE:  # an earlier checkpoint, named by the master
                holder = [None]
                dist.broadcast_object_list(holder, src=0, group=self.cluster.slow_group)
                self.restore(self.checkpoint_root / holder[0])
                dist.barrier(group=self.cluster.slow_group)
            elif command == Command.CHECKPOINT:  # the master's message carries the cut
                cut = CutRequest.from_message(messages[0][1], messages[0][3].tolist())
                if not cut.taken:
                    self.checkpoints.cut(self, cut)
                if cut.wait:
                    dist.barrier(group=self.cluster.slow_group)  # while the master finishes it
            else:
                self.lookup(messages, train=command == Command.LOOKUP_TRAIN)

    def lookup(self, messages: list, train: bool) -> None:
        """Ids from every trainer -> per chunk: the previous step's update of the chunk (unless
        the lookup runs early: semi-sync, corrected exact), one fused lookup over every trainer's
        examples, the stage answers; then the early chunks' updates, and their corrections."""
        batches = [m[2] for m in messages]
        per_trainer = [
            unpack_ids(m[3], b, len(self.slots)) for m, b in zip(messages, batches, strict=True)
        ]
        if not train:
            self._flush()
        lr = lr_of(messages[0][1]) if train else 1.0  # the step's rate factor (every trainer's)
        chunks = self.chunks or [(0, 0)]
        updates = []
        for k, (a, b) in enumerate(chunks):
            early = self.semi_sync or (
                train and self.corrector is not None and self.corrector.early[k]
            )
            if not early:
                self._flush(k)  # this chunk's lookup sees the previous step's update
            if train and self.shards:
                self.shards[k].set_lr_factor(lr)  # its update steps at the rate of its lookup
            pooled = self._lookup_chunk(k, a, b, per_trainer, batches, train)
            marks = self._marks(k, a, b, per_trainer) if train else None
            update = self.stage.respond(pooled, batches, train)
            if self.semi_sync:
                self._flush(k)  # the previous step's update runs after this lookup
            updates.append(
                self._after(update, a, marks, last=k == len(chunks) - 1) if train else None
            )
        if train and self.corrector is not None:
            for k, (a, b) in enumerate(chunks):
                stale = self._pending[k] is not None  # an update the early lookup did not see
                self._flush(k)
                self.corrector.send(k, stale, [ids[a:b] for ids in per_trainer], batches)
        if train:
            self._pending = updates
        if train and self.eager:
            self._flush()

    def _lookup_chunk(
        self, k: int, a: int, b: int, per_trainer: list, batches: list[int], train: bool
    ) -> torch.Tensor:
        total = sum(batches)
        t0 = time.perf_counter()
        if self.shards and total > 0:
            # One fused lookup over all trainers' examples: slot j's bags are trainer 0's, then
            # 1's...
            values = torch.cat([ids[j][0] for j in range(a, b) for ids in per_trainer])
            lengths = torch.stack(
                [torch.cat([ids[j][1] for ids in per_trainer]) for j in range(a, b)]
            )
            with torch.set_grad_enabled(train):
                # [sum B_r, width_k]
                pooled = self.shards[k](SparseFeatures.from_lengths(values, lengths))
        else:
            width = sum(p.dim for _, p in self.slots[a:b])
            pooled = torch.zeros(total, width)
        self.timings["lookup_s"] += time.perf_counter() - t0
        return pooled

    def _marks(self, k: int, a: int, b: int, per_trainer: list) -> list[torch.Tensor] | None:
        """The rows chunk k's training lookup read, per slot a..b-1 (dynamic tables' ids remapped
        to rows, as the lookup mapped them): what live updates mark once its update ran."""
        if self.live is None or not self.shards:
            return None
        parts = [torch.cat([ids[j][0] for ids in per_trainer]) for j in range(a, b)]
        values = self.shards[k].trained_values
        if values is None or not sum(len(p) for p in parts):  # hashed only, or nothing looked up
            return parts
        return list(torch.split(values, [len(p) for p in parts]))

    def _after(
        self, update: Update | None, a: int, marks: list[torch.Tensor] | None, last: bool
    ) -> Update:
        def run() -> None:
            if update is not None:
                update()
            if self.live is not None and marks is not None:
                for j, rows in enumerate(marks, start=a):
                    self.live.mark(self.slot_piece[j], rows.numpy())
            if last:
                self.steps += 1
                if self.live is not None:
                    self.live.maybe_push()

        return run

    def _flush(self, chunk: int | None = None) -> None:
        """Run the update still pending of one chunk (None: of every chunk)."""
        for k in range(len(self._pending)) if chunk is None else [chunk]:
            pending, self._pending[k] = self._pending[k], None
            if pending is not None:
                pending()

    def start_live(self, version: str) -> None:
        """Push this server's changed rows to ``version``, which the master just published."""
        if self.shard is None or not self.live_config.store:
            return
        from embedding_server.stores import open_store

        store = open_store(self.live_config.store)
        names = [p.table for p in self.pieces]
        self.live = LivePusher(
            store,
            version,
            [(p.table, p.row_start, p.rows) for p in self.pieces],
            lambda: [self.shard.table_weights()[n] for n in names],
            self.live_config.push_every_s,
            owners=self.shard.id_owners,
        )
        log.info("server %d pushes live updates (version %s)", self.index, version)
