"""Tower plans: the sparse features grouped into K towers (Disaggregated Multi-Tower, MLSys 2024).

DMT splits the sparse features into K towers. Each tower is a small module that sees only its
own features' pooled embeddings and emits ``c_t`` vectors (``c_t < F_t`` compresses the tower,
``c_t = F_t`` is the identity); the dense side's interaction arch then works on
``sum_t c_t`` vectors instead of ``F``. Features that interact strongly should share a tower,
since the interaction between towers only sees the compressed outputs; towers should cost about
the same, since each one's lookups and compute land on its own hosts.

A plan file holds the towers, how they were found and, when known, the share of interaction mass
kept inside towers::

    {
      "towers": [
        {"features": ["C1", "C7", "C12"], "compress": 2},
        {"features": ["C2", "C3"], "compress": null}
      ],
      "method": "interaction",
      "kept_share": 0.71
    }

The partition (``interaction_towers``) is a balanced clustering: given a symmetric strength
matrix ``S`` (F x F, e.g. how much the loss relies on each feature pair) and per-feature costs,
it maximises ``sum_{i<j, same tower} S[i, j]`` subject to every tower costing at most
``(1 + slack) * total / K``, no tower being empty and tower sizes differing by at most
``ceil(F/K) - floor(F/K) + 1``. It seeds K mutually weakly linked features, grows the towers
greedily by largest gain and then improves them with moves and pairwise swaps (F = 1000 takes
about a second).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from embedding_server.errors import ConfigError
from embedding_server.features import FeatureSpec

_MAX_PASSES = 100
"""Local-search passes over all features; each pass is O(F^2), and it usually stops after few."""


class Tower(BaseModel):
    """One tower: its features and how many vectors its module emits."""

    model_config = ConfigDict(extra="forbid")

    features: list[str]
    """Table (= feature) names in this tower, e.g. ``["C1", "C7"]``."""
    compress: int | None = None
    """``c_t``: vectors the tower module emits; ``None``: one per feature (no compression)."""

    @property
    def num_features(self) -> int:
        """``F_t``: features in the tower."""
        return len(self.features)

    @property
    def outputs(self) -> int:
        """``c_t``: vectors the tower emits (``compress``, or ``F_t`` without compression)."""
        return self.compress if self.compress is not None else len(self.features)

    @property
    def identity(self) -> bool:
        """True when the tower does not compress, i.e. its module is the identity."""
        return self.outputs == self.num_features


class TowerPlan(BaseModel):
    """The towers of a model, in tower order."""

    model_config = ConfigDict(extra="forbid")

    towers: list[Tower]
    """The towers; tower ``t``'s outputs come ``t``-th in the interaction input."""
    method: str = "manual"
    """How the towers were found: ``interaction``, ``random``, ``manual`` or ``contiguous``."""
    kept_share: float | None = None
    """Share of the interaction mass between features that falls inside towers, when known."""

    def compresses(self, dim: int, out_dim: int) -> bool:
        """Whether the tower modules change anything, with tables of ``dim`` and outputs of
        ``out_dim``: some tower merges features or the outputs are shorter. Otherwise every
        module is the identity and the tower model is exactly the flat model."""
        return out_dim < dim or not all(t.identity for t in self.towers)

    def validate_for(self, spec: FeatureSpec) -> TowerPlan:
        """Check that the plan partitions exactly the sparse features of ``spec``.

        Args:
            spec: the model's feature spec.

        Returns:
            self, so that ``plan = TowerPlan.load(p).validate_for(spec)`` reads naturally.

        Raises:
            ConfigError: naming the unknown, duplicated or missing feature, the empty tower, or
                the tower whose ``compress`` is outside ``[1, F_t]``.
        """
        known = set(spec.sparse)
        seen: dict[str, int] = {}
        if not self.towers:
            raise ConfigError("tower plan has no towers")
        for t, tower in enumerate(self.towers):
            if not tower.features:
                raise ConfigError(f"tower {t} is empty")
            for name in tower.features:
                if name not in known:
                    raise ConfigError(
                        f"tower {t}: unknown feature {name!r} (not a sparse feature of the spec)"
                    )
                if name in seen:
                    where = (
                        f"towers {seen[name]} and {t}" if seen[name] != t else f"tower {t} twice"
                    )
                    raise ConfigError(f"feature {name!r} is in {where}")
                seen[name] = t
            if tower.compress is not None and not 1 <= tower.compress <= tower.num_features:
                raise ConfigError(
                    f"tower {t}: compress {tower.compress} must be between 1 and its "
                    f"{tower.num_features} features"
                )
        missing = [n for n in spec.sparse if n not in seen]
        if missing:
            raise ConfigError(
                f"feature {missing[0]!r} is in no tower ({len(missing)} missing: {missing})"
            )
        return self

    def feature_order(self, spec: FeatureSpec) -> list[int]:
        """Table indices of ``spec`` in tower order: tower 0's features as listed, then tower 1's...

        Args:
            spec: the model's feature spec (the plan is validated against it).

        Returns:
            A permutation of ``range(len(spec.tables))``.
        """
        self.validate_for(spec)
        index = {name: i for i, name in enumerate(spec.sparse)}
        return [index[name] for tower in self.towers for name in tower.features]

    def tower_of(self, spec: FeatureSpec) -> list[int]:
        """Each table's tower.

        Args:
            spec: the model's feature spec (the plan is validated against it).

        Returns:
            ``out[i]`` is the tower of ``spec.tables[i]``.
        """
        self.validate_for(spec)
        tower = {name: t for t, tw in enumerate(self.towers) for name in tw.features}
        return [tower[name] for name in spec.sparse]

    def with_compress(self, c: int | None) -> TowerPlan:
        """A copy in which every tower emits ``min(c, F_t)`` vectors (``None``: no compression).

        Args:
            c: vectors per tower, at least 1, or ``None``.

        Returns:
            A new plan; this one is unchanged.
        """
        if c is not None and c < 1:
            raise ConfigError(f"compress must be at least 1, got {c}")
        towers = [
            Tower(features=list(t.features), compress=None if c is None else min(c, t.num_features))
            for t in self.towers
        ]
        return self.model_copy(update={"towers": towers})

    @property
    def num_outputs(self) -> int:
        """``sum_t c_t``: vectors that reach the interaction arch."""
        return sum(t.outputs for t in self.towers)

    def save(self, path: Path | str) -> None:
        """Write the plan as JSON (indent 2) atomically: readers see the old or the new file.

        Args:
            path: destination file; its folder is created if needed.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(self.model_dump_json(indent=2) + "\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path | str) -> TowerPlan:
        """Read a plan written by ``save`` (or by hand).

        Args:
            path: the JSON file.

        Returns:
            The plan (not yet validated against a spec: see ``validate_for``).

        Raises:
            ConfigError: naming the path, if the file is missing, not JSON or not a plan.
        """
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"tower plan {path} does not exist") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid JSON: {exc}") from None
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            raise ConfigError(f"{path}: not a tower plan: {where}: {err['msg']}") from None


def _check_k(k: int, F: int) -> None:
    if not 1 <= k <= F:
        raise ConfigError(f"number of towers must be between 1 and the {F} features, got {k}")


def _normalise(groups: list[list[int]]) -> list[list[int]]:
    """Indices sorted within each group, groups ordered by their smallest index."""
    out = [sorted(int(i) for i in g) for g in groups if g]
    return sorted(out, key=lambda g: g[0])


def contiguous_towers(names: list[str], k: int) -> list[list[int]]:
    """``k`` contiguous groups of near-equal size (sizes differ by at most 1), in order.

    Args:
        names: feature names (only their number matters).
        k: number of towers.

    Returns:
        Groups of feature indices; the first ``len(names) % k`` groups hold one more feature.
    """
    F = len(names)
    _check_k(k, F)
    return [part.tolist() for part in np.array_split(np.arange(F), k)]


def random_towers(costs: np.ndarray, k: int, seed: int = 0) -> list[list[int]]:
    """Random but cost-balanced towers: shuffle, then give each feature to the lightest tower.

    Args:
        costs: ``[F]`` positive per-feature costs.
        k: number of towers.
        seed: shuffling seed; the result is a function of it.

    Returns:
        Groups of feature indices (sorted within, ordered by smallest index).
    """
    costs = np.asarray(costs, dtype=np.float64)
    F = len(costs)
    _check_k(k, F)
    order = np.random.default_rng(seed).permutation(F)
    load = np.zeros(k)
    size = np.zeros(k, dtype=np.int64)
    groups: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        t = int(np.lexsort((size, load))[0])  # lightest, then fewest features
        groups[t].append(int(i))
        load[t] += costs[i]
        size[t] += 1
    return _normalise(groups)


class _State:
    """An assignment with the incremental sums the local search needs.

    ``M[i, t]`` is the strength between feature ``i`` and the members of tower ``t``.
    """

    def __init__(self, S: np.ndarray, costs: np.ndarray, assign: np.ndarray, k: int):
        self.S, self.costs, self.k = S, costs, k
        self.assign = assign.copy()
        onehot = np.zeros((len(costs), k))
        onehot[np.arange(len(costs)), assign] = 1.0
        self.M = S @ onehot  # F x K
        self.load = np.bincount(assign, weights=costs, minlength=k)
        self.size = np.bincount(assign, minlength=k)

    def move(self, i: int, b: int) -> None:
        a = self.assign[i]
        self.M[:, a] -= self.S[i]
        self.M[:, b] += self.S[i]
        self.load[a] -= self.costs[i]
        self.load[b] += self.costs[i]
        self.size[a] -= 1
        self.size[b] += 1
        self.assign[i] = b

    def kept(self) -> float:
        return float(self.M[np.arange(len(self.assign)), self.assign].sum() / 2)


def _size_ok_after_move(size: np.ndarray, a: int, d: int) -> np.ndarray:
    """For each target ``b``: are sizes non-empty and within ``d`` after moving one from ``a``?"""
    sz = size.copy()
    sz[a] -= 1
    grown = sz + 1
    second = np.partition(sz, 1)[1] if len(sz) > 1 else sz[0]
    min_others = np.where(sz == sz.min(), second, sz.min())  # min over t != b
    new_min = np.minimum(min_others, grown)
    new_max = np.maximum(sz.max(), grown)
    return (new_min >= 1) & (new_max - new_min <= d)


def _local_search(st: _State, cap: float, d: int, tol: float) -> None:
    """Moves and pairwise swaps that raise kept mass and keep the constraints, until none does."""
    S, costs, F = st.S, st.costs, len(st.costs)
    cols = np.arange(F)
    for _ in range(_MAX_PASSES):
        improved = False
        for i in range(F):
            a = st.assign[i]
            # move i: a -> b
            move_gain = st.M[i] - st.M[i, a]
            move_ok = (st.load + costs[i] <= cap) & _size_ok_after_move(st.size, a, d)
            move_ok[a] = False
            move_gain = np.where(move_ok, move_gain, -np.inf)
            b = int(np.argmax(move_gain))
            # swap i (in a) with j (in B = assign[j])
            B = st.assign
            swap_gain = st.M[i, B] - st.M[i, a] + st.M[cols, a] - st.M[cols, B] - 2.0 * S[i]
            swap_ok = (
                (B != a)
                & (st.load[a] - costs[i] + costs <= cap)
                & (st.load[B] - costs + costs[i] <= cap)
            )
            swap_gain = np.where(swap_ok, swap_gain, -np.inf)
            j = int(np.argmax(swap_gain))
            if move_gain[b] >= swap_gain[j] and move_gain[b] > tol:
                st.move(i, b)
                improved = True
            elif swap_gain[j] > tol:
                bj = int(B[j])
                st.move(i, bj)
                st.move(j, a)
                improved = True
        if not improved:
            return


def _repair(st: _State, cap: float, d: int) -> None:
    """Moves and swaps that lower the cost excess over ``cap``, while any tower exceeds it.

    Each step takes the operation that lowers the total excess most (ties: the larger gain in
    kept mass); it stops when every tower fits or no operation helps.
    """
    S, c, F, k = st.S, st.costs, len(st.costs), st.k
    cols = np.arange(F)

    def excess(load: np.ndarray) -> np.ndarray:
        return np.maximum(load - cap, 0.0)

    for _ in range(2 * F):
        if st.load.max() <= cap:
            return
        A = st.assign
        rows = np.flatnonzero(st.load[A] > cap)  # only leaving an over-full tower can help
        Ar, cr = A[rows], c[rows]
        la, lr = st.load[A], st.load[Ar]  # load of each feature's tower
        # moves rows[r]: Ar[r] -> b, an R x K table
        size_ok = {a: _size_ok_after_move(st.size, a, d) for a in np.unique(Ar).tolist()}
        ok_move = np.stack([size_ok[a] for a in Ar.tolist()]) & (Ar[:, None] != np.arange(k))
        d_move = (excess(lr - cr) - excess(lr))[:, None] + excess(st.load[None, :] + cr[:, None])
        d_move = np.where(ok_move, d_move - excess(st.load)[None, :], np.inf)
        g_move = st.M[rows] - st.M[rows, Ar][:, None]
        # swaps rows[r] <-> j, an R x F table
        d_swap = (
            excess(lr[:, None] - cr[:, None] + c[None, :])
            - excess(lr)[:, None]
            + excess(la[None, :] - c[None, :] + cr[:, None])
            - excess(la)[None, :]
        )
        d_swap = np.where(Ar[:, None] != A[None, :], d_swap, np.inf)
        own = st.M[cols, A]  # strength of each feature to its own tower
        g_swap = (
            st.M[rows][:, A]  # M[i, A[j]]
            - own[rows][:, None]
            + st.M[:, Ar].T  # M[j, A[i]]
            - own[None, :]
            - 2.0 * S[rows]
        )
        best = min(float(d_move.min()), float(d_swap.min()))
        if not best < -1e-12 * cap:
            return
        near = 1e-12 * cap
        g_m = np.where(d_move <= best + near, g_move, -np.inf)
        g_s = np.where(d_swap <= best + near, g_swap, -np.inf)
        if g_m.max() >= g_s.max():
            r, b = np.unravel_index(int(np.argmax(g_m)), g_m.shape)
            st.move(int(rows[r]), int(b))
        else:
            r, j = np.unravel_index(int(np.argmax(g_s)), g_s.shape)
            i = int(rows[r])
            a, b = int(A[i]), int(A[j])
            st.move(i, b)
            st.move(int(j), a)


def _size_allowed(size: np.ndarray, lo: int, hi: int, remaining: int) -> np.ndarray:
    """Towers that may take one more feature so that all can still end with ``lo..hi`` features."""
    deficit = int(np.maximum(lo - size, 0).sum())
    return (size < hi) & ((size < lo) | (remaining - 1 >= deficit))


def _seeds(S: np.ndarray, k: int) -> list[int]:
    """``k`` heavily interacting features that are weakly linked to each other.

    The first seed is the feature of largest total strength; each next one is the feature whose
    strongest link to a chosen seed is the smallest share of its own mean strength (so that a
    feature of another cluster wins over a feature that is merely weak everywhere).
    """
    F = len(S)
    degree = S.sum(axis=1)
    mean = degree / max(F - 1, 1)
    first = int(np.argmax(degree))
    seeds = [first]
    link = S[first].copy()
    taken = np.zeros(F, dtype=bool)
    taken[first] = True
    for _ in range(k - 1):
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(mean > 0, link / mean, np.inf)  # features with no links go last
        score = np.where(taken, np.nan, rel)
        best = np.flatnonzero(score == np.nanmin(score))
        i = int(best[np.argmax(degree[best])])
        seeds.append(i)
        taken[i] = True
        link = np.maximum(link, S[i])
    return seeds


def _grow(
    S: np.ndarray, costs: np.ndarray, k: int, cap: float, lo: int, hi: int, by_gain: bool
) -> np.ndarray:
    """Greedy construction.

    ``by_gain``: seed the towers, then repeatedly add the (feature, tower) of largest gain.
    Otherwise: features in decreasing cost, each to its best-gain tower (first-fit decreasing,
    which packs more reliably when costs are uneven).
    """
    F = len(costs)
    assign = np.full(F, -1)
    M = np.zeros((F, k))
    load = np.zeros(k)
    size = np.zeros(k, dtype=np.int64)
    eps = 1e-9 * (float(S.max()) + 1.0) / (float(costs.sum()) + 1.0)  # ties -> lighter tower

    def put(i: int, t: int) -> None:
        assign[i] = t
        M[:, t] += S[i]
        load[t] += costs[i]
        size[t] += 1

    def fallback(i: int, remaining: int) -> int:  # no tower has room: the lightest allowed one
        ok = _size_allowed(size, lo, hi, remaining)
        return int(np.argmin(np.where(ok, load, np.inf)))

    if by_gain:
        for t, i in enumerate(_seeds(S, k)):
            put(i, t)
        while (assign < 0).any():
            free = np.flatnonzero(assign < 0)
            ok_t = _size_allowed(size, lo, hi, len(free))
            ok = (load[None, :] + costs[free, None] <= cap) & ok_t[None, :]
            score = np.where(ok, M[free] - eps * load[None, :], -np.inf)
            flat = int(np.argmax(score))
            r, t = divmod(flat, k)
            if not np.isfinite(score[r, t]):
                r = int(np.argmax(costs[free]))
                t = fallback(int(free[r]), len(free))
            put(int(free[r]), t)
    else:
        for n, i in enumerate(np.argsort(-costs, kind="stable")):
            ok = (load + costs[i] <= cap) & _size_allowed(size, lo, hi, F - n)
            if ok.any():
                t = int(np.argmax(np.where(ok, M[i] - eps * load, -np.inf)))
            else:
                t = fallback(int(i), F - n)
            put(int(i), t)
    return assign


def interaction_towers(
    strength: np.ndarray, costs: np.ndarray, k: int, slack: float = 0.15, seed: int = 0
) -> list[list[int]]:
    """Balanced clustering that keeps the strongest interactions inside towers.

    Maximises ``sum S[i, j]`` over pairs ``i < j`` in the same tower, subject to every tower's
    cost ``<= (1 + slack) * total / k`` (raised to the largest single cost if that is larger),
    every tower non-empty and tower sizes differing by at most ``ceil(F/k) - floor(F/k) + 1``.
    Two greedy constructions (largest gain from k seeds; first-fit decreasing by cost) are each
    repaired (if a tower is over the cost bound) and improved by moves and swaps; the best one
    that meets the cost bound wins (if none can, the one with the lightest heaviest tower).

    Args:
        strength: ``[F, F]`` symmetric, non-negative interaction strengths (diagonal ignored).
        costs: ``[F]`` positive per-feature costs (e.g. embedding dim or lookup bytes).
        k: number of towers, ``1 <= k <= F``.
        slack: allowed cost excess of a tower over the mean.
        seed: tie-breaking seed; the result is a function of the inputs and the seed.

    Returns:
        Groups of feature indices (sorted within, ordered by smallest index).

    Raises:
        ConfigError: if ``k`` is out of range or the shapes or values are invalid.
    """
    costs = np.asarray(costs, dtype=np.float64)
    S = np.asarray(strength, dtype=np.float64)
    F = len(costs)
    if S.shape != (F, F):
        raise ConfigError(f"strength must be [F, F] = [{F}, {F}], got {list(S.shape)}")
    if not (costs > 0).all() or not np.isfinite(costs).all():
        raise ConfigError("feature costs must be positive and finite")
    if not np.isfinite(S).all() or (S < 0).any():
        raise ConfigError("interaction strengths must be finite and non-negative")
    _check_k(k, F)
    if k == 1:
        return [list(range(F))]
    # Work on a seed-dependent permutation, so that ties are broken by the seed.
    perm = np.random.default_rng(seed).permutation(F)
    S = (S + S.T)[np.ix_(perm, perm)] / 2.0
    np.fill_diagonal(S, 0.0)
    c = costs[perm]
    cap = max((1.0 + slack) * c.sum() / k, float(c.max())) * (1.0 + 1e-9)
    lo, hi = F // k, -(-F // k)
    d = hi - lo + 1
    tol = 1e-12 * (float(S.sum()) + 1.0)
    best: tuple[bool, float, np.ndarray] | None = None
    for by_gain in (True, False):
        st = _State(S, c, _grow(S, c, k, cap, lo, hi, by_gain), k)
        _repair(st, cap, d)
        _local_search(st, cap, d, tol)
        fits = bool(st.load.max() <= cap)
        score = st.kept() if fits else -float(st.load.max())
        if best is None or (fits, score) > (best[0], best[1]):
            best = (fits, score, st.assign.copy())
    assert best is not None
    groups: list[list[int]] = [[] for _ in range(k)]
    for pos, t in enumerate(best[2]):
        groups[int(t)].append(int(perm[pos]))
    return _normalise(groups)


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
        else np.array([t.dim for t in spec.tables], dtype=np.float64)
    )
    groups: list[list[int]] = [[] for _ in plan.towers]
    for i, t in enumerate(tower_of):
        groups[t].append(i)
    total = float(cost.sum())
    lines = ["| tower | features | F_t | c_t | cost share |", "|---|---|---|---|---|"]
    for t, tower in enumerate(plan.towers):
        share = float(cost[groups[t]].sum()) / total
        lines.append(
            f"| {t} | {', '.join(tower.features)} | {tower.num_features} | {tower.outputs} | {share:.1%} |"
        )
    summary = f"cost balance (max/mean): {cost_balance(cost, groups):.3f}"
    if strength is not None:
        summary += f"; kept interaction share: {kept_share(strength, groups):.1%}"
    return "\n".join(lines) + "\n\n" + summary
