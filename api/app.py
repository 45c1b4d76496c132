"""The FastAPI application: lifespan (store opened and closed), error mapping, size limits.

Every error a client can cause is a 4xx JSON body ``{"error": ..., "field": ...}`` naming the
field; an unavailable store is a 503 with Retry-After; nothing from a request is ever evaluated.
"""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.metrics import ServingMetrics
from api.router import ModelNotFound, Unauthorized, router
from api.service import InputError, ModelService, NotReady
from api.settings import Settings, get_settings
from embedding_server.errors import DlrmError
from embedding_server.stores import ServingStore, StoreUnavailable, open_store

log = logging.getLogger(__name__)


def _error(status: int, message: str, field: str | None = None, detail=None, headers=None) -> JSONResponse:
    body = {"error": message, "field": field}
    if detail is not None:
        body["detail"] = detail
    return JSONResponse(body, status_code=status, headers=headers)


def _loc(loc) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    # Drop the union tags pydantic adds ("positional", "named", "constrained-str", ...).
    return ".".join(p for p in parts if not p.startswith(("positional", "named", "constrained", "list[", "int", "str")))


class BodyLimit:
    """Reject bodies larger than ``limit`` bytes with 413, before they are read into memory."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await _error(413, f"body of {int(length)} bytes, at most {self.limit}", "body")(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # FastAPI passes HTTP errors raised while reading the body
                    raise StarletteHTTPException(413, f"body larger than {self.limit} bytes")
            return message

        await self.app(scope, limited_receive, send)


class Observe:
    """Request latency by route and status into the Prometheus histogram (pure ASGI: no
    per-request task or body copy, unlike ``@app.middleware``)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 500

        async def capture(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, capture)
        finally:
            app = scope.get("app")
            service = getattr(app.state, "service", None) if app is not None else None
            if service is not None:
                route = scope.get("route")
                service.metrics.latency.labels(endpoint=getattr(route, "path", "unmatched"), status=str(status)).observe(
                    time.perf_counter() - t0
                )


def create_app(
    settings: Settings | None = None,
    store: ServingStore | None = None,
    service_factory: type[ModelService] = ModelService,
) -> FastAPI:
    """Build the app.

    Args:
        settings: default from the environment (``DLRM_*``).
        store: an open store (tests inject one); default opened from ``settings.store``.
        service_factory: the serving logic (benchmarks inject a baseline).
    """
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        torch.set_num_threads(settings.threads)
        own_store = store is None
        the_store = open_store(settings.store, timeout_s=settings.store_timeout_s) if own_store else store
        service = service_factory(the_store, settings, ServingMetrics())
        app.state.service = service
        try:
            service.refresh()
        except Exception as exc:  # serve (not ready) until the store answers
            log.warning("no model at start-up (%s); /readyz stays 503 until one is published", exc)
        service.start()
        try:
            yield
        finally:
            service.stop()
            if own_store:
                the_store.close()

    app = FastAPI(
        title="DLRM serving API",
        version="1",
        summary="Scores recommendation examples with a published DLRM.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.api_key = settings.resolved_api_key()
    app.include_router(router)

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
        return _error(422, f"{field}: {first.get('msg')}", field, detail)

    @app.exception_handler(InputError)
    async def on_input(request: Request, exc: InputError):
        return _error(422, str(exc), exc.field)

    @app.exception_handler(ModelNotFound)
    async def on_not_found(request: Request, exc: ModelNotFound):
        return _error(404, str(exc), "name")

    @app.exception_handler(Unauthorized)
    async def on_unauthorized(request: Request, exc: Unauthorized):
        return _error(401, str(exc), "Authorization", headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(NotReady)
    async def on_not_ready(request: Request, exc: NotReady):
        return _error(503, str(exc), headers={"Retry-After": str(settings.retry_after_s)})

    @app.exception_handler(StoreUnavailable)
    async def on_store(request: Request, exc: StoreUnavailable):
        service = getattr(request.app.state, "service", None)
        if service is not None:
            service.metrics.store_errors.labels(operation="lookup").inc()
        return _error(503, "embedding store unavailable, retry later", headers={"Retry-After": str(settings.retry_after_s)})

    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException):
        field = "body" if exc.status_code == 413 else None
        return _error(exc.status_code, str(exc.detail), field, headers=getattr(exc, "headers", None))

    @app.exception_handler(DlrmError)
    async def on_dlrm(request: Request, exc: DlrmError):
        log.error("serving error: %s", exc)
        return _error(503, str(exc), headers={"Retry-After": str(settings.retry_after_s)})

    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(Observe)
    return app
