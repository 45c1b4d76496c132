"""HTTP endpoints of the Open Inference Protocol: parse, call the service, shape the response.

The infer body is read here (not by FastAPI) because the binary extension sends JSON followed by
raw bytes; the JSON part is validated by the same pydantic model either way.
"""

from __future__ import annotations

from importlib import metadata as package_metadata

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers

from api.decode import infer_request
from api.errors import InputError, NotReady
from api.router import ERRORS
from api.scoring import ScoringRoute, ServiceDep
from api.service import ModelService, Pending, Scored
from api.v2 import binary
from api.v2.protocol import (
    OUTPUT,
    InferOutput,
    InferRequest,
    InferResponse,
    ModelMetadata,
    ServerMetadata,
    TensorMetadata,
)
from api.v2.tensors import input_metadata, tensors_to_inputs

router = APIRouter(prefix="/v2", responses=ERRORS, tags=["V2 (Open Inference Protocol)"])
INFER_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/InferRequest"}},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
        "description": "An inference request; with the binary extension, its JSON (of "
        "Inference-Header-Content-Length bytes) followed by the tensors' raw bytes.",
    }
}


def _version() -> str:
    try:
        return package_metadata.version("dlrm-disagg")
    except package_metadata.PackageNotFoundError:
        return "0.1.0"


@router.get("", response_model=ServerMetadata, summary="Server metadata")
def server_metadata() -> ServerMetadata:
    return ServerMetadata(name="dlrm-disagg", version=_version(), extensions=["binary_tensor_data"])


@router.get("/health/live", summary="Liveness (no key needed)", tags=["health"])
async def live() -> dict:  # on the event loop: answers while requests are scored
    return {"live": True}


@router.get(
    "/health/ready", summary="Readiness: every worker has a model (no key needed)", tags=["health"]
)
async def ready(request: Request) -> dict:  # on the loop: a cached answer (api/probes.py)
    status, _, reason = request.app.state.probes.readiness()
    if status != 200:
        raise NotReady(reason)
    return {"ready": True}


def _metadata(service: ModelService, name: str, version: str | None) -> ModelMetadata:
    model = service.resolve(name, version)
    return ModelMetadata(
        name=name,
        versions=service.store.list_versions(),
        platform="pytorch_dlrm",
        inputs=input_metadata(model.spec),
        outputs=[TensorMetadata(name=OUTPUT, datatype="FP32", shape=[-1])],
    )


@router.get(
    "/models/{name}", response_model=ModelMetadata, summary="Model metadata: inputs and outputs"
)
def model_metadata(name: str, service: ServiceDep) -> ModelMetadata:
    return _metadata(service, name, None)


@router.get(
    "/models/{name}/versions/{version}",
    response_model=ModelMetadata,
    summary="A version's metadata",
)
def version_metadata(name: str, version: str, service: ServiceDep) -> ModelMetadata:
    return _metadata(service, name, version)


@router.get("/models/{name}/ready", summary="Whether the model is ready")
def model_ready(name: str, service: ServiceDep) -> dict:
    service.resolve(name)
    return {"name": name, "ready": True}


@router.get(
    "/models/{name}/versions/{version}/ready", summary="Whether a version is ready (loads it)"
)
def version_ready(name: str, version: str, service: ServiceDep) -> dict:
    service.resolve(name, version)
    return {"name": name, "version": version, "ready": True}


def _parse(body: bytes, header_length: str | None) -> tuple[InferRequest, list[list | None]]:
    head, raw = binary.split(body, header_length) if header_length is not None else (body, b"")
    request = infer_request(head)  # one tensor at a time: never a long hold of the GIL
    for k, out in enumerate(request.outputs or []):
        if out.name != OUTPUT:
            raise InputError(
                f"outputs.{k}.name", f"unknown output {out.name!r}: the model has one, {OUTPUT!r}"
            )
    return request, binary.decode(request.inputs, raw)


def _prepare(
    service: ModelService, name: str, version: str | None, body: bytes, headers: Headers
) -> Pending:
    """An infer request parsed and featurised, before its model call."""
    model = service.resolve(name, version)
    request, values = _parse(body, headers.get(binary.HEADER))
    inputs, _ = tensors_to_inputs(model, request.inputs, values, service.settings.max_instances)
    return service.prepared(Pending(model, inputs, "tensors", (name, request)))


def _render(pending: Pending, scored: Scored) -> Response:
    name, request = pending.context
    n = len(scored.predictions)
    asked = (request.outputs or [None])[0]
    as_binary = binary.wants_binary(request.parameters, asked.parameters if asked else None)
    output = InferOutput(
        name=OUTPUT,
        shape=[n],
        datatype="FP32",
        parameters={"binary_data_size": 4 * n} if as_binary else None,
        data=None if as_binary else scored.predictions,
    )
    answer = InferResponse(
        model_name=name,
        model_version=scored.version,
        id=request.id,
        parameters={"model_generation": scored.generation},
        outputs=[output],
    )
    if not as_binary:
        return JSONResponse(answer.model_dump(exclude_none=True))
    head = answer.model_dump_json(exclude_none=True).encode()
    return Response(
        head + binary.encode(scored.predictions),
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(len(head))},
    )


INFER = ScoringRoute(
    "/v2/models/{name}",
    "/infer",
    "infer",
    _prepare,
    _render,
    "Score examples given as one tensor per feature",
    "Score examples with a pinned version",
    INFER_BODY,
    InferResponse,
)
"""The Open Inference Protocol's scoring route (``api/scoring.py`` derives its endpoints, fast
path and staged split)."""
SCORING = [INFER]
INFER.register(router)
