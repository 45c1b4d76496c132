"""The trainer's view of embedding servers: the distributed backend of ``EmbeddingClient``.

``lookup`` is an autograd function. Forward routes each feature's bags to the servers holding
its table's pieces (one ``sharding/`` module per placement), sends every server one id message
(the command header folded in), and assembles the pooled embeddings that come back. Backward
splits the gradient the same way and sends it back; the servers' fused optimizers do the rest.
Messages travel over a ``transport.py`` route (point-to-point between trainer/server pairs by
default).

**Pipelining**: ``prefetch(sparse)`` sends the ids of a batch (and posts the receive of its
pooled vectors) ahead of its ``lookup``, from a background thread while the current batch's
dense forward and backward run; ``lookup`` of that batch then only waits for what is already
on its way. With ``pipeline = exact`` the servers look a prefetched batch up before the previous
update and send a correction of the bags that update changed (``correction.py``), which
``lookup`` applies before the dense forward.

What comes back, and how it becomes the dense network's input, is the client's *stage*: the
flat one here (per server its pieces' pooled vectors, combined per table); DMT's tower stage
(``towers/stage.py``) receives tower outputs instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from dlrm_core.batch import SparseFeatures
from dlrm_core.schema import FeatureSpec
from embedding_server.checkpoint.snapshot import CutRequest
from embedding_server.client.base import EmbeddingClient
from embedding_server.planner import ShardingPlan, wire_id_bound
from embedding_server.runtime.cluster import Cluster
from embedding_server.runtime.correction import message_capacity, patch
from embedding_server.runtime.transport import CORRECT, GRADS, POOLED, Pending
from embedding_server.sharding import scheme_for
from embedding_server.wire import (
    EXCHANGE_DTYPES,
    Command,
    id_message,
    ids_dtype,
    lr_arg,
    pack_ids,
)

Messages = list[tuple[int, int]]
"""(server index, elements) of each pooled message of a lookup, in the order they are received."""


class ClientStage(Protocol):
    """What the servers send back and how it becomes the dense network's input."""

    layout: object | None
    """The tower layout, for a tower stage (None: the flat model)."""

    def output_dims(self, flat_dims: list[int]) -> list[int]: ...

    def messages(self, b: int) -> Messages:
        """The pooled messages of a lookup of ``b`` examples, in order."""

    def assemble(
        self, received: list[torch.Tensor], b: int, bag_lengths: list[torch.Tensor]
    ) -> torch.Tensor:
        """The received messages (as :meth:`messages` lists them) -> the dense input
        [B, sum of output dims]."""

    def split_grad(
        self, grad: torch.Tensor, b: int, bag_lengths: list[torch.Tensor]
    ) -> list[tuple[int, torch.Tensor]]:
        """Its gradient -> (server index, flat part) of each gradient message, in sending order."""


class FlatStage:
    """Per server and chunk [B, width_k] -> per slot (feature, piece) [B, d_p] -> per feature
    [B, D_f] -> [B, sum D_f]. A server's slots come chunk by chunk (``planner.chunks_on``): one
    message per chunk and direction, so that a chunk's gradients can be applied, and its rows
    looked up again, while the next chunk is still on the wire."""

    layout = None

    def __init__(
        self, plan: ShardingPlan, spec: FeatureSpec, num_servers: int, chunks: int = 1
    ) -> None:
        self.spec = spec
        self.server_slots = [
            plan.slots_on(s, spec.feature_tables, chunks) for s in range(num_servers)
        ]
        self.chunk_dims = []  # per server, per chunk: its slots' dims
        for s, slots in enumerate(self.server_slots):
            sizes = plan.chunks_on(s, spec.feature_tables, chunks) if slots else []
            starts = [sum(sizes[:k]) for k in range(len(sizes) + 1)]
            self.chunk_dims.append(
                [[p.dim for _, p in slots[starts[k] : starts[k + 1]]] for k in range(len(sizes))]
            )
        self.chunk_widths = [[sum(d) for d in dims] for dims in self.chunk_dims]
        self.widths = [sum(w) for w in self.chunk_widths]
        self.feature_pieces = [plan.pieces_of(spec.tables[t].name) for t in spec.feature_tables]
        rounds = max((len(w) for w in self.chunk_widths), default=0)
        # Message order: chunk 0 of every server, then chunk 1 ... (each server's chunks in order).
        self.order = [
            (s, k)
            for k in range(rounds)
            for s in range(num_servers)
            if k < len(self.chunk_widths[s])
        ]
        self.runs = self._column_runs(spec, chunks)
        """Table-wise plans only (else None): per message (in order), the runs [a, b) of dense-input
        columns its slots fill, in slot order; pooled vectors and gradients move as column
        blocks, without per-feature pieces (one copy at most, none when a message is the whole
        input)."""

    def _column_runs(self, spec: FeatureSpec, chunks: int) -> list[list[tuple[int, int]]] | None:
        if not all(len(p) == 1 and p[0].kind == "table_wise" for p in self.feature_pieces):
            return None
        dims = [spec.tables[t].dim for t in spec.feature_tables]
        start = [sum(dims[:f]) for f in range(len(dims))]
        runs = []
        for s, k in self.order:
            sizes = [len(d) for d in self.chunk_dims[s]]
            slots = self.server_slots[s][sum(sizes[:k]) : sum(sizes[: k + 1])]
            mine: list[tuple[int, int]] = []
            for f, piece in slots:
                a, b = start[f], start[f] + piece.dim
                if mine and mine[-1][1] == a:
                    mine[-1] = (mine[-1][0], b)
                else:
                    mine.append((a, b))
            runs.append(mine)
        return runs

    def output_dims(self, flat_dims: list[int]) -> list[int]:
        return flat_dims

    def messages(self, b: int) -> Messages:
        return [(s, b * self.chunk_widths[s][k]) for s, k in self.order]

    def corrections(self, b: int) -> Messages:
        """The correction messages of an early lookup (``correction.py``): receive capacities."""
        return [(s, message_capacity(b, self.chunk_dims[s][k])) for s, k in self.order]

    def correct(self, received: list[torch.Tensor], fixes: list[torch.Tensor], b: int) -> int:
        """Patch the received pooled messages [B * width_k] with their corrections, in place;
        -> the corrections' elements."""
        return sum(
            patch(msg.view(b, self.chunk_widths[s][k]), fix, self.chunk_dims[s][k])
            for (s, k), msg, fix in zip(self.order, received, fixes, strict=True)
        )

    def assemble(
        self, received: list[torch.Tensor], b: int, bag_lengths: list[torch.Tensor]
    ) -> torch.Tensor:
        if self.runs is not None:
            return self._assemble_columns(received, b)
        blocks: list[list[torch.Tensor]] = [[None] * len(w) for w in self.chunk_widths]
        for (s, k), msg in zip(self.order, received, strict=True):
            blocks[s][k] = msg.view(b, self.chunk_widths[s][k])
        slot_out = {}
        for s, slots in enumerate(self.server_slots):
            if not slots:
                continue
            # [B, width_s]
            block = torch.cat(blocks[s], dim=1) if len(blocks[s]) > 1 else blocks[s][0]
            for (f, p), c in zip(
                slots, torch.split(block, [p.dim for _, p in slots], dim=1), strict=True
            ):
                slot_out[(f, id(p))] = c
        feats = []
        for f, pieces in enumerate(self.feature_pieces):
            table = self.spec.table_of(f)
            feats.append(
                scheme_for(pieces[0].kind, table).combine(
                    [slot_out[(f, id(p))] for p in pieces], bag_lengths[f], table
                )
            )
        return torch.cat(feats, dim=1)

    def _assemble_columns(self, received: list[torch.Tensor], b: int) -> torch.Tensor:
        """Table-wise: each message's columns into place; [B, W]."""
        width = sum(self.widths)
        if len(received) == 1 and self.runs[0] == [(0, width)]:
            return received[0].view(b, width)  # the message is the input (a fresh receive buffer)
        out = torch.empty(b, width, dtype=received[0].dtype if received else torch.float32)
        for (s, k), msg, runs in zip(self.order, received, self.runs, strict=True):
            block, col = msg.view(b, self.chunk_widths[s][k]), 0
            for a, e in runs:
                out[:, a:e] = block[:, col : col + e - a]
                col += e - a
        return out

    def split_grad(
        self, grad: torch.Tensor, b: int, bag_lengths: list[torch.Tensor]
    ) -> list[tuple[int, torch.Tensor]]:
        # table-wise: each message's columns, flat (a view when they are all of it)
        if self.runs is not None:
            return [
                (
                    s,
                    (
                        grad[:, runs[0][0] : runs[0][1]]
                        if len(runs) == 1
                        else torch.cat([grad[:, a:e] for a, e in runs], dim=1)
                    ).reshape(-1),
                )
                for (s, _), runs in zip(self.order, self.runs, strict=True)
            ]
        per_slot = {}
        col = 0
        for f, pieces in enumerate(self.feature_pieces):
            table = self.spec.table_of(f)
            g = grad[:, col : col + table.dim]
            col += table.dim
            for p, gp in zip(
                pieces,
                scheme_for(pieces[0].kind, table).split_grad(g, bag_lengths[f], pieces, table),
                strict=True,
            ):
                per_slot[(f, id(p))] = gp
        per_server = [
            torch.cat([per_slot[(f, id(p))] for f, p in slots], dim=1) if slots else None
            for slots in self.server_slots
        ]
        chunks = [
            torch.split(g, w, dim=1) if g is not None else []
            for g, w in zip(per_server, self.chunk_widths, strict=True)
        ]
        return [(s, chunks[s][k].reshape(-1)) for s, k in self.order]


@dataclass
class _InFlight:
    """A lookup whose ids are sent and whose pooled vectors are on their way."""

    sparse: SparseFeatures
    batch: int
    bag_lengths: list[torch.Tensor]
    sent: Pending
    pooled: Pending
    corrections: Pending | None = None


class _DistributedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, placeholder, client, inflight):  # noqa: ARG004
        ctx.client, ctx.inflight = client, inflight
        return client._to_device(client._finish(inflight))

    @staticmethod
    def backward(ctx, grad):
        ctx.client._send_grads(grad.detach().cpu(), ctx.inflight)
        return None, None, None


class DistributedEmbeddingClient(EmbeddingClient):
    """Embedding lookups served by the embedding-server ranks of ``cluster``.

    Args:
        grad_scale: factor on the gradients sent back (1 / trainers: each trainer's loss is
            scaled for DDP's averaging, the servers sum over trainers).
        exchange_dtype: fp32, or fp16/bf16 to halve the bytes of pooled embeddings and gradients.
        stage: what the servers send back (default: the flat model's pooled vectors).
        chunks: pooled / gradient messages per server and step (the flat stage's chunks).
        device: where the trainer's dense network runs (CUDA: pooled vectors arrive in pinned
            host memory and are copied without blocking).
        corrected: training lookups come with corrections (``pipeline = exact``, flat stage).
    """

    def __init__(
        self,
        cluster: Cluster,
        plan: ShardingPlan,
        spec: FeatureSpec,
        grad_scale: float = 1.0,
        exchange_dtype: str = "fp32",
        stage: ClientStage | None = None,
        chunks: int = 1,
        device: torch.device | str = "cpu",
        corrected: bool = False,
    ) -> None:
        self.cluster = cluster
        self.device = torch.device(device)
        self.roles = cluster.roles
        self._plan = plan
        self.spec = spec
        self.tables = spec.tables
        self.feature_tables = spec.feature_tables
        self.grad_scale = grad_scale
        self.wire_dtype = EXCHANGE_DTYPES[exchange_dtype]
        self.server_slots = [
            plan.slots_on(s, spec.feature_tables) for s in range(self.roles.num_servers)
        ]
        self.feature_pieces = [plan.pieces_of(spec.tables[t].name) for t in spec.feature_tables]
        self.transport = cluster.transport
        self.servers = [self.roles.server_rank(s) for s in range(self.roles.num_servers)]
        self.id_dtype = ids_dtype(wire_id_bound(plan, spec))
        self.stage = stage or FlatStage(plan, spec, self.roles.num_servers, chunks)
        self.corrected = corrected and stage is None and self.transport.pipelined
        self._placeholder = torch.zeros(0, requires_grad=True)
        self._stats = {
            "comm_s": 0.0,
            "bytes_out": 0,
            "bytes_in": 0,
            "lookups": 0,
            "prefetched": 0,
            "correction_bytes": 0,
        }
        self._next: Future | None = None  # a prefetched training lookup
        self._sends: list[Pending] = []  # gradient messages still being sent
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @property
    def kernel(self) -> str:
        return f"fbgemm on {self.roles.num_servers} embedding server(s)"

    @property
    def tower_layout(self):
        return self.stage.layout

    @property
    def plan(self) -> ShardingPlan:
        return self._plan

    @property
    def stats(self) -> dict[str, float]:
        return self._stats

    @property
    def can_prefetch(self) -> bool:
        """Whether lookups can be sent ahead (point-to-point transport)."""
        return self.transport.pipelined

    # -- messages ----------------------------------------------------------------------------------

    def _route(self, sparse: SparseFeatures) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each feature's bags to the servers holding its table's pieces: (payload per server,
        bag lengths per feature). A server's payload is in its slot order (feature, then piece)."""
        routed = {}
        bag_lengths = []
        for f, pieces in enumerate(self.feature_pieces):
            values, offsets = sparse.feature_values(f)
            lengths = offsets[1:] - offsets[:-1]  # [B]
            bag_lengths.append(lengths)
            table = self.spec.table_of(f)
            for piece, part in zip(
                pieces,
                scheme_for(pieces[0].kind, table).route(values, lengths, pieces, table),
                strict=True,
            ):
                routed[(f, id(piece))] = part
        payloads = [
            pack_ids([routed[(f, id(p))] for f, p in slots], self.id_dtype)
            for slots in self.server_slots
        ]
        return payloads, bag_lengths

    def _command(self, command: Command, arg: int = 0, payload: list[int] | None = None) -> None:
        """A message without ids to every server (checkpoint, live start, stop)."""
        self._drain_sends()
        body = torch.tensor(payload or [], dtype=self.id_dtype)
        t0 = time.perf_counter()
        self.transport.send_ids([id_message(command, arg, 0, body)] * self.roles.num_servers).wait()
        self._stats["comm_s"] += time.perf_counter() - t0

    def _start(self, sparse: SparseFeatures, command: Command, lr: float = 1.0) -> _InFlight:
        """Route and send the ids (a training lookup's with its rate factor ``lr``); post the
        receive of the pooled vectors."""
        b = sparse.batch_size
        payloads, bag_lengths = self._route(sparse)
        arg = lr_arg(lr) if command == Command.LOOKUP_TRAIN else 0
        messages = [id_message(command, arg, b, p) for p in payloads]
        layout = self.stage.messages(b)
        with self._lock:  # one id message per server and step, in order
            sent = self.transport.send_ids(messages)
            pooled = self.transport.recv_floats(
                [self.servers[s] for s, _ in layout],
                [n for _, n in layout],
                self.wire_dtype,
                POOLED,
            )
            fixes = None
            if self.corrected and command == Command.LOOKUP_TRAIN:
                caps = self.stage.corrections(b)
                fixes = self.transport.recv_floats(
                    [self.servers[s] for s, _ in caps],
                    [n for _, n in caps],
                    self.wire_dtype,
                    CORRECT,
                )
        self._stats["bytes_out"] += sum(m.numel() * m.element_size() for m in messages)
        self._stats["lookups"] += 1
        return _InFlight(sparse, b, bag_lengths, sent, pooled, fixes)

    def _finish(self, inflight: _InFlight) -> torch.Tensor:
        """Wait for the pooled vectors and assemble the dense network's input [B, sum of output
        dims]."""
        t0 = time.perf_counter()
        parts = inflight.pooled.wait()
        if inflight.corrections is not None:
            n = self.stage.correct(parts, inflight.corrections.wait(), inflight.batch)
            self._stats["correction_bytes"] += n * self.wire_dtype.itemsize
        inflight.sent.wait()
        self._stats["comm_s"] += time.perf_counter() - t0
        self._stats["bytes_in"] += sum(p.numel() * p.element_size() for p in parts)
        return self.stage.assemble([p.float() for p in parts], inflight.batch, inflight.bag_lengths)

    def _to_device(self, pooled: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return pooled
        return pooled.pin_memory().to(self.device, non_blocking=True)

    def _send_grads(self, grad: torch.Tensor, inflight: _InFlight) -> None:
        parts = self.stage.split_grad(grad, inflight.batch, inflight.bag_lengths)
        tensors = [self._scaled(t, grad).to(self.wire_dtype) for _, t in parts]
        t0 = time.perf_counter()
        self._sends.append(
            self.transport.send_floats([self.servers[s] for s, _ in parts], tensors, GRADS)
        )
        self._stats["comm_s"] += time.perf_counter() - t0
        self._stats["bytes_out"] += sum(t.numel() * t.element_size() for t in tensors)

    def _scaled(self, part: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """``part`` of ``grad`` times the gradient scale (elementwise, so scaling the part is
        scaling the whole, bit for bit): in place when the part is already a copy."""
        if self.grad_scale == 1.0:
            return part
        if part.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr():
            return part * self.grad_scale
        return part.mul_(self.grad_scale)

    def _drain_sends(self) -> None:
        while self._sends:
            self._sends.pop(0).wait()

    # -- the EmbeddingClient interface ------------------------------------------------------------

    def output_dims(self) -> list[int]:
        return self.stage.output_dims(super().output_dims())

    def prefetch(self, sparse: SparseFeatures) -> None:
        """Send the ids of the next training lookup now, from a background thread (pipelining)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch-ids")
        self._next = self._pool.submit(self._start, sparse, Command.LOOKUP_TRAIN, self.lr_factor)

    def lookup(self, sparse: SparseFeatures) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self._to_device(self._finish(self._start(sparse, Command.LOOKUP_EVAL)))
        inflight = None
        if self._next is not None:
            inflight = self._next.result()
            self._next = None
            if inflight.sparse is not sparse:
                raise RuntimeError("the prefetched lookup is not the batch being trained")
            self._stats["prefetched"] += 1
        if len(self._sends) > 1:
            self._sends.pop(0).wait()  # gradients of two steps ago are out by now
        if inflight is None:
            inflight = self._start(sparse, Command.LOOKUP_TRAIN, self.lr_factor)
        return _DistributedLookup.apply(self._placeholder, self, inflight)

    def checkpoint(self, cut: CutRequest) -> None:
        """Every trainer calls this at the same step: each server snapshots its pieces and writes
        them in the background (the master's message carries the cut)."""
        arg, payload = cut.message()
        self._command(Command.CHECKPOINT, arg, payload)

    def restore(self, checkpoint: Path) -> None:
        """Servers restore their own pieces when they start (see ``EmbeddingServer.restore``)."""

    def rollback(self, checkpoint: Path) -> None:
        """Every trainer calls this: every server loads its pieces of ``checkpoint`` (an earlier
        checkpoint of this job, named by the master) and they all meet once it is done."""
        self._command(Command.RESTORE)
        holder = [Path(checkpoint).name if self.cluster.is_master else None]
        dist.broadcast_object_list(holder, src=0, group=self.cluster.slow_group)
        dist.barrier(group=self.cluster.slow_group)

    def live_start(self, publish: Callable[[], str] | None) -> str:
        """Every trainer calls this: the master's ``publish()`` makes the live version, whose name
        then goes to every rank (servers push their rows to it)."""
        self._command(Command.LIVE_START)
        holder = [publish() if publish is not None else None]
        dist.broadcast_object_list(holder, src=0, group=self.cluster.slow_group)
        return holder[0]

    def close(self) -> None:
        """Tell the servers to stop; returns nothing (the master gathers their timings)."""
        self._command(Command.STOP)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
