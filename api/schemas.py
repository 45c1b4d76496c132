"""Request and response bodies of the serving API (pydantic), in the TF-Serving / KServe V1 style.

``POST /v1/models/{name}:predict`` takes ``{"instances": [...]}``; an instance is either

* positional: ``{"dense": [13 numbers or null], "sparse": [26 values]}``, or
* named: ``{"I1": 3, ..., "C1": "68fd1e64", ...}`` (absent names are missing values),

where a sparse value is a hex string (``"68fd1e64"``; ``""`` is missing), a non-negative integer
(the same value as its hex spelling), a list of those (a multi-hot bag) or null (missing).
Types are checked here; lengths and names are checked against the served model's feature spec.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StringConstraints, Tag

MAX_BAG = 1024
MAX_FIELDS = 1024

HexString = Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{0,16}$")]
UInt64 = Annotated[int, Field(ge=0, le=2**64 - 1, strict=True)]
Categorical = HexString | UInt64
SparseValue = Categorical | Annotated[list[Categorical], Field(max_length=MAX_BAG)] | None
DenseValue = Annotated[float, Field(allow_inf_nan=False, strict=True)] | None


class PositionalInstance(BaseModel):
    """One example as two arrays, in the feature spec's column order."""

    model_config = ConfigDict(extra="forbid")

    dense: Annotated[list[DenseValue], Field(max_length=MAX_FIELDS)]
    """The integer features I1..I13 (numbers or null)."""
    sparse: Annotated[list[SparseValue], Field(max_length=MAX_FIELDS)]
    """The categorical features C1..C26."""


NamedInstance = Annotated[
    dict[Annotated[str, StringConstraints(max_length=64)], DenseValue | SparseValue],
    Field(max_length=MAX_FIELDS),
]


def _instance_kind(value: Any) -> str:
    if isinstance(value, dict) and ("dense" in value or "sparse" in value):
        return "positional"
    return "named"


Instance = Annotated[
    Annotated[PositionalInstance, Tag("positional")] | Annotated[NamedInstance, Tag("named")],
    Discriminator(_instance_kind),
]


class PredictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    instances: Annotated[list[Instance], Field(min_length=1)]
    """The examples to score (at most the server's max_instances, 4096 by default)."""


class PredictResponse(BaseModel):
    predictions: list[float]
    """Click probability of each instance, in order."""
    model_version: str
    """The version that scored them."""


class ModelInfo(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    name: str
    model_version: str
    published_at: float
    """Unix time the version was published."""
    step: int
    """Training step the version was published from."""
    row_dtype: str
    dense_features: list[str]
    sparse_features: list[str]
    tables: list[dict[str, Any]]
    """rows, dim and pooling of each table."""
    model: dict[str, Any]
    """The dense network's configuration."""


class ErrorBody(BaseModel):
    error: str
    """What is wrong, naming the field where there is one."""
    field: str | None = None
    """Dotted path of the offending field (e.g. ``instances.3.sparse.5``)."""
    detail: Any = None
