"""Pure-ASGI middleware (no per-request task or body copy, unlike ``@app.middleware``).

``RequestContext`` is the outermost layer: the request id (``X-Request-ID``, accepted when sane,
else generated; echoed on the response and on every log line of the request), the latency
histogram by route template and status, the optional access log, and the last resort for
unhandled errors (a JSON 500 carrying the request id; the traceback is logged under it).
``BodyLimit`` rejects oversized bodies before they are read; ``ContentEncoding`` decodes gzip
and deflate bodies (``Content-Encoding``, as Triton's client sends when asked), within the same
limit on the decoded size.

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
import zlib

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


class _BodyMiddleware:
    """An ASGI middleware on HTTP requests' bodies, bounded by ``limit`` bytes (``http``: what it
    does; other scopes pass through)."""

    def __init__(self, app, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        return await self.http(scope, receive, send)

    async def http(self, scope, receive, send):
        raise NotImplementedError


class BodyLimit(_BodyMiddleware):
    """Reject bodies larger than ``limit`` bytes with 413, before they are read into memory."""

    async def http(self, scope, receive, send):
        length = dict(scope.get("headers", [])).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            body = error_body(
                scope["path"], f"body of {int(length)} bytes, at most {self.limit}", "body"
            )
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


DECODERS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
"""Content codings taken, as zlib's ``wbits`` (gzip header; zlib header)."""


class ContentEncoding(_BodyMiddleware):
    """Request bodies sent with ``Content-Encoding: gzip`` or ``deflate`` decoded before anything
    reads them, their decoded size bounded by ``limit`` (413 beyond it: a small bomb cannot
    inflate into memory); other codings are a 415 naming the header, a corrupt body a 400."""

    async def http(self, scope, receive, send):
        coding = next((v for k, v in scope.get("headers", []) if k == b"content-encoding"), None)
        if coding is None:
            return await self.app(scope, receive, send)
        codings = [c.strip().lower() for c in coding.decode("latin-1").split(",") if c.strip()]
        codings = [c for c in codings if c != "identity"]
        unknown = [c for c in codings if c not in DECODERS]
        if unknown or len(codings) > 2:
            message = (
                f"Content-Encoding {clipped_header(coding)} is not taken: gzip, deflate or identity"
            )
            return await JSONResponse(
                error_body(scope["path"], message, "Content-Encoding"), status_code=415
            )(scope, receive, send)
        try:
            body = await _read_all(receive)
        except StarletteHTTPException as exc:  # BodyLimit's, raised while reading
            return await JSONResponse(
                error_body(scope["path"], str(exc.detail), "body"), status_code=exc.status_code
            )(scope, receive, send)
        try:
            for c in reversed(codings):
                body = _inflate(body, DECODERS[c], self.limit)
        except _Oversized:
            message = f"body larger than {self.limit} bytes once decoded"
            return await JSONResponse(error_body(scope["path"], message, "body"), status_code=413)(
                scope, receive, send
            )
        except zlib.error:
            message = f"body: not valid {'/'.join(codings)} data (Content-Encoding)"
            return await JSONResponse(error_body(scope["path"], message, "body"), status_code=400)(
                scope, receive, send
            )
        headers = [
            (k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")
        ]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        sent = False

        async def decoded():
            nonlocal sent
            if sent:
                return await receive()  # after the body: the client's disconnect
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, decoded, send)


class _Oversized(Exception):
    pass


async def _read_all(receive) -> bytes:
    """The whole (still encoded) body; ``BodyLimit``, outside, bounds its size."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _inflate(data: bytes, wbits: int, limit: int) -> bytes:
    inflater = zlib.decompressobj(wbits)
    out = inflater.decompress(data, limit + 1)
    if len(out) > limit or inflater.unconsumed_tail:
        raise _Oversized
    out += inflater.flush()
    if len(out) > limit:
        raise _Oversized
    if not inflater.eof:
        raise zlib.error("truncated")
    return out


def clipped_header(value: bytes) -> str:
    """A header's value for an error message: printable, at most 64 characters."""
    text = value.decode("latin-1").encode("unicode_escape").decode("ascii")
    return repr(text[:64] + ("..." if len(text) > 64 else ""))


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
                message["headers"] = [
                    *message.get("headers", []),
                    (REQUEST_ID_HEADER, rid.encode()),
                ]
            await send(message)

        try:
            await self.app(scope, receive, with_id)
        except Exception:
            log.exception(
                "unhandled error in %s %s", scope.get("method"), _printable(scope.get("path", ""))
            )
            if status == 0:  # nothing sent yet: answer properly
                status = 500
                body = error_body(scope["path"], "internal server error", request_id=rid)
                await JSONResponse(body, status_code=500, headers={"X-Request-ID": rid})(
                    scope, receive, send
                )
        finally:
            self._observe(scope, status or 500, time.perf_counter() - t0)
            REQUEST_ID.reset(token)

    def _observe(self, scope, status: int, seconds: float) -> None:
        app = scope.get("app")
        service = getattr(app.state, "service", None) if app is not None else None
        route = route_template(scope, self.patterns)
        if service is not None:
            self._latency(service.metrics.latency, route, scope.get("method", ""), status).observe(
                seconds
            )
        if self.access_log and access.isEnabledFor(logging.INFO):
            path = _printable(scope.get("path", ""))
            # The record made here, not by access.info: no walk of the stack for the caller's
            # file and line, which no access line prints (a line a request: every µs counts).
            access.handle(
                access.makeRecord(
                    access.name,
                    logging.INFO,
                    __file__,
                    0,
                    "%s %s %d %.2fms",
                    (scope.get("method"), path, status, seconds * 1e3),
                    None,
                    func="_observe",
                    extra={
                        "fields": {
                            "method": scope.get("method"),
                            "route": route,
                            "path": path,
                            "status": status,
                            "ms": round(seconds * 1e3, 3),
                        }
                    },
                )
            )

    def _latency(self, histogram, route: str, method: str, status: int):
        """The child of ``histogram`` labelled (route, method, status), looked up once."""
        if histogram is not self._histogram or len(self._children) >= MAX_CHILDREN:
            self._histogram, self._children = histogram, {}
        key = (route, method, status)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = histogram.labels(
                route=route, method=method, status=str(status)
            )
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
