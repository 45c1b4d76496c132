"""Roles in one torch.distributed world: trainers first, then embedding servers.

    ranks 0 .. T-1        trainers (dense arches; rank 0 is the master: logs, metrics, checkpoints)
    ranks T .. T+E-1      embedding servers (table pieces in host memory, fused optimizers)

Gloo carries everything on CPU. Two process groups: the world (the all-to-alls between trainers
and servers) and the trainers alone (DDP's gradient all-reduce, evaluation gathers).
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch.distributed as dist

from embedding_server.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Roles:
    num_trainers: int
    num_servers: int

    @property
    def world_size(self) -> int:
        return self.num_trainers + self.num_servers

    def is_trainer(self, rank: int) -> bool:
        return rank < self.num_trainers

    def server_rank(self, server: int) -> int:
        return self.num_trainers + server

    def server_index(self, rank: int) -> int:
        return rank - self.num_trainers

    def describe(self, rank: int) -> str:
        if self.is_trainer(rank):
            return f"rank {rank} (trainer {rank}{', master' if rank == 0 else ''})"
        return f"rank {rank} (embedding server {self.server_index(rank)})"


@dataclass
class Cluster:
    """This process's place in the world, after :func:`join`."""

    roles: Roles
    rank: int
    trainer_group: object | None  # a ProcessGroup, or None for a single trainer

    @property
    def is_trainer(self) -> bool:
        return self.roles.is_trainer(self.rank)

    @property
    def is_master(self) -> bool:
        return self.rank == 0


def join(roles: Roles, timeout_s: float, rank: int | None = None) -> Cluster:
    """Join the world (address and rank from the environment, as torchrun sets them)."""
    rank = int(os.environ["RANK"]) if rank is None else rank
    world = int(os.environ.get("WORLD_SIZE", roles.world_size))
    if world != roles.world_size:
        raise ConfigError(
            f"WORLD_SIZE is {world} but --trainers {roles.num_trainers} + --embedding-servers "
            f"{roles.num_servers} = {roles.world_size}"
        )
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s)
    )
    group = dist.new_group(list(range(roles.num_trainers))) if roles.num_trainers > 1 else None
    log.debug("joined as %s", roles.describe(rank))
    return Cluster(roles, rank, group)
