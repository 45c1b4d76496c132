"""Input tensors -> model inputs, through the very columns V1 instances become
(``api/featurize.py``): the same values score the same in both protocols.

Every error is a 422 naming the field: ``inputs.<k>.name`` (unknown or repeated feature),
``inputs.<k>.datatype``, ``inputs.<k>.shape``, ``inputs.<k>.data[.<i>]``.
"""

from __future__ import annotations

import difflib
import math

from api.errors import InputError, clipped
from api.featurize import ModelInputs, columns_of, featurize_columns
from api.model import ServingModel
from api.v2.protocol import InferInput, TensorMetadata
from dlrm_core.schema import FeatureSpec

DENSE_TYPES = {"FP16", "FP32", "FP64", "INT32", "INT64"}
CATEGORICAL_TYPES = {"BYTES", "INT32", "INT64", "UINT32", "UINT64"}
FLOAT_MAX = {"FP16": 65504.0, "FP32": 3.4028234663852886e38, "FP64": 1.7976931348623157e308}
"""Largest finite value of each float datatype: a JSON value beyond its declared type is refused,
as the binary form cannot carry it."""
INT_RANGE = {
    "INT32": (-(2**31), 2**31 - 1),
    "INT64": (-(2**63), 2**63 - 1),
    "UINT32": (0, 2**32 - 1),
    "UINT64": (0, 2**64 - 1),
}


def input_metadata(spec: FeatureSpec) -> list[TensorMetadata]:
    """The model's inputs as the protocol's metadata: one per feature, its preferred datatype."""
    return [
        *(TensorMetadata(name=f.name, datatype="FP32", shape=[-1]) for f in spec.dense),
        *(TensorMetadata(name=f.name, datatype="BYTES", shape=[-1]) for f in spec.categorical),
    ]


def _flatten(data: list, shape: list[int], field: str) -> list:
    """Row-major values of a flat or nested ``data`` of ``shape`` ([N] or [N, 1])."""
    if len(shape) == 2 and shape[1] != 1:
        raise InputError(
            field.replace(".data", ".shape"),
            f"{shape}: a feature is [N] or [N, 1] (one value per example)",
        )
    if len(shape) == 2 and data and all(isinstance(v, list) for v in data):
        if any(len(v) != 1 for v in data):
            raise InputError(field, "nested rows must hold exactly one value each")
        data = [v[0] for v in data]
    if len(data) != shape[0]:
        raise InputError(field, f"{len(data)} values for shape {shape}")
    return data


def _dense_value(value, datatype: str, field: str):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InputError(field, f"{datatype} values are numbers (or null: missing)")
    if datatype.startswith("INT"):
        if not isinstance(value, int):
            raise InputError(field, f"{datatype} values are integers")
        lo, hi = INT_RANGE[datatype]
        if not lo <= value <= hi:
            raise InputError(field, f"{value} is out of the {datatype} range")
    elif not math.isfinite(value):
        raise InputError(field, "not a finite number")
    elif abs(value) > FLOAT_MAX[datatype]:
        raise InputError(field, f"{value:g} is out of the {datatype} range")
    return value


def _categorical_value(value, datatype: str, field: str):
    if value is None:
        return None
    if datatype == "BYTES":
        if isinstance(value, bytes):
            try:
                return value.decode()
            except UnicodeDecodeError:
                raise InputError(field, "BYTES values must be UTF-8") from None
        if not isinstance(value, str):
            raise InputError(
                field, "BYTES values are strings (a multi-hot bag: values joined by the separator)"
            )
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(field, f"{datatype} values are integers")
    lo, hi = INT_RANGE[datatype]
    if not lo <= value <= hi:
        raise InputError(field, f"{value} is out of the {datatype} range")
    return value


def _check_input(k: int, tensor: InferInput, kind: str, values: list | None) -> list:
    accepted = DENSE_TYPES if kind == "dense" else CATEGORICAL_TYPES
    if tensor.datatype not in accepted:
        raise InputError(
            f"inputs.{k}.datatype",
            f"{tensor.datatype} for {kind} feature {tensor.name!r}; use one of {sorted(accepted)}",
        )
    if values is None:
        raise InputError(
            f"inputs.{k}.data", "missing (give data, or binary_data_size with the binary extension)"
        )
    flat = _flatten(values, tensor.shape, f"inputs.{k}.data")
    convert = _dense_value if kind == "dense" else _categorical_value
    return [convert(v, tensor.datatype, f"inputs.{k}.data.{i}") for i, v in enumerate(flat)]


def _unknown(name: str, spec: FeatureSpec) -> str:
    names = [*spec.dense_names, *spec.sparse_names]
    close = difflib.get_close_matches(name, names, n=1)
    return f"unknown feature {clipped(name)}" + (f" (did you mean {close[0]!r}?)" if close else "")


def tensors_to_inputs(
    model: ServingModel, inputs: list[InferInput], values: list[list | None], max_examples: int
) -> tuple[ModelInputs, int]:
    """Input tensors (``values[k]``: tensor k's data, decoded if binary) -> (model inputs, N)."""
    spec = model.spec
    where = {f.name: ("dense", j) for j, f in enumerate(spec.dense)}
    where.update({f.name: ("categorical", j) for j, f in enumerate(spec.categorical)})
    dense: list[list | None] = [None] * len(spec.dense)
    cats: list[list | None] = [None] * len(spec.categorical)
    position: dict[str, int] = {}
    n = None
    for k, tensor in enumerate(inputs):
        if tensor.name not in where:
            raise InputError(f"inputs.{k}.name", _unknown(tensor.name, spec))
        if tensor.name in position:
            raise InputError(f"inputs.{k}.name", f"feature {tensor.name!r} is given twice")
        if n is not None and tensor.shape[0] != n:
            raise InputError(
                f"inputs.{k}.shape", f"{tensor.shape[0]} examples, but inputs.0 has {n}"
            )
        n = tensor.shape[0]
        if n == 0:
            raise InputError(f"inputs.{k}.shape", "at least one example")
        if n > max_examples:
            raise InputError(
                f"inputs.{k}.shape", f"{n} examples, at most {max_examples} per request"
            )
        kind, j = where[tensor.name]
        position[tensor.name] = k
        (dense if kind == "dense" else cats)[j] = _check_input(k, tensor, kind, values[k])
    assert n is not None  # the request has at least one input
    dense_cols = [col if col is not None else [None] * n for col in dense]
    cat_cols = [col if col is not None else [None] * n for col in cats]
    fast = model.values(dense_cols, cat_cols, n)  # a few one-hot examples: the value path
    if fast is not None:
        return fast, n
    columns, any_bag = columns_of(spec, dense_cols, cat_cols)

    def field(i: int, feature: str | None) -> str:
        k = position.get(feature) if feature is not None else None
        return f"inputs.{k}.data.{i}" if k is not None else f"inputs (example {i})"

    return featurize_columns(model.featurizer, columns, any_bag, n, field), n
