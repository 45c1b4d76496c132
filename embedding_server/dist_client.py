"""The trainer's view of embedding servers: the distributed backend of ``EmbeddingClient``.

``lookup`` is an autograd function. Forward routes each table's bags to the servers holding its
pieces (one ``sharding/`` module per placement), sends every server its ids in one all-to-all
(after a header round that says what to do and how much follows), and assembles the pooled
embeddings that come back in a second all-to-all. Backward splits the gradient the same way and
sends it back in a third; the servers' fused optimizers do the rest.

What comes back, and how it becomes the dense network's input, is the client's *stage*: the
flat one here (per server its pieces' pooled vectors, combined per table); DMT's tower stage
(``towers/stage.py``) receives tower outputs instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from dlrm_core.batch import SparseFeatures
from dlrm_core.schema import FeatureSpec
from embedding_server.client import EmbeddingClient
from embedding_server.cluster import Cluster
from embedding_server.planner import ShardingPlan
from embedding_server.sharding import SCHEMES
from embedding_server.table_snapshot import CutRequest
from embedding_server.wire import EXCHANGE_DTYPES, HEADER, Command, ids_dtype, pack_ids


class ClientStage(Protocol):
    """What the servers send back and how it becomes the dense network's input."""

    recv_widths: list[int]
    """Floats per example that each server sends this trainer."""
    layout: object | None
    """The tower layout, for a tower stage (None: the flat model)."""

    def output_dims(self, flat_dims: list[int]) -> list[int]: ...

    def assemble(self, received: torch.Tensor, b: int, bag_lengths: list[torch.Tensor]) -> torch.Tensor:
        """The received floats (server by server) -> the dense input [B, sum of output dims]."""

    def split_grad(self, grad: torch.Tensor, b: int, bag_lengths: list[torch.Tensor]) -> tuple[list, list[int]]:
        """Its gradient -> (flat parts in server order, elements for each server)."""


class FlatStage:
    """Per server [B, width] -> per slot (feature, piece) [B, d_p] -> per feature [B, D_f] -> [B, sum D_f]."""

    layout = None

    def __init__(self, plan: ShardingPlan, spec: FeatureSpec, num_servers: int) -> None:
        self.spec = spec
        self.server_slots = [plan.slots_on(s, spec.feature_tables) for s in range(num_servers)]
        self.widths = [sum(p.dim for _, p in slots) for slots in self.server_slots]
        self.recv_widths = self.widths
        self.feature_pieces = [plan.pieces_of(spec.tables[t].name) for t in spec.feature_tables]

    def output_dims(self, flat_dims: list[int]) -> list[int]:
        return flat_dims

    def assemble(self, received: torch.Tensor, b: int, bag_lengths: list[torch.Tensor]) -> torch.Tensor:
        blocks = torch.split(received, [b * w for w in self.widths])
        slot_out = {}
        for s, block in enumerate(blocks):
            slots = self.server_slots[s]
            cols = torch.split(block.view(b, self.widths[s]), [p.dim for _, p in slots], dim=1)
            for (f, p), c in zip(slots, cols, strict=True):
                slot_out[(f, id(p))] = c
        feats = []
        for f, pieces in enumerate(self.feature_pieces):
            table = self.spec.table_of(f)
            feats.append(SCHEMES[pieces[0].kind].combine([slot_out[(f, id(p))] for p in pieces], bag_lengths[f], table))
        return torch.cat(feats, dim=1)

    def split_grad(self, grad: torch.Tensor, b: int, bag_lengths: list[torch.Tensor]) -> tuple[list, list[int]]:
        per_slot = {}
        col = 0
        for f, pieces in enumerate(self.feature_pieces):
            table = self.spec.table_of(f)
            g = grad[:, col : col + table.dim]
            col += table.dim
            for p, gp in zip(pieces, SCHEMES[pieces[0].kind].split_grad(g, bag_lengths[f], pieces, table), strict=True):
                per_slot[(f, id(p))] = gp
        parts = [torch.cat([per_slot[(f, id(p))] for f, p in slots], dim=1) if slots else torch.zeros(b, 0)
                 for slots in self.server_slots]
        return [p.reshape(-1) for p in parts], [b * w for w in self.widths]


class _DistributedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, placeholder, client, sparse):  # noqa: ARG004
        pooled, routing = client._forward(sparse, Command.LOOKUP_TRAIN)
        ctx.client, ctx.routing = client, routing
        return pooled

    @staticmethod
    def backward(ctx, grad):
        ctx.client._backward(grad, ctx.routing)
        return None, None, None


class DistributedEmbeddingClient(EmbeddingClient):
    """Embedding lookups served by the embedding-server ranks of ``cluster``.

    Args:
        grad_scale: factor on the gradients sent back (1 / trainers: each trainer's loss is
            scaled for DDP's averaging, the servers sum over trainers).
        exchange_dtype: fp32, or fp16/bf16 to halve the bytes of pooled embeddings and gradients.
        stage: what the servers send back (default: the flat model's pooled vectors).
    """

    def __init__(self, cluster: Cluster, plan: ShardingPlan, spec: FeatureSpec, grad_scale: float = 1.0,
                 exchange_dtype: str = "fp32", stage: ClientStage | None = None) -> None:
        self.cluster = cluster
        self.roles = cluster.roles
        self._plan = plan
        self.spec = spec
        self.tables = spec.tables
        self.feature_tables = spec.feature_tables
        self.grad_scale = grad_scale
        self.wire_dtype = EXCHANGE_DTYPES[exchange_dtype]
        self.server_slots = [plan.slots_on(s, spec.feature_tables) for s in range(self.roles.num_servers)]
        self.feature_pieces = [plan.pieces_of(spec.tables[t].name) for t in spec.feature_tables]
        self.exchange = cluster.exchange
        self.id_dtype = ids_dtype(max((p.rows for p in plan.pieces), default=0))
        self.stage = stage or FlatStage(plan, spec, self.roles.num_servers)
        self._placeholder = torch.zeros(0, requires_grad=True)
        self._stats = {"comm_s": 0.0, "bytes_out": 0, "bytes_in": 0, "lookups": 0}

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

    # -- collectives --------------------------------------------------------------------------------

    def _headers(self, command: Command, arg: int, payloads: list[int], batch: int) -> None:
        world = self.roles.world_size
        out = torch.zeros(world, HEADER, dtype=torch.int64)
        for s in range(self.roles.num_servers):
            out[self.roles.server_rank(s)] = torch.tensor([int(command), arg, payloads[s] if payloads else 0, batch])
        t0 = time.perf_counter()
        self.exchange.all_to_all(torch.empty(world * HEADER, dtype=torch.int64), out.view(-1), [HEADER] * world,
                                 [HEADER] * world)
        self._stats["comm_s"] += time.perf_counter() - t0
        self._stats["bytes_out"] += out.numel() * 8

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
            for piece, part in zip(pieces, SCHEMES[pieces[0].kind].route(values, lengths, pieces, table), strict=True):
                routed[(f, id(piece))] = part
        payloads = [pack_ids([routed[(f, id(p))] for f, p in slots], self.id_dtype) for slots in self.server_slots]
        return payloads, bag_lengths

    def _forward(self, sparse: SparseFeatures, command: Command):
        world, b = self.roles.world_size, sparse.batch_size
        payloads, bag_lengths = self._route(sparse)
        self._headers(command, 0, [p.numel() for p in payloads], b)
        send = torch.cat(payloads) if payloads else torch.zeros(0, dtype=self.id_dtype)
        in_splits = [0] * self.roles.num_trainers + [p.numel() for p in payloads]
        out_splits = [0] * self.roles.num_trainers + [b * w for w in self.stage.recv_widths]
        received = torch.empty(sum(out_splits), dtype=self.wire_dtype)
        t0 = time.perf_counter()
        self.exchange.all_to_all(torch.empty(0, dtype=self.id_dtype), send, [0] * world, in_splits)
        self.exchange.all_to_all(received, torch.empty(0, dtype=self.wire_dtype), out_splits, [0] * world)
        self._stats["comm_s"] += time.perf_counter() - t0
        self._stats["bytes_out"] += send.numel() * send.element_size()
        self._stats["bytes_in"] += received.numel() * received.element_size()
        self._stats["lookups"] += 1
        return self.stage.assemble(received.float(), b, bag_lengths), (b, bag_lengths)

    def _backward(self, grad: torch.Tensor, routing) -> None:
        b, bag_lengths = routing
        parts, per_server = self.stage.split_grad(grad * self.grad_scale, b, bag_lengths)
        send = torch.cat(parts).to(self.wire_dtype)
        world = self.roles.world_size
        t0 = time.perf_counter()
        self.exchange.all_to_all(torch.empty(0, dtype=self.wire_dtype), send, [0] * world,
                                 [0] * self.roles.num_trainers + per_server)
        self._stats["comm_s"] += time.perf_counter() - t0
        self._stats["bytes_out"] += send.numel() * send.element_size()

    # -- the EmbeddingClient interface ------------------------------------------------------------

    def output_dims(self) -> list[int]:
        return self.stage.output_dims(super().output_dims())

    def lookup(self, sparse: SparseFeatures) -> torch.Tensor:
        if torch.is_grad_enabled():
            return _DistributedLookup.apply(self._placeholder, self, sparse)
        return self._forward(sparse, Command.LOOKUP_EVAL)[0]

    def checkpoint(self, cut: CutRequest) -> None:
        """Every trainer calls this at the same step: each server snapshots its pieces and writes
        them in the background (the master's header carries the cut)."""
        arg, payload, wait = cut.header()
        self._headers(Command.CHECKPOINT, arg, [payload] * self.roles.num_servers, wait)

    def restore(self, checkpoint: Path) -> None:
        """Servers restore their own pieces when they start (see ``EmbeddingServer.restore``)."""

    def live_start(self, publish: Callable[[], str] | None) -> str:
        """Every trainer calls this: the master's ``publish()`` makes the live version, whose name
        then goes to every rank (servers push their rows to it)."""
        self._headers(Command.LIVE_START, 0, [], 0)
        holder = [publish() if publish is not None else None]
        dist.broadcast_object_list(holder, src=0, group=self.cluster.slow_group)
        return holder[0]

    def close(self) -> None:
        """Tell the servers to stop; returns nothing (the master gathers their timings)."""
        self._headers(Command.STOP, 0, [], 0)
