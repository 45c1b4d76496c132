"""HTTP endpoints only: parse, call the service, shape the response. Errors are mapped to HTTP
in one place, ``api/app.py``."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from api.errors import NotReady, Unauthorized
from api.schemas import ErrorBody, ModelInfo, PredictRequest, PredictResponse
from api.service import ModelService

ERRORS = {
    401: {"model": ErrorBody, "description": "Missing or wrong bearer API key"},
    404: {"model": ErrorBody, "description": "Unknown model name"},
    413: {"model": ErrorBody, "description": "Request body or batch too large"},
    422: {"model": ErrorBody, "description": "Invalid request: the error names the field"},
    503: {"model": ErrorBody, "description": "No model loaded, or the store is unavailable (see Retry-After)"},
}


def get_service(request: Request) -> ModelService:
    return request.app.state.service


def require_api_key(request: Request) -> None:
    expected = request.app.state.api_key
    if expected is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected.encode()):
        raise Unauthorized("missing or wrong bearer API key")


ServiceDep = Annotated[ModelService, Depends(get_service)]


router = APIRouter()
models = APIRouter(prefix="/v1/models", dependencies=[Depends(require_api_key)], responses=ERRORS)


@models.post("/{name}:predict", response_model=PredictResponse, summary="Score instances")
def predict(name: str, body: PredictRequest, service: ServiceDep) -> PredictResponse:
    predictions, version = service.predict(name, body.instances)
    return PredictResponse(predictions=predictions, model_version=version)


@models.post(
    "/{name}:predict_tsv",
    response_model=PredictResponse,
    summary="Score lines in the model's input format",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"text/plain": {"schema": {"type": "string"}}},
            "description": "One example per line, in the layout of the model's training files (TSV for "
            "Criteo, CSV lines for a CSV model, without the header), with or without the label column; "
            "empty = missing.",
        }
    },
)
async def predict_tsv(name: str, request: Request, service: ServiceDep) -> PredictResponse:
    text = await request.body()
    predictions, version = await run_in_threadpool(service.predict_tsv, name, text)  # off the event loop
    return PredictResponse(predictions=predictions, model_version=version)


@models.get("/{name}", response_model=ModelInfo, summary="The served version and its feature spec")
def model_info(name: str, service: ServiceDep) -> ModelInfo:
    service.check_name(name)
    model = service.current()
    meta = model.meta
    return ModelInfo(
        name=name, model_version=meta.version, published_at=meta.created_at, step=meta.step,
        row_dtype=meta.row_dtype, format=meta.spec.format, dense_features=meta.spec.dense_names,
        sparse_features=meta.spec.sparse_names,
        features=[f.model_dump(exclude_none=True) for f in [*meta.spec.dense, *meta.spec.categorical]],
        tables=[t.model_dump() for t in meta.spec.tables], model=meta.model,
    )


@router.get("/healthz", summary="Liveness: the process answers")
def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: a model is loaded", responses={503: ERRORS[503]})
def readyz(service: ServiceDep) -> dict:
    model = service.model
    if model is None:
        raise NotReady("no model loaded yet")
    return {"status": "ready", "model_version": model.version}


@router.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
def metrics(service: ServiceDep) -> Response:
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)


router.include_router(models)
