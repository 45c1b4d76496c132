"""The world all-to-all between trainers and embedding servers: flat or hierarchical.

Both give exactly ``dist.all_to_all_single(output, input, output_splits, input_splits)`` over the
world (1-D tensors, splits in elements, one per rank); they differ in the route:

    flat           every rank sends every other rank its chunk directly: a host pair exchanges
                   up to (ranks on A) x (ranks on B) messages over the slow link
    hierarchical   (DMT's two-level all-to-all; every host runs L ranks)
                   0. sizes  : intra-host, so that forwarders know what they carry
                   1. intra  : rank (h, l) hands the chunk for rank (h', l') to its host-mate
                               (h, l'), over the fast local link
                   2. cross  : (h, l') sends everything bound for host h' to (h', l'): one
                               message per peer pair and host pair, L per host pair in all

Bytes across hosts are the same either way; the hierarchical route sends fewer, larger
cross-host messages (what a congested data-centre network rewards) and one more local hop.
Both count the bytes this rank puts on cross-host links (``stats["cross_host_bytes"]``).
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from dlrm_core.errors import ConfigError
from embedding_server.runtime.topology import Topology


class Exchange:
    """World all-to-all of one rank.

    Args:
        topology: host of every rank.
        rank: this rank.
        hierarchical: route through the host-mates (needs every host to run as many ranks).
        intra_groups / peer_groups: the process groups of each host and of each local index
            (made collectively by ``cluster.join``; None for the flat route).
    """

    def __init__(
        self,
        topology: Topology,
        rank: int,
        hierarchical: bool = False,
        intra_groups: list | None = None,
        peer_groups: list | None = None,
    ) -> None:
        self.topology = topology
        self.rank = rank
        self.host = topology.hosts[rank]
        self.hierarchical = hierarchical
        self.remote = [h != self.host for h in topology.hosts]
        self.stats = {"cross_host_bytes": 0, "cross_host_messages": 0, "exchange_s": 0.0}
        if hierarchical:
            if not topology.uniform:
                raise ConfigError(
                    "hierarchical all-to-all needs as many ranks on every host "
                    f"({topology.describe()})"
                )
            self.local = topology.ranks_on(self.host)  # host-mates, by local index
            self.l = self.local.index(rank)
            self.peers = topology.peers(self.l)  # same local index, by host
            self.intra = intra_groups[self.host]
            self.cross = peer_groups[self.l]
            # hosts in group-rank order
            self.cross_hosts = [topology.hosts[r] for r in sorted(self.peers)]
            # [local index][host] -> rank
            self.peer_of = [topology.peers(lp) for lp in range(len(self.local))]
            self.local_of = [topology.ranks_on(h) for h in range(topology.num_hosts)]

    def all_to_all(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_splits: list[int],
        input_splits: list[int],
    ) -> None:
        t0 = time.perf_counter()
        if self.hierarchical and self.topology.num_hosts > 1:
            self._hierarchical(output, input, output_splits, input_splits)
        else:
            dist.all_to_all_single(output, input, output_splits, input_splits)
            n = sum(s for s, far in zip(input_splits, self.remote, strict=True) if far)
            self.stats["cross_host_bytes"] += n * input.element_size()
            self.stats["cross_host_messages"] += sum(
                1 for s, far in zip(input_splits, self.remote, strict=True) if far and s
            )
        self.stats["exchange_s"] += time.perf_counter() - t0

    def _hierarchical(self, output, input, output_splits, input_splits) -> None:
        hosts, local = self.topology.num_hosts, len(self.local)
        # Chunk of ``input`` bound for each world rank.
        chunks = torch.split(input, input_splits)
        # 0. sizes: to host-mate l', the sizes of my chunks for each host's rank l' -> recv [L, H]
        send_sizes = torch.tensor(
            [[input_splits[self.peer_of[lp][h]] for h in range(hosts)] for lp in range(local)],
            dtype=torch.int64,
        )
        sizes = torch.empty_like(send_sizes)
        dist.all_to_all_single(sizes, send_sizes, group=self.intra)
        # 1. intra: to host-mate l', my chunks for (h, l') for every host h, in host order
        send1 = [chunks[self.peer_of[lp][h]] for lp in range(local) for h in range(hosts)]
        recv1 = torch.empty(int(sizes.sum()), dtype=input.dtype)
        dist.all_to_all_single(
            recv1,
            _cat(send1, input),
            [int(s) for s in sizes.sum(dim=1)],
            [int(s) for s in send_sizes.sum(dim=1)],
            group=self.intra,
        )
        # recv1: per host-mate i, per host h: chunk (i -> (h, l)). Regroup by host for step 2.
        pieces = torch.split(recv1, sizes.view(-1).tolist())  # index i * H + h
        order = self.cross_hosts  # the peer group's ranks are numbered in this host order
        send2 = [pieces[i * hosts + h] for h in order for i in range(local)]
        per_host = sizes.sum(dim=0)
        send2_splits = [int(per_host[h]) for h in order]
        # 2. cross: from the peer on host h, the chunks of h's ranks (by local index) bound for me
        recv_from = [self.local_of[h] for h in order]
        recv2_splits = [sum(output_splits[r] for r in ranks) for ranks in recv_from]
        recv2 = torch.empty(sum(recv2_splits), dtype=input.dtype)
        dist.all_to_all_single(
            recv2, _cat(send2, input), recv2_splits, send2_splits, group=self.cross
        )
        far = [s for h, s in zip(order, send2_splits, strict=True) if h != self.host]
        self.stats["cross_host_bytes"] += sum(far) * input.element_size()
        self.stats["cross_host_messages"] += sum(1 for s in far if s)
        # Into world-rank order.
        if output.numel():
            out_chunks = dict(
                zip(
                    [r for ranks in recv_from for r in ranks],
                    torch.split(recv2, [output_splits[r] for ranks in recv_from for r in ranks]),
                    strict=True,
                )
            )
            torch.cat([out_chunks[r] for r in range(len(output_splits))], out=output)


def _cat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else like[:0]


def make_groups(
    topology: Topology, hierarchical: bool, timeout: datetime.timedelta | None = None
) -> tuple[list | None, list | None]:
    """The intra-host and peer process groups (collective: every rank calls it, same order),
    failing within ``timeout`` of a lost peer like the world group."""
    if not hierarchical or topology.num_hosts < 2 or not topology.uniform:
        return None, None
    intra = [
        dist.new_group(topology.ranks_on(h), timeout=timeout) for h in range(topology.num_hosts)
    ]
    local = len(topology.ranks_on(0))
    peers = [dist.new_group(sorted(topology.peers(lp)), timeout=timeout) for lp in range(local)]
    return intra, peers
