"""The OpenAPI document, generated from the served model: each feature a documented, typed field
of a named instance, an example request, and the served model's name as the only valid one.

FastAPI's own document describes the generic request (any names); this one replaces the named
instance with the served version's features and is rebuilt when a new version is loaded.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from dlrm_core.schema import CategoricalFeature, DenseFeature, FeatureSpec

INT64 = {"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1}


def _value(feat: CategoricalFeature) -> dict[str, Any]:
    if feat.encoding == "hex":
        return {"anyOf": [{"type": "string", "pattern": "^[0-9a-fA-F]{0,16}$"}, {**INT64, "minimum": 0}]}
    if feat.encoding == "int":
        return {"anyOf": [{"type": "string", "pattern": "^ *-?[0-9]{1,18} *$"}, INT64]}
    return {"anyOf": [{"type": "string", "maxLength": 1024}, INT64]}


def feature_schema(feat: DenseFeature | CategoricalFeature) -> dict[str, Any]:
    """The JSON schema of one feature's value in a named instance."""
    column = feat.column if feat.column is not None else feat.name
    if isinstance(feat, DenseFeature):
        return {"anyOf": [{"type": "number"}, {"type": "null"}],
                "description": f"Dense feature (column {column!r}, {feat.transform}); null: missing.",
                "example": 1}
    one = _value(feat)
    bag = {"type": "array", "items": one, "maxItems": 1024}
    if feat.separator is not None:
        return {"anyOf": [bag, {"type": "string", "maxLength": 1024}, {"type": "null"}],
                "description": f"Multi-hot categorical (column {column!r}, table {feat.table!r}): a list, or "
                f"values separated by {feat.separator!r}; [], \"\" and null are an empty bag.",
                "example": ["a", "b"]}
    return {"anyOf": [*one["anyOf"], bag, {"type": "null"}],
            "description": f"Categorical (column {column!r}, {feat.encoding}, table {feat.table!r}); "
            "a list is a bag pooled as in training; null: missing.",
            "example": "68fd1e64" if feat.encoding == "hex" else 7 if feat.encoding == "int" else "abc"}


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


def model_openapi(app: FastAPI, spec: FeatureSpec | None, model_name: str) -> dict[str, Any]:
    """The app's OpenAPI document for the served model (``spec`` None: nothing served yet)."""
    doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
    for path, ops in doc.get("paths", {}).items():
        if "{name}" in path:
            for op in ops.values():
                for param in op.get("parameters", []):
                    if param.get("name") == "name":
                        param["schema"] = {"type": "string", "enum": [model_name], "title": "Name"}
    if spec is None:
        return doc
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    schemas["NamedInstance"] = named_instance_schema(spec)
    items = schemas["PredictRequest"]["properties"]["instances"]["items"]
    items["oneOf"] = [{"$ref": "#/components/schemas/NamedInstance"}, {"$ref": "#/components/schemas/PositionalInstance"}]
    predict = doc["paths"].get("/v1/models/{name}:predict", {}).get("post")
    if predict is not None:
        predict["requestBody"]["content"]["application/json"]["example"] = {
            "instances": [schemas["NamedInstance"]["example"]]}
    return doc


def install(app: FastAPI, model_name: str) -> None:
    """Serve the model-specific document at /openapi.json (rebuilt per served version)."""
    cache: dict[str | None, dict] = {}

    def openapi() -> dict[str, Any]:
        service = getattr(app.state, "service", None)
        model = service.model if service is not None else None
        key = model.version if model is not None else None
        if key not in cache:
            cache.clear()
            cache[key] = model_openapi(app, model.spec if model is not None else None, model_name)
        return cache[key]

    app.openapi = openapi
