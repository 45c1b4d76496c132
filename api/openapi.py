"""The OpenAPI document, generated from the served model: each feature a documented, typed field
of a named instance (V1) and a typed input tensor (V2), the pattern of a valid line, an example
request, the served model's name and the stored versions as the only valid ones, and the bearer
security scheme when keys are required.

FastAPI's own document describes the generic request (any names); this one replaces the named
instance with the served version's features and is rebuilt when a new version is loaded.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from dlrm_core.schema import CategoricalFeature, DenseFeature, FeatureSpec

INT64 = {"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1}


def _value(feat: CategoricalFeature) -> dict[str, Any]:
    if feat.encoding == "hex":
        return {
            "anyOf": [{"type": "string", "pattern": "^[0-9a-fA-F]{0,16}$"}, {**INT64, "minimum": 0}]
        }
    if feat.encoding == "int":
        return {"anyOf": [{"type": "string", "pattern": "^ *-?[0-9]{1,18} *$"}, INT64]}
    return {"anyOf": [{"type": "string", "maxLength": 1024}, INT64]}


def feature_schema(feat: DenseFeature | CategoricalFeature) -> dict[str, Any]:
    """The JSON schema of one feature's value in a named instance."""
    column = feat.column if feat.column is not None else feat.name
    if isinstance(feat, DenseFeature):
        return {
            "anyOf": [{"type": "number"}, {"type": "null"}],
            "description": f"Dense feature (column {column!r}, {feat.transform}); null: missing.",
            "example": 1,
        }
    one = _value(feat)
    bag = {"type": "array", "items": one, "maxItems": 1024}
    if feat.separator is not None:
        return {
            "anyOf": [bag, {"type": "string", "maxLength": 1024}, {"type": "null"}],
            "description": f"Multi-hot categorical (column {column!r}, table {feat.table!r}): a "
            "list, or "
            f'values separated by {feat.separator!r}; [], "" and null are an empty bag.',
            "example": ["a", "b"],
        }
    return {
        "anyOf": [*one["anyOf"], bag, {"type": "null"}],
        "description": f"Categorical (column {column!r}, {feat.encoding}, table {feat.table!r}); "
        "a list is a bag pooled as in training; null: missing.",
        "example": "68fd1e64" if feat.encoding == "hex" else 7 if feat.encoding == "int" else "abc",
    }


def named_instance_schema(spec: FeatureSpec) -> dict[str, Any]:
    features = [*spec.dense, *spec.categorical]
    return {
        "type": "object",
        "title": "NamedInstance",
        "description": "One example named by feature; absent features are missing.",
        "properties": {f.name: feature_schema(f) for f in features},
        "additionalProperties": False,
        "example": {f.name: feature_schema(f)["example"] for f in features[:6]},
    }


def line_pattern(spec: FeatureSpec) -> str | None:
    """A regular expression of up to 4 valid lines in the model's input layout (with or without
    the label column), so that the document says what a line looks like and fuzzers write some."""
    if not spec.columns:
        return None
    dense = {f.column if f.column is not None else f.name: f for f in spec.dense}
    cats = {f.column if f.column is not None else f.name: f for f in spec.categorical}

    def cell(column: str) -> str:
        if column in dense:
            return (
                "(?:-?[0-9]{1,4})?"
                if dense[column].integer
                else r"(?:-?[0-9]{1,4}(?:\.[0-9]{1,3})?)?"
            )
        feat = cats.get(column)
        one = (
            "[0-9a-f]{1,8}"
            if feat and feat.encoding == "hex"
            else "-?[0-9]{1,6}"
            if feat and feat.encoding == "int"
            else "[A-Za-z0-9_]{1,8}"
        )
        if feat is not None and feat.separator is not None:
            sep = re.escape(feat.separator)
            return f"(?:{one}(?:{sep}{one}){{0,3}})?"
        return f"(?:{one})?"

    delim = re.escape(spec.delimiter)
    label = spec.label if isinstance(spec.label, str) else spec.columns[spec.label]
    with_label = delim.join("[01]" if c == label else cell(c) for c in spec.columns)
    without = delim.join(cell(c) for c in spec.columns if c != label)
    line = f"(?:{with_label}|{without})"
    return f"^{line}(?:\\n{line}){{0,3}}\\n?$"


def tensor_schema(feat: DenseFeature | CategoricalFeature) -> dict[str, Any]:
    """The JSON schema of one feature's input tensor in an infer request: one variant per
    accepted datatype, its elements typed accordingly (null: missing)."""
    null = {"type": "null"}
    if isinstance(feat, DenseFeature):
        number = {"type": "integer"} if feat.integer else {"type": "number"}
        variants = {"FP32": number, "FP64": number, "INT64": {**INT64, "maximum": 2**63 - 1}}
        what = f"Dense feature ({feat.transform})"
    else:
        text = next(a for a in _value(feat)["anyOf"] if a["type"] == "string")
        if feat.separator is not None:
            text = {"type": "string", "maxLength": 1024}
        variants = {"BYTES": text, "INT64": {**INT64, "minimum": 0, "maximum": 2**63 - 1}}
        what = f"Categorical ({feat.encoding}, table {feat.table!r}" + (
            f"; multi-hot: values joined by {feat.separator!r})" if feat.separator else ")"
        )
    return {
        "title": f"Input {feat.name}",
        "description": f"{what}: one value per example ([N] or [N, 1]); null or absent: missing.",
        "anyOf": [
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "shape", "datatype", "data"],
                "properties": {
                    "name": {"type": "string", "enum": [feat.name]},
                    "shape": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0, "maximum": 2**31},
                        "minItems": 1,
                        "maxItems": 2,
                    },
                    "datatype": {"type": "string", "enum": [datatype]},
                    "data": {"type": "array", "items": {"anyOf": [item, null]}},
                },
            }
            for datatype, item in variants.items()
        ],
    }


def _v2_schemas(schemas: dict[str, Any], spec: FeatureSpec | None) -> None:
    from api.v2.protocol import InferRequest

    doc = InferRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(doc.pop("$defs", {}))
    schemas["InferRequest"] = doc
    if spec is not None:
        doc["properties"]["inputs"]["items"] = {
            "anyOf": [tensor_schema(f) for f in [*spec.dense, *spec.categorical]]
        }


def _v1_schemas(schemas: dict[str, Any]) -> None:
    """The predict body (the routes read it raw, so FastAPI does not document it by itself)."""
    from api.schemas import PredictRequest

    doc = PredictRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(doc.pop("$defs", {}))
    schemas["PredictRequest"] = doc


def _secure(doc: dict[str, Any]) -> None:
    from api.auth import OPEN_PATHS

    doc.setdefault("components", {})["securitySchemes"] = {
        "bearerAuth": {
            "type": "http",
            "scheme": "bearer",
            "description": "DLRM_API_KEY / DLRM_API_KEY_FILE; every route but the health probes",
        }
    }
    doc["security"] = [{"bearerAuth": []}]
    for path, ops in doc.get("paths", {}).items():
        for op in ops.values():
            if path in OPEN_PATHS:
                op["security"] = []
            else:
                op.setdefault("responses", {}).setdefault(
                    "401",
                    {
                        "description": "Missing or wrong bearer API key",
                        "content": {
                            "application/json": {
                                "schema": {"$ref": "#/components/schemas/ErrorBody"}
                            }
                        },
                    },
                )


def model_openapi(
    app: FastAPI,
    spec: FeatureSpec | None,
    model_name: str,
    versions: list[str] | None = None,
    secured: bool = False,
) -> dict[str, Any]:
    """The app's OpenAPI document for the served model (``spec`` None: nothing served yet):
    names and versions as enums, each feature a typed field (V1) and a typed tensor (V2)."""
    doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    enums = {"name": [model_name], "version": versions or None}
    for ops in doc.get("paths", {}).values():
        for op in ops.values():
            for param in op.get("parameters", []):
                if enums.get(param.get("name")):
                    param["schema"] = {
                        "type": "string",
                        "enum": enums[param["name"]],
                        "title": param["name"].title(),
                    }
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    _v1_schemas(schemas)
    _v2_schemas(schemas, spec)
    if secured:
        _secure(doc)
    if spec is None:
        return doc
    schemas["NamedInstance"] = named_instance_schema(spec)
    items = schemas["PredictRequest"]["properties"]["instances"]["items"]
    items["oneOf"] = [
        {"$ref": "#/components/schemas/NamedInstance"},
        {"$ref": "#/components/schemas/PositionalInstance"},
    ]
    pattern = line_pattern(spec)
    for path, ops in doc["paths"].items():
        if path.endswith(":predict") and "post" in ops:
            ops["post"]["requestBody"]["content"]["application/json"]["example"] = {
                "instances": [schemas["NamedInstance"]["example"]]
            }
        if path.endswith(":predict_tsv") and "post" in ops and pattern:
            ops["post"]["requestBody"]["content"]["text/plain"]["schema"]["pattern"] = pattern
    return doc


def route_table(app: FastAPI) -> list[tuple[str, str]]:
    """(path template, method) of every route, the documentation's own included."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    table = [(path, method.upper()) for path, ops in doc.get("paths", {}).items() for method in ops]
    from api.docs import OPEN_PAGES

    return table + [(path, "GET") for path in [app.openapi_url, *sorted(OPEN_PAGES)] if path]


def install(app: FastAPI, model_name: str, secured: bool = False) -> None:
    """Serve the model-specific document at /openapi.json (rebuilt per served version and set
    of stored versions)."""
    cache: dict[tuple, dict] = {}

    def openapi() -> dict[str, Any]:
        service = getattr(app.state, "service", None)
        model = service.model if service is not None else None
        try:
            versions = service.store.list_versions() if service is not None else []
        except Exception:  # the store is down: document without the version list
            versions = []
        key = (model.version if model is not None else None, tuple(versions))
        if key not in cache:
            cache.clear()
            cache[key] = model_openapi(
                app, model.spec if model is not None else None, model_name, versions, secured
            )
        return cache[key]

    app.openapi = openapi
