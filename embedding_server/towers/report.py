"""Reporting on tower partitions: kept interaction share, cost balance, the plan table."""

from __future__ import annotations

import numpy as np

from dlrm_core.schema import FeatureSpec
from embedding_server.towers.plan import Tower, TowerPlan


def kept_share(strength: np.ndarray, groups: list[list[int]]) -> float:
    """Intra-tower share of the off-diagonal interaction mass (upper triangle).

    Args:
        strength: ``[F, F]`` interaction strengths.
        groups: feature indices per tower.

    Returns:
        Intra-tower mass / total mass; 1.0 if the total is 0.
    """
    upper = np.triu(np.asarray(strength, dtype=np.float64), 1)
    total = float(upper.sum())
    if total == 0.0:
        return 1.0
    kept = sum(float(upper[np.ix_(g, g)].sum()) for g in groups if g)
    return kept / total


def cost_balance(costs: np.ndarray, groups: list[list[int]]) -> float:
    """Max tower cost / mean tower cost (1.0 is perfect balance).

    Args:
        costs: ``[F]`` per-feature costs.
        groups: feature indices per tower.

    Returns:
        The ratio.
    """
    costs = np.asarray(costs, dtype=np.float64)
    loads = np.array([costs[g].sum() for g in groups])
    return float(loads.max() / loads.mean())


def make_plan(
    names: list[str],
    groups: list[list[int]],
    method: str,
    compress: int | None,
    strength: np.ndarray | None = None,
) -> TowerPlan:
    """A plan from groups of feature indices.

    Args:
        names: feature names, indexed by the groups.
        groups: feature indices per tower; towers keep this order, features are sorted by index.
        method: how the groups were found (stored in the plan).
        compress: vectors per tower (clamped to each tower's size), or ``None``.
        strength: ``[F, F]`` strengths; when given, the plan records its ``kept_share``.

    Returns:
        The plan.
    """
    towers = [Tower(features=[names[i] for i in sorted(g)]) for g in groups]
    share = kept_share(strength, groups) if strength is not None else None
    return TowerPlan(towers=towers, method=method, kept_share=share).with_compress(compress)


def describe_towers(
    plan: TowerPlan,
    spec: FeatureSpec,
    costs: np.ndarray | None = None,
    strength: np.ndarray | None = None,
) -> str:
    """A markdown table of the towers, then their cost balance and kept interaction share.

    Args:
        plan: the towers (validated against ``spec``).
        spec: the model's feature spec.
        costs: ``[F]`` per-table costs in spec order; default: each table's embedding dim.
        strength: ``[F, F]`` strengths in spec order; when given, the kept share is reported.

    Returns:
        Markdown text.
    """
    tower_of = plan.tower_of(spec)
    cost = (
        np.asarray(costs, dtype=np.float64)
        if costs is not None
        else np.array(spec.feature_dims, dtype=np.float64)
    )
    groups: list[list[int]] = [[] for _ in plan.towers]
    for i, t in enumerate(tower_of):
        groups[t].append(i)
    total = float(cost.sum())
    lines = ["| tower | features | F_t | c_t | cost share |", "|---|---|---|---|---|"]
    for t, tower in enumerate(plan.towers):
        share = float(cost[groups[t]].sum()) / total
        lines.append(
            f"| {t} | {', '.join(tower.features)} | {tower.num_features} | {tower.outputs} | "
            f"{share:.1%} |"
        )
    summary = f"cost balance (max/mean): {cost_balance(cost, groups):.3f}"
    if strength is not None:
        summary += f"; kept interaction share: {kept_share(strength, groups):.1%}"
    return "\n".join(lines) + "\n\n" + summary
