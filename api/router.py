"""HTTP endpoints of the V1 protocol (KServe V1 / TF-Serving style) and the server's own routes
(health, readiness, metrics): parse, call the service, shape the response. The Open Inference
Protocol's endpoints are in ``api/v2/router.py``; authentication is a middleware
(``api/auth.py``); errors are mapped in one place (``api/errors.py``)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from api.errors import NotReady
from api.schemas import ErrorBody, ModelInfo, PredictResponse
from api.scoring import ScoringRoute, ServiceDep
from api.service import ModelService, Pending, Scored

ERRORS = {
    401: {"model": ErrorBody, "description": "Missing or wrong bearer API key"},
    404: {
        "model": ErrorBody,
        "description": "Unknown model name, or a version the store does not hold",
    },
    413: {
        "model": ErrorBody,
        "description": "Request body, batch or ids over a cap (the error names it)",
    },
    422: {"model": ErrorBody, "description": "Invalid request: the error names the field"},
    503: {
        "model": ErrorBody,
        "description": "No model loaded, or the store is unavailable (see Retry-After)",
    },
}
JSON_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/PredictRequest"}}
        },
    }
}
"""The body is read raw and decoded off the event loop (``api/decode.py``), so it is declared
here."""
TSV_BODY = {
    "requestBody": {
        "required": True,
        "content": {"text/plain": {"schema": {"type": "string"}}},
        "description": "One example per line, in the layout of the model's training files (TSV for "
        "Criteo, CSV lines for a CSV model, without the header), with or without the label column; "
        "empty = missing.",
    }
}


def _response(scored: Scored) -> PredictResponse:
    return PredictResponse(
        predictions=scored.predictions,
        model_version=scored.version,
        model_generation=scored.generation,
    )


router = APIRouter()
models = APIRouter(prefix="/v1/models", responses=ERRORS, tags=["V1 (KServe V1)"])


@models.get("", summary="The served models")
def list_models(service: ServiceDep) -> dict:
    return {"models": [service.settings.model_name]}


def _json(_: Pending, scored: Scored) -> Response:
    """The answer rendered here, in the request's worker thread (not on the event loop)."""
    return Response(_response(scored).model_dump_json().encode(), media_type="application/json")


SCORING = [
    ScoringRoute(
        "/v1/models/{name}",
        ":predict",
        "predict",
        lambda service, name, version, body, _: service.prepare_json(name, body, version),
        _json,
        "Score instances (the current version)",
        "Score instances with a pinned version",
        JSON_BODY,
        PredictResponse,
    ),
    ScoringRoute(
        "/v1/models/{name}",
        ":predict_tsv",
        "predict_tsv",
        lambda service, name, version, body, _: service.prepare_tsv(name, body, version),
        _json,
        "Score lines in the model's input format",
        "Score lines with a pinned version",
        TSV_BODY,
        PredictResponse,
    ),
]
"""The V1 scoring routes (``api/scoring.py`` derives their endpoints, fast path and staged
split)."""
for _route in SCORING:
    _route.register(models)


def _info(service: ModelService, name: str, version: str | None) -> ModelInfo:
    model = service.resolve(name, version)
    meta = model.meta
    return ModelInfo(
        name=name,
        model_version=meta.version,
        model_generation=model.generation,
        store=service.store.url,
        versions=service.store.list_versions(),
        published_at=meta.created_at,
        step=meta.step,
        row_dtype=meta.row_dtype,
        format=meta.spec.format,
        dense_features=meta.spec.dense_names,
        sparse_features=meta.spec.sparse_names,
        features=[
            f.model_dump(exclude_none=True) for f in [*meta.spec.dense, *meta.spec.categorical]
        ],
        tables=[t.model_dump() for t in meta.spec.tables],
        model=meta.model,
    )


@models.get("/{name}", response_model=ModelInfo, summary="The served version and its feature spec")
def model_info(name: str, service: ServiceDep) -> ModelInfo:
    return _info(service, name, None)


@models.get(
    "/{name}/versions/{version}",
    response_model=ModelInfo,
    summary="A pinned version and its feature spec",
)
def version_info(name: str, version: str, service: ServiceDep) -> ModelInfo:
    return _info(service, name, version)


@router.get("/healthz", summary="Liveness: the process answers", tags=["health"])
# on the event loop itself: no thread hop, answers while requests are scored
async def healthz() -> dict:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="Readiness: every worker has a model loaded",
    responses={503: ERRORS[503]},
    tags=["health"],
)
async def readyz(request: Request) -> dict:  # on the loop: a cached answer (api/probes.py)
    status, body, reason = request.app.state.probes.readiness()
    if status != 200:
        raise NotReady(reason)
    return body


@router.get(
    "/metrics",
    summary="Prometheus metrics (every worker)",
    response_class=PlainTextResponse,
    tags=["metrics"],
)
def metrics(service: ServiceDep) -> Response:
    return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)


router.include_router(models)
