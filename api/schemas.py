"""Request and response bodies of the serving API (pydantic), in the TF-Serving / KServe V1 style
(the Open Inference Protocol's are in ``api/v2/protocol.py``).

``POST /v1/models/{name}:predict`` (or ``/v1/models/{name}/versions/{v}:predict``) takes
``{"instances": [...]}``; an instance is either

* named by feature: ``{"site_id": "1fbe01fe", "hour": 14102100, "tags": ["a", "b"], "price": 3.5}``
  (absent names are missing values), or
* positional: ``{"dense": [numbers or null], "sparse": [values]}``, in the schema's order,

where a categorical value is a string, an integer (a ``hex`` feature's integer is the value of its
hex spelling, others' the value of their decimal spelling), a list of those or the file's
delimited string (a multi-hot bag; ``[]``, ``""`` and null are an empty bag) or null (missing).
Types are checked here; names, lengths and values against the served model's feature spec (the
OpenAPI schema at ``/docs`` lists the served model's features).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StringConstraints, Tag

MAX_BAG = 1024
MAX_FIELDS = 1024

MAX_VALUE_CHARS = 1024
Text = Annotated[str, StringConstraints(max_length=MAX_VALUE_CHARS)]
Int64 = Annotated[int, Field(ge=-(2**63), le=2**64 - 1, strict=True)]
Categorical = Text | Int64
SparseValue = Categorical | Annotated[list[Categorical], Field(max_length=MAX_BAG)] | None
DenseValue = Annotated[float, Field(allow_inf_nan=False, strict=True)] | None


class PositionalInstance(BaseModel):
    """One example as two arrays, in the feature spec's column order."""

    model_config = ConfigDict(extra="forbid")

    dense: Annotated[list[DenseValue], Field(max_length=MAX_FIELDS)]
    """The dense features in the schema's order (numbers or null)."""
    sparse: Annotated[list[SparseValue], Field(max_length=MAX_FIELDS)]
    """The categorical features in the schema's order."""


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
    model_config = ConfigDict(protected_namespaces=())

    predictions: list[float]
    """Click probability of each instance, in order."""
    model_version: str
    """The version that scored them."""
    model_generation: int = 0
    """Live updates that version had received when the request started (0: none; a live
    training run pushes rows and dense weights, each push one generation)."""


class ModelInfo(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    name: str
    model_version: str
    model_generation: int = 0
    """Live updates applied to the version so far."""
    store: str
    """The serving store, its password redacted."""
    versions: list[str]
    """Complete versions the store holds (oldest first): any can be pinned with
    ``/v1/models/{name}/versions/{v}:predict``."""
    published_at: float
    """Unix time the version was published."""
    step: int
    """Training step the version was published from."""
    row_dtype: str
    format: str
    """The input format the model was trained on (``:predict_tsv`` takes its lines)."""
    dense_features: list[str]
    sparse_features: list[str]
    features: list[dict[str, Any]]
    """Every feature as the schema declares it (column, kind, transform / encoding, table)."""
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
