"""Errors of the serving API and their mapping to HTTP, in one place.

Every error a client can cause is a 4xx JSON body ``{"error": ..., "field": ...}`` naming the
field; an unavailable store is a 503 with Retry-After; nothing from a request is ever evaluated.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dlrm_core.errors import DlrmError
from embedding_server.stores import StoreUnavailable

log = logging.getLogger(__name__)


class InputError(ValueError):
    """A request that is well-typed but wrong for this model (the API answers 422)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class NotReady(RuntimeError):
    """No model is loaded yet (nothing published, or the store unreachable at start)."""


class ModelNotFound(LookupError):
    """The request names a model this server does not serve (404)."""


class Unauthorized(PermissionError):
    """Missing or wrong bearer key (401)."""


def error_response(status: int, message: str, field: str | None = None, detail=None, headers=None) -> JSONResponse:
    body = {"error": message, "field": field}
    if detail is not None:
        body["detail"] = detail
    return JSONResponse(body, status_code=status, headers=headers)


def _loc(loc) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    # Drop the union tags pydantic adds ("positional", "named", "constrained-str", ...).
    return ".".join(p for p in parts if not p.startswith(("positional", "named", "constrained", "list[", "int", "str")))


def register_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    """Map every error to its HTTP answer."""
    retry = {"Retry-After": str(retry_after_s)}

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        field = "body" if first.get("type") == "json_invalid" else (_loc(first.get("loc", ())) or "body")
        # Never echo the input back (it may be huge, or NaN, which JSON cannot carry).
        detail = [
            {"field": _loc(e.get("loc", ())) or "body", "msg": str(e.get("msg")), "type": str(e.get("type"))}
            for e in errors[:20]
        ]
        return error_response(422, f"{field}: {first.get('msg')}", field, detail)

    @app.exception_handler(InputError)
    async def on_input(request: Request, exc: InputError):
        return error_response(422, str(exc), exc.field)

    @app.exception_handler(ModelNotFound)
    async def on_not_found(request: Request, exc: ModelNotFound):
        return error_response(404, str(exc), "name")

    @app.exception_handler(Unauthorized)
    async def on_unauthorized(request: Request, exc: Unauthorized):
        return error_response(401, str(exc), "Authorization", headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(NotReady)
    async def on_not_ready(request: Request, exc: NotReady):
        return error_response(503, str(exc), headers=retry)

    @app.exception_handler(StoreUnavailable)
    async def on_store(request: Request, exc: StoreUnavailable):
        service = getattr(request.app.state, "service", None)
        if service is not None:
            service.metrics.store_errors.labels(operation="lookup").inc()
        return error_response(503, "embedding store unavailable, retry later", headers=retry)

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        field = "body" if exc.status_code == 413 else None
        return error_response(exc.status_code, str(exc.detail), field, headers=getattr(exc, "headers", None))

    @app.exception_handler(DlrmError)
    async def on_dlrm(request: Request, exc: DlrmError):
        log.error("serving error: %s", exc)
        return error_response(503, str(exc), headers=retry)
