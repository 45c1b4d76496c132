"""Bodies of the Open Inference Protocol (REST), as its specification defines them.

``POST /v2/models/{name}[/versions/{v}]/infer`` takes one input tensor per feature, named as the
feature, of shape ``[N]`` or ``[N, 1]`` (flat or nested data, row-major); features left out are
missing for every example, as is a ``null`` element. Dense features are FP32, FP64, INT32 or
INT64; categoricals BYTES (strings; a multi-hot feature's values joined by its separator) or
INT32 / INT64 / UINT32 / UINT64 (a ``hex`` feature's integer is the value of its hex spelling, as
in V1). The answer is one output, ``predictions``: FP32, shape ``[N]``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from api.schemas import MAX_FIELDS

Datatype = Literal[
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BF16",
    "BYTES",
]
OUTPUT = "predictions"
"""The one output tensor: click probabilities, FP32 [N]."""

Name = Annotated[str, StringConstraints(max_length=64)]
KNOWN_PARAMETERS = {"binary_data_size": int, "binary_data": bool, "binary_data_output": bool}
"""The parameters this server acts on and the JSON type each must have (no coercion: the string
``"false"`` is not false); others are free-form, as the protocol allows."""


def _strict(parameters: dict[str, Any]) -> dict[str, Any]:
    for key, kind in KNOWN_PARAMETERS.items():
        if key in parameters:
            value = parameters[key]
            if kind is bool and not isinstance(value, bool):
                raise ValueError(f"{key} must be true or false (a JSON boolean)")
            if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{key} must be a non-negative integer")
    return parameters


Parameters = Annotated[dict[Name, Any], Field(max_length=32), AfterValidator(_strict)]


class InferInput(BaseModel):
    """One input tensor: a feature's values for every example."""

    model_config = ConfigDict(extra="forbid")

    name: Name
    """The feature's name."""
    shape: Annotated[
        list[Annotated[int, Field(ge=0, le=2**31, strict=True)]], Field(min_length=1, max_length=2)
    ]
    """``[N]`` or ``[N, 1]``."""
    datatype: Datatype
    """FP32, FP64, INT32, INT64 (dense); BYTES, INT32, INT64, UINT32, UINT64 (categorical)."""
    parameters: Parameters | None = None
    """``binary_data_size``: the tensor's bytes follow the JSON header (binary extension)."""
    data: list[Any] | None = None
    """The values, row-major, flat or nested; ``null``: missing."""


class RequestedOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    """``predictions``."""
    parameters: Parameters | None = None
    """``binary_data``: return this output as raw bytes after the JSON header."""


class InferRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: Annotated[str, StringConstraints(max_length=256)] | None = None
    """Echoed in the response."""
    parameters: Parameters | None = None
    """``binary_data_output``: every output as raw bytes (binary extension)."""
    inputs: Annotated[list[InferInput], Field(min_length=1, max_length=MAX_FIELDS)]
    """One tensor per feature (left-out features are missing)."""
    outputs: Annotated[list[RequestedOutput], Field(max_length=4)] | None = None
    """Outputs wanted (default: all, i.e. ``predictions``)."""


class InferOutput(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: list[float] | None = None


class InferResponse(BaseModel):
    model_config = ConfigDict(protected_namespaces=())

    model_name: str
    model_version: str
    """The version that scored the request."""
    id: str | None = None
    parameters: dict[str, Any] | None = None
    """``model_generation``: live updates that version had received when the request started."""
    outputs: list[InferOutput]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    """Versions the store holds (each can be pinned with ``/versions/{v}``)."""
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]
