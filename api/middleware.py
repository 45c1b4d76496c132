"""Pure-ASGI middleware (no per-request task or body copy, unlike ``@app.middleware``).

``RequestContext`` is the outermost layer: the request id (``X-Request-ID``, accepted when sane,
else generated; echoed on the response and on every log line of the request), the latency
histogram by route template and status, the optional access log, and the last resort for
unhandled errors (a JSON 500 carrying the request id; the traceback is logged under it).
``BodyLimit`` rejects oversized bodies before they are read.

Per-request work is kept small (it is paid by every request, a few microseconds each): a generated
id is a per-process random prefix and a counter (unique, not secret: nothing relies on ids being
unguessable), the latency histogram's child of each (route, method, status) is looked up once, and
the access log's fields are built only when its logger would write the line.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import time
import uuid

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from api.errors import error_body
from dlrm_core.logs import REQUEST_ID

log = logging.getLogger(__name__)
access = logging.getLogger("api.access")

REQUEST_ID_HEADER = b"x-request-id"
SANE_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")
"""An accepted client request id: at most 128 safe characters (never a log-injection vector)."""
MAX_CHILDREN = 1024
"""Latency-histogram children cached per app (the method label is the client's: bounded anyway)."""


class RequestIds:
    """Generated request ids: 32 hex characters, a random 64-bit prefix drawn per process (again
    in a forked child) and a 64-bit counter: unique across workers and restarts, as uuid4 hex ids
    were, at a sixth of their cost."""

    def __init__(self) -> None:
        self.reseed()

    def reseed(self) -> None:
        self.prefix = uuid.uuid4().hex[:16]
        self.counter = itertools.count()

    def next(self) -> str:
        return f"{self.prefix}{next(self.counter):016x}"


_ids = RequestIds()
os.register_at_fork(after_in_child=_ids.reseed)


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
            body = error_body(scope["path"], f"body of {int(length)} bytes, at most {self.limit}", "body")
            return await JSONResponse(body, status_code=413)(scope, receive, send)
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


def route_template(scope, patterns: list[tuple[re.Pattern, str]]) -> str:
    """The matched route's path template (``/v1/models/{name}:predict``): a bounded label.
    Requests answered before routing (401, 413) are matched against ``patterns``; unknown paths
    are ``unmatched``, never the raw path."""
    route = scope.get("route")
    if route is not None:
        return getattr(route, "path", "unmatched")
    path = scope.get("path", "")
    for regex, template in patterns:
        if regex.match(path):
            return template
    return "unmatched"


class RequestContext:
    """Request id, latency histogram, access log and the JSON 500 of last resort.

    Args:
        access_log: log one line per request (method, route, path, status, ms, request id).
        templates: every route's path template (to label requests answered before routing).
    """

    def __init__(self, app, access_log: bool = False, templates: list[str] | None = None) -> None:
        self.app = app
        self.access_log = access_log
        self.patterns = [(compile_path(t)[0], t) for t in dict.fromkeys(templates or [])]
        self._histogram = None
        self._children: dict[tuple[str, str, int], object] = {}
        """(route, method, status) -> the child of ``_histogram`` (the service's latency metric)."""

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        rid = _request_id(scope.get("headers", []))
        token = REQUEST_ID.set(rid)
        status = 0

        async def with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (REQUEST_ID_HEADER, rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, with_id)
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), _printable(scope.get("path", "")))
            if status == 0:  # nothing sent yet: answer properly
                status = 500
                body = error_body(scope["path"], "internal server error", request_id=rid)
                await JSONResponse(body, status_code=500, headers={"X-Request-ID": rid})(scope, receive, send)
        finally:
            self._observe(scope, status or 500, time.perf_counter() - t0)
            REQUEST_ID.reset(token)

    def _observe(self, scope, status: int, seconds: float) -> None:
        app = scope.get("app")
        service = getattr(app.state, "service", None) if app is not None else None
        route = route_template(scope, self.patterns)
        if service is not None:
            self._latency(service.metrics.latency, route, scope.get("method", ""), status).observe(seconds)
        if self.access_log and access.isEnabledFor(logging.INFO):
            path = _printable(scope.get("path", ""))
            # The record made here, not by access.info: no walk of the stack for the caller's
            # file and line, which no access line prints (a line a request: every µs counts).
            access.handle(access.makeRecord(
                access.name, logging.INFO, __file__, 0, "%s %s %d %.2fms",
                (scope.get("method"), path, status, seconds * 1e3), None, func="_observe",
                extra={"fields": {"method": scope.get("method"), "route": route, "path": path,
                                  "status": status, "ms": round(seconds * 1e3, 3)}}))


    def _latency(self, histogram, route: str, method: str, status: int):
        """The child of ``histogram`` labelled (route, method, status), looked up once."""
        if histogram is not self._histogram or len(self._children) >= MAX_CHILDREN:
            self._histogram, self._children = histogram, {}
        key = (route, method, status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = histogram.labels(route=route, method=method, status=str(status))
        return child


def _printable(path: str) -> str:
    """A (percent-decoded) path as one safe line: control and non-ASCII characters escaped, so
    that ``/x%0Aforged`` cannot forge a log line."""
    return path.encode("unicode_escape").decode("ascii")[:512]


def _request_id(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == REQUEST_ID_HEADER:
            text = value.decode("latin-1")
            if SANE_ID.match(text):
                return text
            break
    return _ids.next()
