"""The tower partitioner: a balanced clustering of the features into K towers.

Features that interact strongly should share a tower, since the interaction between towers only
sees the compressed outputs; towers should cost about the same, since each one's lookups and
compute land on its own hosts. Given a symmetric strength matrix ``S`` (F x F, e.g. how much the
loss relies on each feature pair) and per-feature costs, ``interaction_towers`` maximises
``sum_{i<j, same tower} S[i, j]`` subject to every tower costing at most
``(1 + slack) * total / K``, no tower being empty and tower sizes differing by at most
``ceil(F/K) - floor(F/K) + 1``. It seeds K mutually weakly linked features, grows the towers
greedily by largest gain and then improves them with moves and pairwise swaps (F = 1000 takes
about a second). ``random_towers`` and ``contiguous_towers`` are the ablation baselines.
"""

from __future__ import annotations

import numpy as np

from dlrm_core.errors import ConfigError

_MAX_PASSES = 100
"""Local-search passes over all features; each pass is O(F^2), and it usually stops after few."""


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
