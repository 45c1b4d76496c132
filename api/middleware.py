"""Pure-ASGI middleware (no per-request task or body copy, unlike ``@app.middleware``)."""

from __future__ import annotations

import time

from starlette.exceptions import HTTPException as StarletteHTTPException

from api.errors import error_response


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
            return await error_response(413, f"body of {int(length)} bytes, at most {self.limit}", "body")(scope, receive, send)
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
