"""The tower stage: what towers change in a distributed step, on both sides of the exchange.

The flat protocol (``runtime/server.py``, ``client/distributed.py``) runs unchanged up to the
servers' fused
lookup; a stage decides what the pooled embeddings become before they cross to the trainers,
and how the gradients that come back reach the tables. The flat stages live beside the
protocol; this module is the tower variant (DMT):

    server of tower t: pooled [sum_r B_r, width]
        --(m > 1) intra-tower all-to-all--> every tower feature of its own trainers' rows
        tower module [B_r, F_t, D] -> [B_r, c_t, D'] --> trainer r
    trainer r: per tower [B_r, c_t * D'] in tower order -> [B_r, C * D'] (identity towers: the
        vectors put back in table order, so that the dense model is exactly the flat one)

On the way back the module's gradients are summed over the tower's servers before its own
optimizer (the trainers' dense optimizer kind and learning rate) steps; the tables' gradients
return to their servers through the same intra-tower all-to-all, and the fused optimizer does
the rest.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch
import torch.distributed as dist

from embedding_server.checkpoint.files import load_file
from embedding_server.kernels.optimizers import DenseOptimizerConfig, build_dense_optimizer
from embedding_server.planner import ShardingPlan
from embedding_server.runtime.transport import GRADS, POOLED
from embedding_server.sharding import scheme_for
from embedding_server.towers.layout import TowerLayout
from embedding_server.towers.module import TowerModule


class TowerClientStage:
    """The trainer's side: what each server sends back, and how it becomes the dense input.

    Args:
        layout: the towers on this job's servers.
        rank: this trainer's rank (which server runs each tower's module for it).
        num_servers: E.
    """

    def __init__(self, layout: TowerLayout, rank: int, num_servers: int) -> None:
        self.layout = layout
        mine = {layout.assigned(t, rank): t for t in range(layout.num_towers)}
        # Floats per example each server sends back to this trainer: its tower's outputs, or none.
        self.recv_widths = [layout.width(mine[s]) if s in mine else 0 for s in range(num_servers)]
        # Identity towers hand the trainer every table's vector: put them back in table order.
        self.in_table_order = (
            None if layout.compressed else torch.argsort(torch.tensor(layout.feature_order))
        )

    def output_dims(self, flat_dims: list[int]) -> list[int]:
        if not self.layout.compressed:
            return flat_dims
        return [self.layout.out_dim] * self.layout.num_outputs

    def messages(self, b: int) -> list[tuple[int, int]]:
        """One message from each server running a tower module for this trainer."""
        return [(s, b * w) for s, w in enumerate(self.recv_widths) if w]

    def assemble(
        self, received: list[torch.Tensor], b: int, bag_lengths: list[torch.Tensor]
    ) -> torch.Tensor:
        """Per tower (= per server, in order) [B, c_t * D'] -> [B, C * D']."""
        widths = [w for w in self.recv_widths if w]
        out = torch.cat([blk.view(b, w) for blk, w in zip(received, widths, strict=True)], dim=1)
        if self.in_table_order is not None:  # identity towers: the flat model's column order
            n = len(self.in_table_order)
            out = out.view(b, n, self.layout.dim)[:, self.in_table_order].reshape(
                b, n * self.layout.dim
            )
        return out

    def split_grad(
        self, grad: torch.Tensor, b: int, bag_lengths: list[torch.Tensor]
    ) -> list[tuple[int, torch.Tensor]]:
        """[B, C * D'] -> per tower, to the server running its module: (server, flat part)."""
        if self.in_table_order is not None:
            n = len(self.layout.feature_order)
            grad = grad.view(b, n, self.layout.dim)[:, self.layout.feature_order].reshape(
                b, n * self.layout.dim
            )
        blocks = torch.split(grad, [w for w in self.recv_widths if w], dim=1)
        servers = [s for s, w in enumerate(self.recv_widths) if w]
        return [(s, blk.reshape(-1)) for s, blk in zip(servers, blocks, strict=True)]


class TowerServerStage:
    """The server's side: run the tower module on the pooled embeddings and answer the trainers.

    Args:
        server: the ``EmbeddingServer`` this stage plugs into (its roles, exchange, timings).
        layout: the towers on this job's servers.
        plan: the sharding plan (the pieces of every server of this tower).
        groups: per tower, the process group of its servers (None for a tower of one server).
        optimizer: the module's optimizer (the trainers' dense optimizer).
        seed: every server of a tower starts its module from the same seed.
    """

    def __init__(
        self,
        server,
        layout: TowerLayout,
        plan: ShardingPlan,
        groups: list | None,
        optimizer: DenseOptimizerConfig,
        seed: int,
    ) -> None:
        self.server = server
        self.layout = layout
        index = server.index
        t = self.tower = layout.tower_of_server[index]
        self.group_servers = layout.servers_of[t]
        self.tower_group = groups[t] if groups else None  # None: the tower has this server alone
        spec = layout.spec
        self.group_slots = {s: plan.slots_on(s, spec.feature_tables) for s in self.group_servers}
        self.group_widths = [sum(p.dim for _, p in self.group_slots[s]) for s in self.group_servers]
        # Per tower feature: its table and the table's pieces (on this tower's servers).
        self.tower_features = [
            (f, spec.table_of(f), plan.pieces_of(spec.table_of(f).name))
            for f in layout.features_of[t]
        ]
        self.my_trainers = layout.trainers_of(index)
        # contiguous blocks
        self.group_trainers = [layout.trainers_of(s) for s in self.group_servers]
        server.timings["tower_s"] = 0.0
        topology = server.cluster.topology
        hosts = topology.hosts if topology else None
        roles = server.roles
        self.group_remote = [
            bool(hosts) and hosts[roles.server_rank(s)] != hosts[server.cluster.rank]
            # a tower straddling hosts: count its bytes
            for s in self.group_servers
        ]
        # every server of the tower starts from the same module
        torch.manual_seed(seed * 1_000_003 + t)
        self.module = TowerModule(
            len(layout.features_of[t]), layout.outputs[t], layout.dim, layout.out_dim
        )
        self.module_optimizer = build_dense_optimizer(optimizer, self.module.parameters())
        self.out_width = layout.width(t)

    # -- one step -------------------------------------------------------------------------------

    deferrable = False
    """The module's step needs its gradients at once: a tower lookup ends with its update."""

    def respond(self, pooled: torch.Tensor, batches: list[int], train: bool) -> None:
        """pooled [sum_r B_r, width] (rows by trainer) -> tower module -> my trainers, and back."""
        s = self.server
        trainers = s.roles.num_trainers
        mine = self.my_trainers
        b_mine = sum(batches[r] for r in mine)
        blocks, gathered, splits = self._gather_tower_features(pooled, batches, b_mine, train)
        slot_out = {}
        for srv, block in blocks.items():
            slots = self.group_slots[srv]
            for (f, p), cols in zip(
                slots, torch.split(block, [p.dim for _, p in slots], dim=1), strict=True
            ):
                slot_out[(f, p.table, p.row_start, p.col_start)] = cols
        feats = [
            scheme_for(pieces[0].kind, table).combine(
                [slot_out[(f, p.table, p.row_start, p.col_start)] for p in pieces], None, table
            )
            for f, table, pieces in self.tower_features
        ]
        t1 = time.perf_counter()
        with torch.set_grad_enabled(train):
            z = torch.stack(feats, dim=1)  # [B_mine, F_t, D]
            out = self.module(z).reshape(b_mine, self.out_width)  # [B_mine, c_t * D']
        s.timings["tower_s"] += time.perf_counter() - t1
        peers = list(range(trainers))
        sizes = [batches[r] * self.out_width if r in mine else 0 for r in peers]
        wire = out.detach().to(s.wire_dtype)
        parts = iter(torch.split(wire, [batches[r] for r in mine]))
        t2 = time.perf_counter()
        sent = s.transport.send_floats(
            peers,
            [next(parts).reshape(-1) if r in mine else wire[:0].reshape(-1) for r in peers],
            POOLED,
        )
        if not train:
            sent.wait()
            s.timings["wait_s"] += time.perf_counter() - t2
            return None
        received = s.transport.recv_floats(peers, sizes, s.wire_dtype, GRADS).wait()
        sent.wait()
        grads = (
            torch.cat([received[r] for r in mine]) if mine else torch.zeros(0, dtype=s.wire_dtype)
        )
        s.timings["wait_s"] += time.perf_counter() - t2
        t3 = time.perf_counter()
        out.backward(grads.view(b_mine, self.out_width).float())  # through the module
        self._return_table_grads(pooled, gathered, splits)
        self._step_module()
        s.timings["update_s"] += time.perf_counter() - t3
        return None

    def _gather_tower_features(self, pooled, batches, b_mine, train):
        """Every tower feature of my trainers' rows: per group server, [B_mine, width_s]."""
        if len(self.group_servers) == 1:
            return {self.server.index: pooled}, None, None
        trainers = self.server.roles.num_trainers
        starts = [sum(batches[:r]) for r in range(trainers + 1)]
        send = [
            pooled[starts[r[0]] : starts[r[-1] + 1]] if r else pooled[:0]
            for r in self.group_trainers
        ]
        in_splits = [blk.numel() for blk in send]
        out_splits = [b_mine * w for w in self.group_widths]
        recv = torch.empty(sum(out_splits), dtype=torch.float32)
        t0 = time.perf_counter()
        dist.all_to_all_single(
            recv,
            torch.cat([blk.detach().reshape(-1) for blk in send]),
            out_splits,
            in_splits,
            group=self.tower_group,
        )
        self._count_remote(in_splits)
        self.server.timings["wait_s"] += time.perf_counter() - t0
        gathered = recv.requires_grad_(train)  # a leaf: its gradient goes back the same way
        blocks = dict(
            zip(
                self.group_servers,
                [
                    blk.view(b_mine, w)
                    for blk, w in zip(
                        torch.split(gathered, out_splits), self.group_widths, strict=True
                    )
                ],
                strict=True,
            )
        )
        return blocks, gathered, (in_splits, out_splits)

    def _return_table_grads(self, pooled: torch.Tensor, gathered, splits) -> None:
        """The tables' gradients: straight into the fused optimizer (one server per tower), or back
        to the servers that looked them up (the reverse intra-tower all-to-all)."""
        if gathered is None:
            return  # pooled itself fed the module: its backward already ran the fused optimizer
        in_splits, out_splits = splits
        back = torch.empty(pooled.numel(), dtype=torch.float32)
        grad_in = gathered.grad if gathered.grad is not None else torch.zeros_like(gathered)
        dist.all_to_all_single(back, grad_in, in_splits, out_splits, group=self.tower_group)
        self._count_remote(out_splits)
        if self.server.shard is not None and pooled.numel():
            pooled.backward(back.view_as(pooled))  # fused optimizer step

    def _count_remote(self, splits: list[int]) -> None:
        """fp32 elements this server sent to tower-mates on other hosts."""
        far = sum(n for n, remote in zip(splits, self.group_remote, strict=True) if remote)
        self.server.transport.stats["cross_host_bytes"] += 4 * far

    def _step_module(self) -> None:
        """Sum the module's gradients over the tower's servers, then step its optimizer."""
        if self.module_optimizer is None:
            return
        params = list(self.module.parameters())
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if self.tower_group is not None:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.tower_group)
            if any(self.group_remote):  # a ring all-reduce sends 2 (m - 1) / m of the buffer
                m = len(self.group_servers)
                self.server.transport.stats["cross_host_bytes"] += int(
                    2 * (m - 1) / m * flat.numel() * 4
                )
            grads = torch.split(flat, [p.numel() for p in params])
        for p, g in zip(params, grads, strict=True):
            p.grad = g.view_as(p)
        self.module_optimizer.step()
        self.module_optimizer.zero_grad(set_to_none=True)

    # -- checkpoints ------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        if self.server.index != self.group_servers[0]:  # one copy per tower
            return {}
        return {
            f"tower-{self.tower}.pt": copy.deepcopy(
                {
                    "module": self.module.state_dict(),
                    "optimizer": self.module_optimizer.state_dict()
                    if self.module_optimizer
                    else {},
                }
            )
        }

    def restore(self, checkpoint: Path) -> None:
        """Any server count: the module is per tower."""
        state = load_file(checkpoint, f"tower-{self.tower}.pt")
        self.module.load_state_dict(state["module"])
        if self.module_optimizer is not None:
            self.module_optimizer.load_state_dict(state["optimizer"])
