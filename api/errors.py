"""Errors of the serving API and their mapping to HTTP, in one place.

Each protocol answers in its own error shape: V1 (``/v1/...`` and the server's own routes)
``{"error": ..., "field": ...}`` naming the field; the Open Inference Protocol (``/v2/...``)
``{"error": ...}``, the field named at the start of the message. Every error a client can cause
is a 4xx; an unavailable store is a 503 with Retry-After; anything unexpected a JSON 500
carrying the request id (its traceback is logged under that id). Nothing from a request is ever
evaluated, nor echoed back.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dlrm_core.errors import DlrmError
from embedding_server.stores import StoreUnavailable, VersionNotFound

log = logging.getLogger(__name__)


ECHO_MAX = 64
"""Longest piece of a request (a path segment, a name) an error message repeats."""


def clipped(text: str) -> str:
    """``text`` quoted for an error message, cut to :data:`ECHO_MAX` characters (a 10,000
    character version name is not echoed whole)."""
    if len(text) <= ECHO_MAX:
        return repr(text)
    return f"{text[:ECHO_MAX]!r}... ({len(text):,} characters)"


class InputError(ValueError):
    """A request that is well-typed but wrong for this model (the API answers 422)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class TooLarge(ValueError):
    """A request over one of the server's size caps (413), naming the cap and its setting."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class NotReady(RuntimeError):
    """No model is loaded yet (nothing published, the store unreachable at start, or the served
    version vanished and the current one is loading): 503, retry."""


class ModelNotFound(LookupError):
    """The request names a model (field ``name``) or a version (``version``) not served (404)."""

    def __init__(self, message: str, field: str = "name") -> None:
        super().__init__(message)
        self.field = field


class Unauthorized(PermissionError):
    """Missing or wrong bearer key (401)."""


def protocol_of(path: str) -> str:
    """``v2`` for the Open Inference Protocol's routes, else ``v1``."""
    return "v2" if path == "/v2" or path.startswith("/v2/") else "v1"


def error_body(
    path: str, message: str, field: str | None = None, detail=None, request_id: str | None = None
) -> dict:
    """The error body of the protocol that ``path`` belongs to."""
    if protocol_of(path) == "v2":
        body: dict = {"error": message}
    else:
        body = {"error": message, "field": field}
        if detail is not None:
            body["detail"] = detail
    if request_id is not None:
        body["request_id"] = request_id
    return body


def error_response(
    status: int,
    message: str,
    field: str | None = None,
    detail=None,
    headers=None,
    path: str = "/v1",
) -> JSONResponse:
    return JSONResponse(
        error_body(path, message, field, detail), status_code=status, headers=headers
    )


def _loc(loc) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    # Drop the union tags pydantic adds ("positional", "named", "constrained-str", ...).
    return ".".join(
        p
        for p in parts
        if not p.startswith(("positional", "named", "constrained", "list[", "int", "str"))
    )


def register_error_handlers(app: FastAPI, retry_after_s: int) -> None:
    """Map every error to its HTTP answer, in the shape of the request's protocol."""
    retry = {"Retry-After": str(retry_after_s)}

    def respond(request: Request, status: int, message: str, field=None, detail=None, headers=None):
        return error_response(status, message, field, detail, headers, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        field = (
            "body"
            if first.get("type") == "json_invalid"
            else (_loc(first.get("loc", ())) or "body")
        )
        # Never echo the input back (it may be huge, or NaN, which JSON cannot carry).
        detail = [
            {
                "field": _loc(e.get("loc", ())) or "body",
                "msg": str(e.get("msg")),
                "type": str(e.get("type")),
            }
            for e in errors[:20]
        ]
        return respond(request, 422, f"{field}: {first.get('msg')}", field, detail)

    @app.exception_handler(InputError)
    async def on_input(request: Request, exc: InputError):
        return respond(request, 422, str(exc), exc.field)

    @app.exception_handler(TooLarge)
    async def on_too_large(request: Request, exc: TooLarge):
        return respond(request, 413, str(exc), exc.field)

    @app.exception_handler(ModelNotFound)
    async def on_not_found(request: Request, exc: ModelNotFound):
        return respond(request, 404, f"{exc.field}: {exc}", exc.field)

    @app.exception_handler(Unauthorized)
    async def on_unauthorized(request: Request, exc: Unauthorized):
        return respond(
            request, 401, str(exc), "Authorization", headers={"WWW-Authenticate": "Bearer"}
        )

    @app.exception_handler(NotReady)
    async def on_not_ready(request: Request, exc: NotReady):
        return respond(request, 503, str(exc), headers=retry)

    @app.exception_handler(StoreUnavailable)
    async def on_store(request: Request, exc: StoreUnavailable):
        service = getattr(request.app.state, "service", None)
        if service is not None:
            service.metrics.store_errors.labels(operation="lookup").inc()
        log.warning("store unavailable: %s", exc)  # the store's messages carry redacted URLs only
        return respond(request, 503, "embedding store unavailable, retry later", headers=retry)

    @app.exception_handler(VersionNotFound)
    async def on_version_gone(request: Request, exc: VersionNotFound):
        return respond(
            request,
            503,
            f"version {exc.version} left the store; loading the current one",
            headers=retry,
        )

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        field = "body" if exc.status_code == 413 else None
        return respond(
            request, exc.status_code, str(exc.detail), field, headers=getattr(exc, "headers", None)
        )

    @app.exception_handler(DlrmError)
    async def on_dlrm(request: Request, exc: DlrmError):
        log.error("serving error: %s", exc)
        return respond(request, 503, str(exc), headers=retry)
