"""A distributed job's plan, made once by the master (or the local launcher) before the ranks
start: each table's pooling factor measured on the training data, the towers placed on the
servers, the sharding plan that every rank receives."""

from __future__ import annotations

from pathlib import Path

from dense_trainer.config import Config
from dense_trainer.data.loader import BatchLoader
from dlrm_core.errors import ConfigError
from embedding_server.planner import (
    ShardingPlan,
    parse_bytes,
    plan_sharding,
    table_factors,
)
from embedding_server.towers.layout import TowerLayout
from embedding_server.towers.plan import TowerPlan

SAMPLE_ROWS = 20_000
"""Rows of the first training file read to measure each table's pooling factor."""


def pooling_factors(cfg: Config, files: list[Path]) -> list[float]:
    """Mean ids per bag of each categorical feature, on the first rows of the training data."""
    spec = cfg.feature_spec()
    loader = BatchLoader(files[:1], spec, SAMPLE_ROWS, num_workers=0, max_rows=SAMPLE_ROWS)
    batch = next(iter(loader), None)
    if batch is None:
        return [1.0] * len(spec.categorical)
    return [float(x) for x in batch.sparse.lengths().float().mean(dim=1)]


def tower_layout(cfg: Config, topology=None) -> TowerLayout | None:
    """The towers of ``dist.towers`` placed on this job's servers (None without towers)."""
    d = cfg.dist
    if not d.towers:
        return None
    plan = TowerPlan.load(d.towers)
    if d.tower_compress:
        plan = plan.with_compress(d.tower_compress)
    if cfg.model.kind != "dlrm":
        raise ConfigError("--towers needs model.kind = dlrm (tower modules feed its interaction)")
    if cfg.live.store:
        raise ConfigError(
            "--towers with live updates: the tower modules train on the servers and are not pushed "
            "live yet; publish the run's checkpoints instead (dlrm publish)"
        )
    return TowerLayout(
        plan, cfg.feature_spec(), d.embedding_servers, d.trainers, topology, d.tower_dim
    )


def make_plan(
    cfg: Config, files: list[Path] | None = None, factors: list[float] | None = None
) -> ShardingPlan:
    """The sharding plan (per tower with towers); pooling factors (per feature) measured on
    ``files`` unless given."""
    d = cfg.dist
    if factors is None and files:
        factors = pooling_factors(cfg, files)
    factors = table_factors(cfg.feature_spec(), factors)
    memory = parse_bytes(d.server_memory) if d.server_memory else None
    layout = tower_layout(cfg)
    if layout is not None:
        return layout.sharding(cfg.embedding.optimizer.kind, d.sharding, memory, factors)
    plan = plan_sharding(
        cfg.feature_spec(),
        d.embedding_servers,
        cfg.embedding.optimizer.kind,
        d.sharding,
        memory,
        factors,
    )
    if cfg.live.store and any(p.kind == "column_wise" for p in plan.pieces):
        raise ConfigError(
            "live updates need whole rows on each server: use table- or row-wise sharding"
        )
    return plan
