"""How messages cross between trainers and embedding servers: four channels per pair.

    ids      trainer -> server: the command header folded into the id payload (``wire.py``)
    pooled   server -> trainer: the pooled vectors of the trainer's examples, [B_r, width]
    grads    trainer -> server: their gradients, the same layout
    correct  server -> trainer: with ``pipeline = exact``, the bags of an early lookup that the
             previous update changed, looked up again (``correction.py``)

Two routes, one interface (a variant is a module: the client and the server do not know which):

* :class:`P2PTransport` (the default, the **bipartite** exchange): only trainer/server pairs carry
  messages, as tagged ``isend``/``irecv`` (a channel per tag), one message per pair and
  direction. Sends and receives are posted and waited on separately, so a trainer can send the
  next batch's ids, and receive its pooled vectors, while it computes the current batch. An id
  message lands in a buffer of a capacity both sides track: a message that does not fit is
  sent in two parts (the header says so), after which both sides grow the capacity alike.
* :class:`CollectiveTransport` (``--hierarchical``): world all-to-alls (flat or through
  host-mates, ``exchange.py``). Collectives are lockstep: no pipelining on this route.

Every wait is bounded by the process group's timeout (``dist.timeout_s``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from dlrm_core.errors import ConfigError
from embedding_server.runtime.cluster import Cluster, Roles
from embedding_server.runtime.exchange import Exchange
from embedding_server.wire import ID_HEADER

IDS, POOLED, GRADS, CORRECT = 1, 2, 3, 4
"""Channel tags (``CORRECT``: server -> trainer, corrections of early lookups,
``correction.py``)."""
INITIAL_CAPACITY = 4096
"""Elements of an id message's receive buffer before any message grew it."""


def grown(capacity: int, needed: int) -> int:
    """The next capacity of an id channel after a message of ``needed`` elements (both sides)."""
    return max(capacity, int(needed * 1.25) + 64)


class Pending:
    """Posted sends or receives: ``wait()`` completes them (bounded by the group's timeout)."""

    def __init__(self, works: list, result=None, stats: dict | None = None) -> None:
        self.works = works
        self.result = result
        self._stats = stats

    def wait(self):
        t0 = time.perf_counter()
        for w in self.works:
            if w is not None:
                w.wait()
        self.works = []
        if self._stats is not None:
            self._stats["wait_s"] += time.perf_counter() - t0
        return self.result


class P2PTransport:
    """The bipartite exchange: tagged point-to-point messages between trainer/server pairs only.

    Args:
        roles: who is a trainer and who a server.
        rank: this rank.
        id_dtype: dtype of id messages (int32, or int64 for pieces of 2^31 rows or more).
        remote: per rank, whether it is on another host (for the cross-host byte counter).
    """

    pipelined = True

    def __init__(
        self, roles: Roles, rank: int, id_dtype: torch.dtype, remote: Sequence[bool] | None = None
    ) -> None:
        self.roles = roles
        self.rank = rank
        self.id_dtype = id_dtype
        self.remote = list(remote) if remote is not None else [False] * roles.world_size
        self.capacity = [INITIAL_CAPACITY] * roles.world_size  # per peer: its id channel's buffer
        self.stats = {"cross_host_bytes": 0, "cross_host_messages": 0, "wait_s": 0.0, "messages": 0}

    def _count(self, peer: int, t: torch.Tensor) -> None:
        self.stats["messages"] += 1
        if self.remote[peer]:
            self.stats["cross_host_bytes"] += t.numel() * t.element_size()
            self.stats["cross_host_messages"] += 1

    # -- ids ---------------------------------------------------------------------------------------

    def send_ids(self, messages: list[torch.Tensor]) -> Pending:
        """Trainer: one id message (header + payload) to every server, in server order."""
        works = []
        for s, msg in enumerate(messages):
            peer = self.roles.server_rank(s)
            cap = self.capacity[peer]
            if msg.numel() <= cap:
                works.append(dist.isend(msg, peer, tag=IDS))
            else:  # the header tells the server the rest follows; both sides grow the channel
                works.append(dist.isend(msg[:cap].contiguous(), peer, tag=IDS))
                works.append(dist.isend(msg[cap:].contiguous(), peer, tag=IDS))
                self.capacity[peer] = grown(cap, msg.numel())
            self._count(peer, msg)
        return Pending(works, stats=self.stats)

    def post_recv_ids(self) -> Pending:
        """Server: post the receive of every trainer's next id message (first parts)."""
        bufs, works = [], []
        for r in range(self.roles.num_trainers):
            buf = torch.empty(self.capacity[r], dtype=self.id_dtype)
            works.append(dist.irecv(buf, r, tag=IDS))
            bufs.append(buf)
        return Pending(works, bufs, self.stats)

    def finish_ids(self, pending: Pending) -> list[torch.Tensor]:
        """Server: wait for the posted id messages; receive any second part; -> one message per
        trainer."""
        bufs = pending.wait()
        out = []
        for r, buf in enumerate(bufs):
            total = ID_HEADER + int(buf[3])  # header [3]: payload length
            cap = self.capacity[r]
            if total > cap:
                rest = torch.empty(total - cap, dtype=self.id_dtype)
                Pending([dist.irecv(rest, r, tag=IDS)], stats=self.stats).wait()
                buf = torch.cat([buf, rest])
                self.capacity[r] = grown(cap, total)
            out.append(buf[:total])
        return out

    # -- floats ------------------------------------------------------------------------------------

    def send_floats(self, peers: list[int], tensors: list[torch.Tensor], tag: int) -> Pending:
        """Post one float message to each of ``peers`` (empty ones are not sent)."""
        works = []
        for peer, t in zip(peers, tensors, strict=True):
            if t.numel():
                works.append(dist.isend(t.contiguous(), peer, tag=tag))
                self._count(peer, t)
        return Pending(works, stats=self.stats)

    def recv_floats(
        self, peers: list[int], sizes: list[int], dtype: torch.dtype, tag: int
    ) -> Pending:
        """Post the receive of one float message of a known size from each of ``peers``."""
        bufs = [torch.empty(n, dtype=dtype) for n in sizes]
        works = [
            dist.irecv(b, peer, tag=tag) if b.numel() else None
            for peer, b in zip(peers, bufs, strict=True)
        ]
        return Pending(works, bufs, self.stats)


class CollectiveTransport:
    """World all-to-alls (``exchange.py``: flat or hierarchical): every rank takes part in each
    exchange, trainers and servers in the same order, so it is lockstep. Sends complete at once;
    the returned ``Pending`` objects only carry results."""

    pipelined = False

    def __init__(self, roles: Roles, rank: int, id_dtype: torch.dtype, exchange: Exchange) -> None:
        self.roles = roles
        self.rank = rank
        self.id_dtype = id_dtype
        self.exchange = exchange
        self.stats = exchange.stats

    def _a2a(
        self, send: list[torch.Tensor], recv_sizes: list[int], dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """One world all-to-all: ``send`` one tensor per rank, receive ``recv_sizes`` per rank."""
        world = self.roles.world_size
        out = torch.empty(sum(recv_sizes), dtype=dtype)
        data = torch.cat(send) if send else torch.empty(0, dtype=dtype)
        self.exchange.all_to_all(out, data, recv_sizes, [t.numel() for t in send])
        return list(torch.split(out, recv_sizes)) if world else []

    def _sized_a2a(self, send: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """Sizes first (every pair, int64), then the data."""
        world = self.roles.world_size
        sizes = self._a2a(
            [torch.tensor([t.numel()], dtype=torch.int64) for t in send], [1] * world, torch.int64
        )
        return self._a2a(send, [int(s) for s in sizes], dtype)

    def _per_rank(
        self, peers: list[int], tensors: list[torch.Tensor], dtype: torch.dtype
    ) -> list[torch.Tensor]:
        out = [torch.empty(0, dtype=dtype) for _ in range(self.roles.world_size)]
        for peer, t in zip(peers, tensors, strict=True):
            out[peer] = t.reshape(-1).to(dtype)
        return out

    def send_ids(self, messages: list[torch.Tensor]) -> Pending:
        servers = [self.roles.server_rank(s) for s in range(self.roles.num_servers)]
        self._sized_a2a(self._per_rank(servers, messages, self.id_dtype), self.id_dtype)
        return Pending([])

    def post_recv_ids(self) -> Pending:
        return Pending([])

    def finish_ids(self, pending: Pending) -> list[torch.Tensor]:
        nothing = [torch.empty(0, dtype=self.id_dtype)] * self.roles.world_size
        return self._sized_a2a(nothing, self.id_dtype)[: self.roles.num_trainers]

    def send_floats(self, peers: list[int], tensors: list[torch.Tensor], tag: int) -> Pending:
        dtype = tensors[0].dtype if tensors else torch.float32
        send = self._per_rank(peers, tensors, dtype)
        self._a2a(send, [0] * self.roles.world_size, dtype)
        return Pending([])

    def recv_floats(
        self, peers: list[int], sizes: list[int], dtype: torch.dtype, tag: int
    ) -> Pending:
        recv = [0] * self.roles.world_size
        for peer, n in zip(peers, sizes, strict=True):
            recv[peer] = n
        got = self._a2a([torch.empty(0, dtype=dtype)] * self.roles.world_size, recv, dtype)
        return Pending([], [got[p] for p in peers])


def open_transport(cluster: Cluster, id_dtype: torch.dtype) -> P2PTransport | CollectiveTransport:
    """The route of this job: collective when the exchange is hierarchical, else point to point."""
    if cluster.exchange is not None and cluster.exchange.hierarchical:
        return CollectiveTransport(cluster.roles, cluster.rank, id_dtype, cluster.exchange)
    remote = cluster.exchange.remote if cluster.exchange is not None else None
    return P2PTransport(cluster.roles, cluster.rank, id_dtype, remote)


def exchange_chunks(requested: int, cluster: Cluster, towers: bool) -> int:
    """Messages per pair and step (``dist.exchange_chunks``): 0 picks 4 when a trainer/server pair
    crosses hosts (overlapping the two directions of the link pays) and 1 on one host. Towers and
    the collective (hierarchical) route take 1: their exchanges are world-wide, one per step.

    Raises:
        ConfigError: chunks asked for with the hierarchical route.
    """
    if cluster.exchange is not None and cluster.exchange.hierarchical:
        if requested > 1:
            raise ConfigError(
                f"dist.exchange_chunks = {requested} with --hierarchical: the hierarchical "
                "all-to-all is lockstep, one exchange per step (leave exchange_chunks at 0 or 1)"
            )
        return 1
    if towers:
        return 1
    if requested:
        return requested
    hosts = cluster.topology.hosts if cluster.topology is not None else None
    roles = cluster.roles
    if hosts is None:
        return 1
    crossing = any(
        hosts[t] != hosts[roles.server_rank(s)]
        for t in range(roles.num_trainers)
        for s in range(roles.num_servers)
    )
    return 4 if crossing else 1
