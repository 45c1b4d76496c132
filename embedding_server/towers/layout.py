"""Where the towers of a ``TowerPlan`` live: servers per tower, who serves which trainer, and the
sharding plan of each tower's tables on its servers.

    servers   split in K contiguous groups, one per tower (sizes differ by at most one); with
              the topology's hosts, each group should sit on one host (a warning otherwise)
    tables    a tower's tables are planned (table-, row- or column-wise, ``planner.py``) over
              its own group only, so a tower's lookups never leave its group
    trainers  within a tower of m servers, trainer r's examples go through the module on
              server ``r * m // T`` of the group (data parallel inside the tower)

Data flow of one training step (compare ``client/distributed.py`` for the flat model):

    trainer r --ids--> every server of every tower (its pieces' ids, as in the flat model)
    server: fused lookup -> pooled [sum_r B_r, width]
            --(m > 1) intra-tower all-to-all--> the tower's features of its own trainers
            tower module [B_r, F_t, D] -> [B_r, c_t, D] --> trainer r
    trainer r: global interaction over C = sum c_t vectors (+ dense)
    backward in reverse; tower modules step their own optimizer (gradients summed over the
    tower's servers), the tables their fused one.
"""

from __future__ import annotations

import logging

from dlrm_core.errors import ConfigError
from dlrm_core.schema import FeatureSpec
from embedding_server.kernels.optimizers import SparseOptimizerKind
from embedding_server.planner import ShardingPlan, Strategy, plan_sharding
from embedding_server.runtime.topology import Topology
from embedding_server.towers.plan import TowerPlan

log = logging.getLogger(__name__)


class TowerLayout:
    """Args:
    plan: the towers (validated against ``spec``).
    num_servers / num_trainers: E and T.
    topology: hosts of the world's ranks (trainers first, then servers), to check placement.
    out_dim: D' of the tower outputs (0: the tables' D).
    """

    def __init__(
        self,
        plan: TowerPlan,
        spec: FeatureSpec,
        num_servers: int,
        num_trainers: int,
        topology: Topology | None = None,
        out_dim: int = 0,
    ) -> None:
        plan.validate_for(spec)
        self.plan = plan
        self.spec = spec
        k = len(plan.towers)
        if num_servers < k:
            raise ConfigError(
                f"--towers: {k} towers need at least {k} embedding servers (one per tower), got "
                f"{num_servers}"
            )
        dims = set(spec.feature_dims)
        if len(dims) != 1:
            raise ConfigError(
                "--towers: tower modules need one embedding dim for every table, got "
                f"{sorted(dims)}"
            )
        self.dim = dims.pop()
        if out_dim > self.dim:
            raise ConfigError(
                f"--tower-dim {out_dim}: the tower outputs compress, so at most the embedding dim "
                f"{self.dim}"
            )
        self.out_dim = out_dim or self.dim
        self.num_trainers = num_trainers
        index = {name: i for i, name in enumerate(spec.sparse_names)}
        self.features_of = [[index[f] for f in tower.features] for tower in plan.towers]
        # Feature index of each tower-ordered feature (tower 0's features, then tower 1's ...).
        self.feature_order = [i for feats in self.features_of for i in feats]
        self.servers_of = [
            list(range(t * num_servers // k, (t + 1) * num_servers // k)) for t in range(k)
        ]
        self.tower_of_server = [t for t, servers in enumerate(self.servers_of) for _ in servers]
        self.outputs = [tower.outputs for tower in plan.towers]
        if topology is not None:
            for t, servers in enumerate(self.servers_of):
                hosts = {topology.hosts[num_trainers + s] for s in servers}
                if len(hosts) > 1:
                    log.warning(
                        "tower %d's servers %s span hosts %s: its intra-tower exchange crosses "
                        "hosts",
                        t,
                        servers,
                        sorted(hosts),
                    )

    @property
    def num_towers(self) -> int:
        return len(self.features_of)

    @property
    def num_outputs(self) -> int:
        """C: vectors the trainers' interaction sees (sum of c_t)."""
        return sum(self.outputs)

    @property
    def compressed(self) -> bool:
        """Some tower module compresses (c_t < F_t): the trainers' over arch also sees the
        outputs themselves. Otherwise the tower model is exactly the flat model."""
        return self.plan.compresses(self.dim, self.out_dim)

    def width(self, tower: int) -> int:
        return self.outputs[tower] * self.out_dim

    def assigned(self, tower: int, trainer: int) -> int:
        """The server (index among servers) running tower ``tower``'s module for ``trainer``."""
        servers = self.servers_of[tower]
        return servers[trainer * len(servers) // self.num_trainers]

    def trainers_of(self, server: int) -> list[int]:
        t = self.tower_of_server[server]
        return [r for r in range(self.num_trainers) if self.assigned(t, r) == server]

    def sharding(
        self,
        optimizer: SparseOptimizerKind,
        strategy: Strategy = "auto",
        server_memory: int | None = None,
        pooling_factors: list[float] | None = None,
    ) -> ShardingPlan:
        """Each tower's tables planned over its own servers, then numbered in the world's terms.

        ``pooling_factors``: mean ids per example of each table (all its features together)."""
        pieces = []
        for t, (feats, servers) in enumerate(zip(self.features_of, self.servers_of, strict=True)):
            # this tower's tables
            tables = list(dict.fromkeys(self.spec.feature_tables[f] for f in feats))
            sub = self.spec.model_copy(
                update={
                    "categorical": [self.spec.categorical[f] for f in feats],
                    "tables": [self.spec.tables[i] for i in tables],
                }
            )
            factors = [pooling_factors[i] for i in tables] if pooling_factors else None
            try:
                part = plan_sharding(sub, len(servers), optimizer, strategy, server_memory, factors)
            except ConfigError as exc:
                raise ConfigError(f"tower {t}: {exc}") from None
            for p in part.pieces:
                table = self.spec.tables[tables[p.table_index]]
                if p.kind == "row_wise" and table.pooling == "mean":
                    raise ConfigError(
                        f"tower {t}: table {table.name} is split row-wise with mean pooling; "
                        "use sum pooling or more memory per server"
                    )
                pieces.append(
                    p.model_copy(
                        update={"table_index": tables[p.table_index], "server": servers[p.server]}
                    )
                )
        return ShardingPlan(num_servers=len(self.tower_of_server), pieces=pieces)
