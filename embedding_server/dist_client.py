"""The trainer's view of embedding servers: the distributed backend of ``EmbeddingClient``.

``lookup`` is an autograd function. Forward routes each table's bags to the servers holding its
pieces (one ``sharding/`` module per placement), sends every server its ids in one all-to-all
(after a header round that says what to do and how much follows), and assembles the pooled
embeddings that come back in a second all-to-all. Backward splits the gradient the same way and
sends it back in a third; the servers' fused optimizers do the rest.

With towers (``tower_layout.py``) the ids go out the same way, but what comes back from tower
t's server is its tower module's output [B, c_t * D], in tower order: [B, C * D] in all.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from embedding_server.client import EmbeddingClient
from embedding_server.cluster import Cluster
from embedding_server.errors import DlrmError
from embedding_server.features import FeatureSpec
from embedding_server.planner import ShardingPlan
from embedding_server.sharding import SCHEMES
from embedding_server.sparse import SparseFeatures
from embedding_server.tower_layout import TowerLayout
from embedding_server.wire import EXCHANGE_DTYPES, HEADER, Command, ids_dtype, pack_ids


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
        layout: the towers, when the servers run tower modules (None: the flat model).
    """

    def __init__(self, cluster: Cluster, plan: ShardingPlan, spec: FeatureSpec, grad_scale: float = 1.0,
                 exchange_dtype: str = "fp32", layout: TowerLayout | None = None) -> None:
        self.cluster = cluster
        self.roles = cluster.roles
        self.plan = plan
        self.spec = spec
        self.tables = spec.tables
        self.grad_scale = grad_scale
        self.wire_dtype = EXCHANGE_DTYPES[exchange_dtype]
        self.server_pieces = [plan.pieces_on(s) for s in range(self.roles.num_servers)]
        self.widths = [sum(p.dim for p in pieces) for pieces in self.server_pieces]
        self.table_pieces = [plan.pieces_of(t.name) for t in spec.tables]
        self.exchange = cluster.exchange
        self.id_dtype = ids_dtype(max((p.rows for p in plan.pieces), default=0))
        self.layout = layout
        # Floats per example each server sends back to this trainer.
        self.recv_widths = self.widths
        if layout is not None:
            mine = {layout.assigned(t, cluster.rank): t for t in range(layout.num_towers)}
            self.recv_widths = [layout.width(mine[s]) if s in mine else 0 for s in range(self.roles.num_servers)]
        # Identity towers hand the trainer every table's vector: put them back in table order, so
        # that the dense model is the flat model's whatever the partition.
        self.in_table_order = None
        if layout is not None and not layout.compressed:
            self.in_table_order = torch.argsort(torch.tensor(layout.feature_order))
        self._placeholder = torch.zeros(0, requires_grad=True)
        self.stats = {"comm_s": 0.0, "bytes_out": 0, "bytes_in": 0, "lookups": 0}

    @property
    def kernel(self) -> str:
        return f"fbgemm on {self.roles.num_servers} embedding server(s)"

    # -- collectives --------------------------------------------------------------------------------

    def _headers(self, command: Command, arg: int, payloads: list[int], batch: int) -> None:
        world = self.roles.world_size
        out = torch.zeros(world, HEADER, dtype=torch.int64)
        for s in range(self.roles.num_servers):
            out[self.roles.server_rank(s)] = torch.tensor([int(command), arg, payloads[s] if payloads else 0, batch])
        t0 = time.perf_counter()
        self.exchange.all_to_all(torch.empty(world * HEADER, dtype=torch.int64), out.view(-1), [HEADER] * world,
                                 [HEADER] * world)
        self.stats["comm_s"] += time.perf_counter() - t0
        self.stats["bytes_out"] += out.numel() * 8

    def _forward(self, sparse: SparseFeatures, command: Command):
        world, b = self.roles.world_size, sparse.batch_size
        per_server: list[list] = [[] for _ in range(self.roles.num_servers)]
        bag_lengths = []
        for f, table in enumerate(self.tables):
            values, offsets = sparse.feature_values(f)
            lengths = offsets[1:] - offsets[:-1]  # [B]
            bag_lengths.append(lengths)
            pieces = self.table_pieces[f]
            for piece, part in zip(pieces, SCHEMES[pieces[0].kind].route(values, lengths, pieces, table), strict=True):
                per_server[piece.server].append((piece, part))
        payloads = []
        for s in range(self.roles.num_servers):  # in each server's own piece order
            order = {id(p): i for i, p in enumerate(self.server_pieces[s])}
            parts = sorted(per_server[s], key=lambda item: order[id(item[0])])
            payloads.append(pack_ids([part for _, part in parts], self.id_dtype))
        self._headers(command, 0, [p.numel() for p in payloads], b)
        send = torch.cat(payloads) if payloads else torch.zeros(0, dtype=self.id_dtype)
        in_splits = [0] * self.roles.num_trainers + [p.numel() for p in payloads]
        out_splits = [0] * self.roles.num_trainers + [b * w for w in self.recv_widths]
        received = torch.empty(sum(out_splits), dtype=self.wire_dtype)
        t0 = time.perf_counter()
        self.exchange.all_to_all(torch.empty(0, dtype=self.id_dtype), send, [0] * world, in_splits)
        self.exchange.all_to_all(received, torch.empty(0, dtype=self.wire_dtype), out_splits, [0] * world)
        self.stats["comm_s"] += time.perf_counter() - t0
        self.stats["bytes_out"] += send.numel() * send.element_size()
        self.stats["bytes_in"] += received.numel() * received.element_size()
        self.stats["lookups"] += 1
        if self.layout is not None:  # per tower (= per server, in order) [B, c_t * D'] -> [B, C * D']
            blocks = torch.split(received.float(), [b * w for w in self.recv_widths])
            out = torch.cat([blk.view(b, w) for blk, w in zip(blocks, self.recv_widths, strict=True) if w], dim=1)
            if self.in_table_order is not None:  # identity towers: the flat model's column order
                out = out.view(b, -1, self.layout.dim)[:, self.in_table_order].reshape(b, -1)
            return out, (b, bag_lengths)
        # Per server [B, width] -> per piece [B, d_p] -> per table [B, D_t] -> [B, sum D_t]
        blocks = torch.split(received.float(), [b * w for w in self.widths])
        piece_out = {}
        for s, block in enumerate(blocks):
            cols = torch.split(block.view(b, self.widths[s]), [p.dim for p in self.server_pieces[s]], dim=1)
            for p, c in zip(self.server_pieces[s], cols, strict=True):
                piece_out[id(p)] = c
        tables = []
        for f, table in enumerate(self.tables):
            pieces = self.table_pieces[f]
            tables.append(SCHEMES[pieces[0].kind].combine([piece_out[id(p)] for p in pieces], bag_lengths[f], table))
        return torch.cat(tables, dim=1), (b, bag_lengths)

    def _backward(self, grad: torch.Tensor, routing) -> None:
        b, bag_lengths = routing
        grad = grad * self.grad_scale
        if self.layout is not None:  # [B, C * D'] -> per tower, to the server running its module
            if self.in_table_order is not None:
                grad = grad.view(b, -1, self.layout.dim)[:, self.layout.feature_order].reshape(b, -1)
            blocks = torch.split(grad, [w for w in self.recv_widths if w], dim=1)
            self._send_grads([blk.reshape(-1) for blk in blocks], [b * w for w in self.recv_widths])
            return
        per_piece = {}
        col = 0
        for f, table in enumerate(self.tables):
            g = grad[:, col : col + table.dim]
            col += table.dim
            pieces = self.table_pieces[f]
            for p, gp in zip(pieces, SCHEMES[pieces[0].kind].split_grad(g, bag_lengths[f], pieces, table), strict=True):
                per_piece[id(p)] = gp
        parts = [torch.cat([per_piece[id(p)] for p in pieces], dim=1) if pieces else torch.zeros(b, 0)
                 for pieces in self.server_pieces]
        self._send_grads([p.reshape(-1) for p in parts], [b * w for w in self.widths])

    def _send_grads(self, parts: list[torch.Tensor], per_server: list[int]) -> None:
        """Flat gradient blocks, one per server in order, in the exchange dtype."""
        send = torch.cat(parts).to(self.wire_dtype)
        world = self.roles.world_size
        t0 = time.perf_counter()
        self.exchange.all_to_all(torch.empty(0, dtype=self.wire_dtype), send, [0] * world,
                                 [0] * self.roles.num_trainers + per_server)
        self.stats["comm_s"] += time.perf_counter() - t0
        self.stats["bytes_out"] += send.numel() * send.element_size()

    # -- the EmbeddingClient interface ------------------------------------------------------------

    def output_dims(self) -> list[int]:
        if self.layout is None or not self.layout.compressed:
            return super().output_dims()
        return [self.layout.out_dim] * self.layout.num_outputs

    def lookup(self, sparse: SparseFeatures) -> torch.Tensor:
        if torch.is_grad_enabled():
            return _DistributedLookup.apply(self._placeholder, self, sparse)
        return self._forward(sparse, Command.LOOKUP_EVAL)[0]

    def save(self, directory: Path, step: int) -> None:
        """Every trainer calls this at the same step: servers write their pieces, then all meet."""
        self._headers(Command.CHECKPOINT, step, [], 0)
        dist.barrier()

    def restore(self, checkpoint: Path) -> None:
        """Servers restore their own pieces when they start (see ``EmbeddingServer.restore``)."""

    def live_start(self, publish=None) -> str:
        """Every trainer calls this: the master's ``publish()`` makes the live version, whose name
        then goes to every rank (servers push their rows to it)."""
        self._headers(Command.LIVE_START, 0, [], 0)
        holder = [publish() if publish is not None else None]
        dist.broadcast_object_list(holder, src=0, group=self.cluster.slow_group)
        return holder[0]

    def export_state(self) -> dict[str, torch.Tensor]:
        raise DlrmError("the tables live on the embedding servers; read them from a checkpoint")

    def import_state(self, state: dict[str, torch.Tensor]) -> None:
        raise DlrmError("the tables live on the embedding servers; they restore from checkpoints")

    def close(self) -> None:
        """Tell the servers to stop; returns nothing (the master gathers their timings)."""
        self._headers(Command.STOP, 0, [], 0)
