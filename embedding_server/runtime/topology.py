"""Which host each rank runs on: the two-level network of a data centre.

Bandwidth is hierarchical: fast inside a host (loopback, NVLink, PCIe), slow across hosts (the
data-centre network). The exchange (``exchange.py``) and the tower placement (``tower_layout.py``)
use this map to keep traffic inside hosts.

Where the map comes from, first match wins:

* ``dist.topology``: a file, JSON ``{"hosts": [[0, 1, 4], [2, 3, 5]]}`` (ranks per host);
* ``dist.hosts = H``: H emulated hosts, trainers and servers each split in H contiguous blocks
  (host h gets trainers ``h*T/H ..`` and servers ``h*E/H ..``);
* otherwise one host per machine: ranks with the same ``DLRM_HOST`` (or, unset, the same
  hostname) share a host.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from dlrm_core.errors import ConfigError


@dataclass(frozen=True)
class Topology:
    hosts: tuple[int, ...]
    """Host of each rank, hosts numbered 0..H-1 by their lowest rank."""

    @property
    def world_size(self) -> int:
        return len(self.hosts)

    @property
    def num_hosts(self) -> int:
        return len(set(self.hosts))

    def ranks_on(self, host: int) -> list[int]:
        return [r for r, h in enumerate(self.hosts) if h == host]

    def local_index(self, rank: int) -> int:
        return self.ranks_on(self.hosts[rank]).index(rank)

    @property
    def uniform(self) -> bool:
        """Every host runs as many ranks (the hierarchical all-to-all needs it)."""
        return len({len(self.ranks_on(h)) for h in range(self.num_hosts)}) == 1

    def peers(self, local: int) -> list[int]:
        """The rank with local index ``local`` on every host, in host order."""
        return [self.ranks_on(h)[local] for h in range(self.num_hosts)]

    def describe(self) -> str:
        return "; ".join(f"host {h}: ranks {self.ranks_on(h)}" for h in range(self.num_hosts))

    # -- construction ------------------------------------------------------------------------------

    @classmethod
    def from_labels(cls, labels: list) -> Topology:
        """Hosts from one label per rank (hostnames, ids): equal labels share a host."""
        ids: dict = {}
        return cls(tuple(ids.setdefault(label, len(ids)) for label in labels))

    @classmethod
    def even(cls, num_trainers: int, num_servers: int, num_hosts: int) -> Topology:
        """``num_hosts`` emulated hosts with contiguous blocks of trainers and of servers."""
        if num_hosts < 1 or num_hosts > max(num_trainers, num_servers):
            raise ConfigError(
                f"--hosts {num_hosts}: must be between 1 and max(trainers, embedding servers)"
            )
        trainers = [t * num_hosts // num_trainers for t in range(num_trainers)]
        servers = [s * num_hosts // num_servers for s in range(num_servers)] if num_servers else []
        return cls.from_labels(trainers + servers)

    @classmethod
    def load(cls, path: Path | str, world_size: int) -> Topology:
        """A topology file: JSON ``{"hosts": [[ranks of host 0], [ranks of host 1], ...]}``."""
        path = Path(path)
        try:
            groups = json.loads(path.read_text())["hosts"]
            labels = [None] * world_size
            for h, ranks in enumerate(groups):
                for r in ranks:
                    if not isinstance(r, int) or not 0 <= r < world_size:
                        raise ConfigError(
                            f"topology {path}: rank {r!r} of host {h} is not in 0..{world_size - 1}"
                        )
                    if labels[r] is not None:
                        raise ConfigError(
                            f"topology {path}: rank {r} is on hosts {labels[r]} and {h}"
                        )
                    labels[r] = h
        except FileNotFoundError:
            raise ConfigError(f"topology file {path} does not exist") from None
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ConfigError(
                f'topology {path}: expected JSON {{"hosts": [[ranks], ...]}} ({exc})'
            ) from None
        missing = [r for r, h in enumerate(labels) if h is None]
        if missing:
            raise ConfigError(f"topology {path}: rank {missing[0]} is on no host")
        return cls.from_labels(labels)


def host_label() -> str:
    """This process's host: ``DLRM_HOST`` if set, else the hostname."""
    return os.environ.get("DLRM_HOST") or socket.gethostname()
