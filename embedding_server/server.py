"""The embedding server: the parameter node's loop.

It holds its pieces of the tables (:class:`EmbeddingShard`, fbgemm TBE with the fused
optimizer) and answers the trainers in lockstep, one command per round (see ``wire.py``):

    LOOKUP_TRAIN   ids in -> one fused lookup over every trainer's examples -> pooled out ->
                   gradients in -> backward, which applies the optimizer to the touched rows
    LOOKUP_EVAL    the same without gradients
    CHECKPOINT     save the pieces and their optimizer state into the partial checkpoint
    LIVE_START     start pushing changed rows to the serving store's current (live) version
    STOP           report timings and leave

With towers (``tower_layout.py``), a lookup goes on from the pooled embeddings: the tower's
servers exchange them so that each holds its own trainers' rows of every tower feature, run the
tower module [B, F_t, D] -> [B, c_t, D], and send that to the trainers; on the way back the
module's gradients are summed over the tower's servers before its optimizer steps.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from embedding_server.checkpoint import load_file, partial_dir, save_file
from embedding_server.cluster import Cluster
from embedding_server.features import FeatureSpec
from embedding_server.live import LivePusher
from embedding_server.optimizers import SparseOptimizerConfig
from embedding_server.planner import ShardingPlan
from embedding_server.shard import EmbeddingShard
from embedding_server.sharding import SCHEMES
from embedding_server.sparse import SparseFeatures
from embedding_server.table_checkpoint import CheckpointTables, shard_payload
from embedding_server.tower_layout import TowerLayout
from embedding_server.tower_module import TowerModule, tower_optimizer
from embedding_server.wire import EXCHANGE_DTYPES, HEADER, Command, ids_dtype, unpack_ids

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
        layout: TowerLayout | None = None,
        tower_groups: list | None = None,
        tower_optim: dict | None = None,
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
        self.exchange = cluster.exchange
        self.id_dtype = ids_dtype(max((p.rows for p in plan.pieces), default=0))  # as the trainers send
        self.layout = layout
        if layout is not None:
            self._init_tower(plan, layout, tower_groups, tower_optim or {}, seed)

    def _init_tower(self, plan: ShardingPlan, layout: TowerLayout, groups: list | None, optim: dict, seed: int) -> None:
        t = self.tower = layout.tower_of_server[self.index]
        self.group_servers = layout.servers_of[t]
        self.tower_group = groups[t] if groups else None  # None: the tower has this server alone
        self.group_pieces = {s: plan.pieces_on(s) for s in self.group_servers}
        self.group_widths = [sum(p.dim for p in self.group_pieces[s]) for s in self.group_servers]
        self.tower_tables = [(layout.spec.tables[i], plan.pieces_of(layout.spec.tables[i].name))
                             for i in layout.tables_of[t]]
        self.my_trainers = layout.trainers_of(self.index)
        self.group_trainers = [layout.trainers_of(s) for s in self.group_servers]  # contiguous blocks
        self.timings["tower_s"] = 0.0
        hosts = self.cluster.topology.hosts if self.cluster.topology else None
        self.group_remote = [bool(hosts) and hosts[self.roles.server_rank(s)] != hosts[self.cluster.rank]
                             for s in self.group_servers]  # a tower straddling hosts: count its bytes
        torch.manual_seed(seed * 1_000_003 + t)  # every server of the tower starts from the same module
        self.module = TowerModule(len(layout.tables_of[t]), layout.outputs[t], layout.dim, layout.out_dim)
        self.module_optimizer = tower_optimizer(self.module.parameters(), **optim) if optim else \
            tower_optimizer(self.module.parameters(), "adam", 3e-3, 1e-8, 0.0)
        self.out_width = layout.width(t)

    def restore(self, checkpoint: Path) -> None:
        if self.shard is not None:
            CheckpointTables(checkpoint).load_into(self.shard)
            log.info("server %d restored %d pieces from %s", self.index, len(self.pieces), checkpoint)
        if self.layout is not None:  # any server count: the module is per tower
            state = load_file(checkpoint, f"tower-{self.tower}.pt")
            self.module.load_state_dict(state["module"])
            if self.module_optimizer is not None:
                self.module_optimizer.load_state_dict(state["optimizer"])

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
                if self.live is not None:
                    self.live.close()
                return {"server": self.index, "steps": self.steps, **self.timings, **self.exchange.stats}
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
        received = torch.empty(sum(counts), dtype=self.id_dtype)
        t0 = time.perf_counter()
        self.exchange.all_to_all(received, torch.zeros(0, dtype=self.id_dtype), counts, [0] * world)
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
        if self.layout is not None:
            self._tower_step(pooled, batches, train)
            if train:
                self._after_update(per_trainer)
            return
        send = pooled.detach().to(self.wire_dtype).contiguous()
        out_splits = [0] * world
        in_splits = [b * self.width for b in batches] + [0] * (world - trainers)
        t2 = time.perf_counter()
        self.exchange.all_to_all(torch.empty(0, dtype=self.wire_dtype), send.view(-1), out_splits, in_splits)
        if train:
            grads = torch.empty(total * self.width, dtype=self.wire_dtype)
            self.exchange.all_to_all(grads, torch.empty(0, dtype=self.wire_dtype), in_splits, out_splits)
            self.timings["wait_s"] += time.perf_counter() - t2
            t3 = time.perf_counter()
            if self.shard is not None and total > 0:
                pooled.backward(grads.view(total, self.width).to(pooled.dtype))  # fused optimizer step
            self.timings["update_s"] += time.perf_counter() - t3
            self._after_update(per_trainer)
        else:
            self.timings["wait_s"] += time.perf_counter() - t2

    def _after_update(self, per_trainer: list) -> None:
        self.steps += 1
        if self.live is not None and self.shard is not None:
            for p in range(len(self.pieces)):
                self.live.mark(p, torch.cat([ids[p][0] for ids in per_trainer]).numpy())
            self.live.maybe_push()

    # -- tower mode ----------------------------------------------------------------------------------

    def _tower_step(self, pooled: torch.Tensor, batches: list[int], train: bool) -> None:
        """pooled [sum_r B_r, width] (rows by trainer) -> tower module -> my trainers, and back."""
        world, trainers = self.roles.world_size, self.roles.num_trainers
        m = len(self.group_servers)
        starts = [sum(batches[:r]) for r in range(trainers + 1)]
        mine = self.my_trainers
        b_mine = sum(batches[r] for r in mine)
        # 1. every tower feature of my trainers' rows: per group server, [B_mine, width_s]
        if m == 1:
            blocks = {self.index: pooled}
        else:
            send = [pooled[starts[r[0]] : starts[r[-1] + 1]] if r else pooled[:0] for r in self.group_trainers]
            in_splits = [blk.numel() for blk in send]
            out_splits = [b_mine * w for w in self.group_widths]
            recv = torch.empty(sum(out_splits), dtype=torch.float32)
            t0 = time.perf_counter()
            dist.all_to_all_single(recv, torch.cat([blk.detach().reshape(-1) for blk in send]), out_splits, in_splits,
                                   group=self.tower_group)
            self._count_remote(in_splits)
            self.timings["wait_s"] += time.perf_counter() - t0
            gathered = recv.requires_grad_(train)  # a leaf: its gradient goes back the same way
            blocks = dict(zip(self.group_servers, [blk.view(b_mine, w) for blk, w in
                                                   zip(torch.split(gathered, out_splits), self.group_widths, strict=True)], strict=True))
        piece_out = {}
        for s, block in blocks.items():
            pieces = self.group_pieces[s]
            for p, cols in zip(pieces, torch.split(block, [p.dim for p in pieces], dim=1), strict=True):
                piece_out[(p.table, p.row_start, p.col_start)] = cols
        feats = [SCHEMES[pieces[0].kind].combine([piece_out[(p.table, p.row_start, p.col_start)] for p in pieces], None, table)
                 for table, pieces in self.tower_tables]
        t1 = time.perf_counter()
        with torch.set_grad_enabled(train):
            z = torch.stack(feats, dim=1)  # [B_mine, F_t, D]
            out = self.module(z).reshape(b_mine, self.out_width)  # [B_mine, c_t * D]
        self.timings["tower_s"] += time.perf_counter() - t1
        # 2. to my trainers
        to_trainers = [batches[r] * self.out_width if r in mine else 0 for r in range(trainers)] + [0] * (world - trainers)
        t2 = time.perf_counter()
        self.exchange.all_to_all(torch.empty(0, dtype=self.wire_dtype), out.detach().to(self.wire_dtype).reshape(-1),
                                 [0] * world, to_trainers)
        if not train:
            self.timings["wait_s"] += time.perf_counter() - t2
            return
        grads = torch.empty(b_mine * self.out_width, dtype=self.wire_dtype)
        self.exchange.all_to_all(grads, torch.empty(0, dtype=self.wire_dtype), to_trainers, [0] * world)
        self.timings["wait_s"] += time.perf_counter() - t2
        # 3. backward: through the module, then (m > 1) the tables' gradients back to their servers
        t3 = time.perf_counter()
        out.backward(grads.view(b_mine, self.out_width).float())
        if m > 1:
            back = torch.empty(pooled.numel(), dtype=torch.float32)
            grad_in = gathered.grad if gathered.grad is not None else torch.zeros_like(gathered)
            dist.all_to_all_single(back, grad_in, in_splits, out_splits, group=self.tower_group)
            self._count_remote(out_splits)
            if self.shard is not None and pooled.numel():
                pooled.backward(back.view_as(pooled))  # fused optimizer step
        self._step_module()
        self.timings["update_s"] += time.perf_counter() - t3

    def _count_remote(self, splits: list[int]) -> None:
        """fp32 elements this server sent to tower-mates on other hosts."""
        far = sum(n for n, remote in zip(splits, self.group_remote, strict=True) if remote)
        self.exchange.stats["cross_host_bytes"] += 4 * far

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
                self.exchange.stats["cross_host_bytes"] += int(2 * (m - 1) / m * flat.numel() * 4)
            grads = torch.split(flat, [p.numel() for p in params])
        for p, g in zip(params, grads, strict=True):
            p.grad = g.view_as(p)
        self.module_optimizer.step()
        self.module_optimizer.zero_grad(set_to_none=True)

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
        if self.layout is not None and self.index == self.group_servers[0]:  # one copy per tower
            save_file(directory, f"tower-{self.tower}.pt", {
                "module": self.module.state_dict(),
                "optimizer": self.module_optimizer.state_dict() if self.module_optimizer else {},
            })
