"""Tower plans (DMT): the plan file, its validation, and the tower partitions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dlrm_core.errors import ConfigError
from dlrm_core.schema import CategoricalFeature, DenseFeature, FeatureSpec, build_spec
from embedding_server.towers.partition import contiguous_towers, interaction_towers, random_towers
from embedding_server.towers.plan import Tower, TowerPlan
from embedding_server.towers.report import cost_balance, describe_towers, kept_share, make_plan


def _spec(n: int = 6) -> FeatureSpec:
    feats = [
        CategoricalFeature(
            kind="categorical", name=f"C{i + 1}", rows=10 * (i + 1), dim=4 + 4 * (i % 2)
        )
        for i in range(n)
    ]
    return build_spec([DenseFeature(kind="dense", name="I1"), *feats], "csv", label="y")


def _plan(*towers: list[str], compress: int | None = None) -> TowerPlan:
    return TowerPlan(towers=[Tower(features=list(t), compress=compress) for t in towers])


def _planted(sizes: list[int], seed: int, noise: float = 0.1) -> tuple[np.ndarray, list[list[int]]]:
    """Strong intra-block strengths plus noise everywhere, block labels on shuffled indices."""
    rng = np.random.default_rng(seed)
    F = sum(sizes)
    label = rng.permutation(np.repeat(np.arange(len(sizes)), sizes))
    S = rng.uniform(0, noise, (F, F))
    S += (label[:, None] == label[None, :]) * rng.uniform(0.5, 1.5, (F, F))
    S = (S + S.T) / 2
    np.fill_diagonal(S, 0.0)
    truth = [np.flatnonzero(label == b).tolist() for b in range(len(sizes))]
    return S, truth


def _canon(groups: list[list[int]]) -> list[list[int]]:
    return sorted(sorted(g) for g in groups)


# --- the plan and its file -------------------------------------------------------------------


class TestTowerPlan:
    def test_tower_properties(self):
        assert Tower(features=["C1", "C2", "C3"]).outputs == 3
        assert Tower(features=["C1", "C2", "C3"]).identity
        t = Tower(features=["C1", "C2", "C3"], compress=2)
        assert (t.num_features, t.outputs, t.identity) == (3, 2, False)
        assert Tower(features=["C1", "C2"], compress=2).identity

    def test_valid_plan_returns_self(self):
        plan = _plan(["C1", "C4"], ["C2", "C3", "C5", "C6"])
        assert plan.validate_for(_spec()) is plan

    @pytest.mark.parametrize(
        ("towers", "compress", "needle"),
        [
            ((["C1", "C2", "C3"], ["C4", "C5", "C6", "C9"]), None, "'C9'"),  # unknown
            ((["C1", "C2", "C3"], ["C3", "C4", "C5", "C6"]), None, "'C3'"),  # in two towers
            ((["C1", "C2", "C2"], ["C3", "C4", "C5", "C6"]), None, "'C2'"),  # twice in one
            ((["C1", "C2", "C3"], ["C4", "C5"]), None, "'C6'"),  # missing
            ((["C1", "C2", "C3", "C4", "C5", "C6"], []), None, "tower 1 is empty"),
        ],
    )
    def test_validate_errors(self, towers, compress, needle):
        with pytest.raises(ConfigError, match=needle):
            _plan(*towers, compress=compress).validate_for(_spec())

    @pytest.mark.parametrize("compress", [0, -1, 4])
    def test_validate_bad_compress(self, compress):
        plan = TowerPlan(
            towers=[
                Tower(features=["C1", "C2", "C3"], compress=compress),
                Tower(features=["C4", "C5", "C6"]),
            ]
        )
        with pytest.raises(ConfigError, match=f"tower 0: compress {compress}"):
            plan.validate_for(_spec())

    def test_feature_order_and_tower_of(self):
        plan = _plan(["C5", "C1"], ["C2", "C6"], ["C4", "C3"])
        spec = _spec()
        assert plan.feature_order(spec) == [4, 0, 1, 5, 3, 2]
        assert plan.tower_of(spec) == [0, 1, 2, 2, 0, 1]

    def test_feature_order_validates(self):
        with pytest.raises(ConfigError, match="'C6'"):
            _plan(["C1", "C2"], ["C3", "C4", "C5"]).feature_order(_spec())

    def test_with_compress(self):
        plan = _plan(["C1"], ["C2", "C3"], ["C4", "C5", "C6"])
        two = plan.with_compress(2)
        assert [t.compress for t in two.towers] == [1, 2, 2]
        assert [t.outputs for t in two.towers] == [1, 2, 2]
        assert two.num_outputs == 5
        assert [t.identity for t in two.towers] == [True, True, False]
        assert plan.num_outputs == 6 and all(t.compress is None for t in plan.towers)
        back = two.with_compress(None)
        assert all(t.compress is None for t in back.towers) and back.num_outputs == 6
        two.validate_for(_spec())

    def test_save_load_roundtrip(self, tmp_path):
        plan = _plan(["C1", "C4"], ["C2", "C3", "C5", "C6"]).with_compress(2)
        plan = plan.model_copy(update={"method": "interaction", "kept_share": 0.625})
        path = tmp_path / "sub" / "towers.json"
        plan.save(path)
        assert TowerPlan.load(path) == plan
        assert '\n  "towers": [' in path.read_text()  # indent 2
        assert [p.name for p in path.parent.iterdir()] == ["towers.json"]  # no temp left over

    def test_load_missing(self, tmp_path):
        path = tmp_path / "nope.json"
        with pytest.raises(ConfigError, match="nope.json"):
            TowerPlan.load(path)

    def test_load_bad_json(self, tmp_path):
        path = tmp_path / "bad.json"
        path.write_text("{not json")
        with pytest.raises(ConfigError, match=r"bad\.json: not valid JSON"):
            TowerPlan.load(path)

    @pytest.mark.parametrize(
        "text",
        [
            '{"towers": [{"features": ["C1"], "extra": 1}]}',
            '{"towers": [{"features": "C1"}]}',
            '{"method": "manual"}',
            "[1, 2]",
        ],
    )
    def test_load_bad_schema(self, tmp_path, text):
        path = tmp_path / "schema.json"
        path.write_text(text)
        with pytest.raises(ConfigError, match=r"schema\.json: not a tower plan") as info:
            TowerPlan.load(path)
        assert "\n" not in str(info.value)

    def test_make_plan_and_describe(self):
        spec = _spec()
        names = spec.sparse_names
        S = np.zeros((6, 6))
        S[0, 3] = S[3, 0] = 3.0
        S[1, 2] = S[2, 1] = 1.0
        plan = make_plan(names, [[3, 0], [5, 1, 2, 4]], "manual", 3, strength=S)
        assert [t.features for t in plan.towers] == [["C1", "C4"], ["C2", "C3", "C5", "C6"]]
        assert [t.compress for t in plan.towers] == [2, 3]
        assert plan.kept_share == pytest.approx(1.0)
        assert make_plan(names, [[0, 1, 2], [3, 4, 5]], "contiguous", None).kept_share is None
        text = describe_towers(plan, spec, strength=S)
        assert text.splitlines()[0] == "| tower | features | F_t | c_t | cost share |"
        assert "| 0 | C1, C4 | 2 | 2 | 33.3% |" in text  # dims 4 + 8 of 36
        assert "cost balance (max/mean): 1.333" in text
        assert "kept interaction share: 100.0%" in text
        assert "kept" not in describe_towers(plan, spec, costs=np.ones(6))


# --- partitions --------------------------------------------------------------------------------


class TestPartitions:
    @pytest.mark.parametrize(("F", "k"), [(26, 1), (26, 3), (26, 4), (7, 7), (10, 3)])
    def test_contiguous(self, F, k):
        groups = contiguous_towers([f"C{i}" for i in range(F)], k)
        assert len(groups) == k
        assert [i for g in groups for i in g] == list(range(F))
        sizes = [len(g) for g in groups]
        assert max(sizes) - min(sizes) <= 1

    @pytest.mark.parametrize("k", [2, 3, 4])
    def test_random_balanced_and_deterministic(self, k):
        costs = np.ones(26)
        groups = random_towers(costs, k, seed=3)
        assert len(groups) == k
        assert sorted(i for g in groups for i in g) == list(range(26))
        assert cost_balance(costs, groups) <= 1.3
        assert random_towers(costs, k, seed=3) == groups
        assert any(random_towers(costs, k, seed=s) != groups for s in range(4, 8))

    @pytest.mark.parametrize("fn", ["contiguous", "random", "interaction"])
    @pytest.mark.parametrize("k", [0, 27])
    def test_k_out_of_range(self, fn, k):
        with pytest.raises(ConfigError, match="number of towers"):
            if fn == "contiguous":
                contiguous_towers([f"C{i}" for i in range(26)], k)
            elif fn == "random":
                random_towers(np.ones(26), k)
            else:
                interaction_towers(np.ones((26, 26)), np.ones(26), k)

    def test_kept_share_and_balance(self):
        S = np.array([[0, 2, 1], [2, 0, 1], [1, 1, 0]], dtype=float)
        assert kept_share(S, [[0, 1], [2]]) == pytest.approx(0.5)
        assert kept_share(S, [[0, 1, 2]]) == pytest.approx(1.0)
        assert kept_share(np.zeros((3, 3)), [[0], [1, 2]]) == 1.0
        assert cost_balance(np.array([1.0, 1.0, 2.0]), [[0, 1], [2]]) == pytest.approx(1.0)
        assert cost_balance(np.array([1.0, 1.0, 2.0]), [[0, 1, 2], []]) == pytest.approx(2.0)

    @pytest.mark.parametrize("sizes", [[13, 13], [9, 9, 8], [7, 7, 6, 6]])
    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_interaction_recovers_planted_blocks(self, sizes, seed):
        S, truth = _planted(sizes, seed)
        groups = interaction_towers(S, np.ones(len(S)), len(sizes), seed=seed)
        assert _canon(groups) == _canon(truth)
        assert kept_share(S, groups) == pytest.approx(kept_share(S, truth))
        assert kept_share(S, groups) > kept_share(
            S, random_towers(np.ones(len(S)), len(sizes), seed)
        )

    def test_interaction_deterministic(self):
        S, _ = _planted([9, 9, 8], 5, noise=0.8)
        costs = np.random.default_rng(5).uniform(0.5, 2.0, len(S))
        assert interaction_towers(S, costs, 3, seed=1) == interaction_towers(S, costs, 3, seed=1)

    @pytest.mark.parametrize(("k", "seed"), [(2, 0), (3, 1), (4, 2), (5, 3)])
    def test_interaction_respects_constraints(self, k, seed):
        S, _ = _planted([7, 7, 6, 6], seed, noise=0.3)
        F = len(S)
        costs = np.random.default_rng(seed).uniform(0.5, 2.0, F)
        slack = 0.15
        groups = interaction_towers(S, costs, k, slack=slack, seed=seed)
        assert len(groups) == k and all(groups)
        assert sorted(i for g in groups for i in g) == list(range(F))
        assert cost_balance(costs, groups) <= 1 + slack + 1e-9
        sizes = [len(g) for g in groups]
        assert max(sizes) - min(sizes) <= math.ceil(F / k) - F // k + 1
        random_share = kept_share(S, random_towers(costs, k, seed))
        assert kept_share(S, groups) > random_share

    def test_interaction_k_equals_f_and_one(self):
        S, _ = _planted([3, 3], 0)
        assert _canon(interaction_towers(S, np.ones(6), 6)) == [[i] for i in range(6)]
        assert interaction_towers(S, np.ones(6), 1) == [list(range(6))]

    def test_interaction_bad_inputs(self):
        with pytest.raises(ConfigError, match="strength"):
            interaction_towers(np.ones((4, 5)), np.ones(4), 2)
        with pytest.raises(ConfigError, match="costs"):
            interaction_towers(np.ones((4, 4)), np.array([1.0, 0.0, 1.0, 1.0]), 2)

    def test_interaction_scales(self):
        S, truth = _planted([50] * 8, 0, noise=0.5)
        groups = interaction_towers(S, np.ones(len(S)), 8)
        assert _canon(groups) == _canon(truth)
