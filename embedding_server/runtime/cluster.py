"""Roles in one torch.distributed world: trainers first, then embedding servers.

    ranks 0 .. T-1        trainers (dense arches; rank 0 is the master: logs, metrics, checkpoints)
    ranks T .. T+E-1      embedding servers (table pieces in host memory, fused optimizers)

Gloo carries everything on CPU. Process groups: the world (the all-to-alls between trainers
and servers, routed flat or hierarchically by ``exchange.py`` over the hosts of ``topology.py``),
the trainers alone (DDP's gradient all-reduce, evaluation gathers), and, for the hierarchical
route, each host's ranks and each set of peers (same local index on every host): all with the
step timeout ``dist.timeout_s``. The *slow* group (the world again) carries the waits on one
rank's long work (restoring, publishing, the last checkpoint); its timeout is scaled to the
bytes that work moves (:func:`open_slow_group`). Every rank beats through the rendezvous store
from its first moment (``watchdog.py``), so a hung peer is noticed within ``dist.timeout_s``
whatever the wait.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dlrm_core.errors import ConfigError
from embedding_server.runtime.exchange import Exchange, make_groups
from embedding_server.runtime.topology import Topology, host_label
from embedding_server.runtime.watchdog import SUPERVISED_ENV, Heartbeat, connect

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
    trainer_group: object | None
    """The trainers' group for DDP (NCCL when they train on CUDA, else Gloo); None for one
    trainer."""
    slow_group: object | None = None
    """The world again, with a timeout scaled to the bytes of the model (:func:`open_slow_group`):
    for the moments when every rank waits on one rank's long work (restoring a checkpoint,
    finishing the last one, publishing the live version)."""
    topology: Topology | None = None
    """Host of every rank."""
    trainer_cpu_group: object | None = None
    """The trainers again, over Gloo: CPU-side agreements (per-step vectors, gathered objects)."""
    exchange: Exchange | None = None
    """The world all-to-all (flat or hierarchical) of the collective route."""
    transport: object | None = None
    """How trainers and servers exchange messages (``transport.open_transport``, once the plan
    fixes the id dtype)."""
    heartbeat: Heartbeat | None = None
    """This rank's heartbeat (and its long phases, each with its bound)."""
    slow_timeout_s: float = 0.0
    """Timeout of ``slow_group``."""

    @property
    def is_trainer(self) -> bool:
        return self.roles.is_trainer(self.rank)

    @property
    def is_master(self) -> bool:
        return self.rank == 0


def wait_for_master(addr: str, port: int, deadline: float, who: str) -> None:
    """Bounded wait until the master's rendezvous port answers (it may start later, or its
    name may not resolve yet), with a log line every ten attempts."""
    attempt = 0
    while True:
        attempt += 1
        try:
            with socket.create_connection((addr, port), timeout=2):
                return
        except OSError as exc:
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"{who}: the master {addr}:{port} did not answer in time ({exc})"
                ) from None
            if attempt % 10 == 1:
                log.info("%s: waiting for the master at %s:%d (%s)", who, addr, port, exc)
            time.sleep(1.0)


def join(
    roles: Roles,
    timeout_s: float,
    rank: int | None = None,
    join_timeout_s: float = 600.0,
    hosts: int = 0,
    topology_file: str | None = None,
    hierarchical: bool = False,
    trainer_device: str = "cpu",
    heartbeat_s: float = 1.0,
    prog: str = "dlrm worker",
) -> Cluster:
    """Join the world (address and rank from the environment, as torchrun sets them).

    Rendezvous may wait up to ``join_timeout_s`` for every rank to arrive (ranks start in any
    order); after that, every collective fails within ``timeout_s`` of a lost peer, and a peer
    that stops beating (every ``heartbeat_s``) is lost after ``timeout_s``. The store is hosted by
    torchrun's agent, by the local launcher (``DLRM_SUPERVISED=1``: it watches the beats), or
    else by rank 0. The host map comes from ``topology_file``, else ``hosts`` emulated hosts, else
    the machines' own names (see ``topology.py``); ``hierarchical`` routes the world all-to-all
    through host-mates. With ``trainer_device`` cuda (and CUDA present), the trainers' DDP group
    runs on NCCL; the world (trainers and servers) stays on Gloo.
    """
    rank = int(os.environ["RANK"]) if rank is None else rank
    world = int(os.environ.get("WORLD_SIZE", roles.world_size))
    if world != roles.world_size:
        raise ConfigError(
            f"WORLD_SIZE is {world} but --trainers {roles.num_trainers} + --embedding-servers "
            f"{roles.num_servers} = {roles.world_size}"
        )
    who = roles.describe(rank)
    step_timeout = datetime.timedelta(seconds=timeout_s)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    supervised = os.environ.get(SUPERVISED_ENV) == "1"

    def beat() -> Heartbeat:
        store = connect(addr, port, max(1.0, min(10.0, timeout_s / 4)))
        return Heartbeat(
            store,
            rank,
            world,
            roles.describe,
            timeout_s,
            heartbeat_s,
            watch_peers=not supervised,
            where=f"{addr}:{port}",
            prog=prog,
        ).start()

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun already holds the store
        heartbeat = beat()
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=step_timeout)
    else:
        deadline = time.monotonic() + join_timeout_s
        hosts_store = rank == 0 and not supervised
        if not hosts_store:
            wait_for_master(addr, port, deadline, who)
        log.info(
            "%s: joining %d ranks at %s:%d (up to %.0fs)", who, world, addr, port, join_timeout_s
        )
        store = dist.TCPStore(
            addr,
            port,
            world,
            is_master=hosts_store,
            wait_for_workers=True,
            timeout=datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())),
        )
        heartbeat = beat()
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world, timeout=step_timeout
        )
    trainers = list(range(roles.num_trainers))
    # NCCL between trainers only if every trainer has CUDA (every rank must agree: group creation
    # is a collective made by every rank in the same order, members or not).
    mine = roles.is_trainer(rank) and trainer_device == "cuda" and torch.cuda.is_available()
    flags: list = [None] * world
    dist.all_gather_object(flags, mine)
    cuda = all(flags[: roles.num_trainers])
    # DDP's all-reduce and the evaluation gathers: a lost trainer ends them within the step
    # timeout too (PyTorch's default would be 30 minutes).
    cpu_group = dist.new_group(trainers, timeout=step_timeout) if roles.num_trainers > 1 else None
    group = cpu_group
    if cuda and roles.num_trainers > 1:  # DDP's all-reduce over NCCL between CUDA trainers
        group = dist.new_group(trainers, timeout=step_timeout, backend="nccl")
    if topology_file:
        topology = Topology.load(topology_file, world)
    elif hosts:
        topology = Topology.even(roles.num_trainers, roles.num_servers, hosts)
    else:
        labels: list = [None] * world
        dist.all_gather_object(labels, host_label())
        topology = Topology.from_labels(labels)
    if hierarchical and not topology.uniform:
        raise ConfigError(
            f"--hierarchical needs as many ranks on every host ({topology.describe()})"
        )
    intra, peers = make_groups(topology, hierarchical, step_timeout)
    exchange = Exchange(topology, rank, hierarchical and intra is not None, intra, peers)
    if rank == 0:
        log.info(
            "topology: %s%s",
            topology.describe(),
            "; hierarchical all-to-all" if exchange.hierarchical else "",
        )
    log.debug("joined as %s", who)
    return Cluster(roles, rank, group, None, topology, cpu_group, exchange, heartbeat=heartbeat)


def open_slow_group(cluster: Cluster, timeout_s: float) -> None:
    """Make the world group for waits on long work, with ``timeout_s`` (every rank calls this)."""
    world = cluster.roles.world_size
    cluster.slow_group = dist.new_group(
        list(range(world)), timeout=datetime.timedelta(seconds=timeout_s)
    )
    cluster.slow_timeout_s = timeout_s
