"""Tower plans: the sparse features grouped into K towers (Disaggregated Multi-Tower, MLSys 2024).

DMT splits the sparse features into K towers. Each tower is a small module that sees only its
own features' pooled embeddings and emits ``c_t`` vectors (``c_t < F_t`` compresses the tower,
``c_t = F_t`` is the identity); the dense side's interaction arch then works on
``sum_t c_t`` vectors instead of ``F``.

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
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from dlrm_core.errors import ConfigError
from dlrm_core.schema import FeatureSpec


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
        """Check that the plan partitions exactly the categorical features of ``spec``, and that
        features sharing a table share a tower.

        Args:
            spec: the model's feature spec.

        Returns:
            self, so that ``plan = TowerPlan.load(p).validate_for(spec)`` reads naturally.

        Raises:
            ConfigError: naming the unknown, duplicated or missing feature, the empty tower, or
                the tower whose ``compress`` is outside ``[1, F_t]``.
        """
        known = set(spec.sparse_names)
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
        tower_of_table: dict[str, tuple[int, str]] = {}
        for feat in spec.categorical:
            if feat.name in seen:
                first = tower_of_table.setdefault(feat.table, (seen[feat.name], feat.name))
                if first[0] != seen[feat.name]:
                    raise ConfigError(
                        f"features {first[1]!r} and {feat.name!r} share table {feat.table!r}: "
                        f"put them in the same tower (they are in towers {first[0]} and "
                        f"{seen[feat.name]})"
                    )
        missing = [n for n in spec.sparse_names if n not in seen]
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
            A permutation of ``range(len(spec.categorical))``.
        """
        self.validate_for(spec)
        index = {name: i for i, name in enumerate(spec.sparse_names)}
        return [index[name] for tower in self.towers for name in tower.features]

    def tower_of(self, spec: FeatureSpec) -> list[int]:
        """Each table's tower.

        Args:
            spec: the model's feature spec (the plan is validated against it).

        Returns:
            ``out[i]`` is the tower of ``spec.categorical[i]``.
        """
        self.validate_for(spec)
        tower = {name: t for t, tw in enumerate(self.towers) for name in tw.features}
        return [tower[name] for name in spec.sparse_names]

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
