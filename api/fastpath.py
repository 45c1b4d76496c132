"""The scoring routes' lean path: a pure-ASGI layer in front of FastAPI's router.

Every scoring endpoint does the same three things: read the raw body, call a synchronous handler
off the event loop (decode, validate, featurise, score, render: ``api/router.py``,
``api/v2/router.py``), send its ``Response``. Through FastAPI, a single-instance request also
pays the router's and the route's machinery (exception and exit-stack middleware, route
matching through the included routers, dependency solving, anyio's thread hop): about as much
CPU as scoring the instance. This layer, inside the request-context, key and body-limit
middleware (so ids, latency metrics, access log, authentication and the body cap apply as
before), answers POSTs to the scoring routes itself with the same handler functions:

    - routing: the app's POST routes in order, the first whose template matches wins (Starlette's
      rule); a path no scoring route owns goes on to FastAPI, which answers it as before (405s,
      404s, every other route);
    - errors: the exception handlers registered on the app (``api/errors.py``), looked up the way
      Starlette does (HTTP status first, then the exception's classes in MRO order); an exception
      with no handler propagates to ``RequestContext`` (the JSON 500);
    - the work: in a thread of one pool per process (``concurrent.futures``, ``THREADS`` threads as
      anyio's default limit; context variables such as the request id carried over), except for a
      provably small one: a body of at most ``inline_max_bytes`` (a few single instances' worth),
      arriving while no other scoring request is in flight, on a local store (memory-mapped
      files; never a network round trip), or on a remote store when every row it reads is in the
      row cache (checked before scoring starts; one that would need a round trip is handed to
      the pool from its body: ``api/inline.py``), is scored on the event loop itself. Its work is
      bounded
      by its size (a fraction of a millisecond), it saves the thread hop and, on a shared machine,
      the cold caches of waking a second thread (measured: most of a lone request's CPU). A small
      body arriving while other requests are in flight, with dynamic batching on, takes its
      route's :class:`Staged` split: decoded and featurised on the loop (bounded by its size,
      as above), its model call queued for the batcher thread and awaited (so it is coalesced
      with the others, and a remote store's round trip happens there, never on the loop), its
      answer rendered on the loop: no pool thread per request (with 64 clients: fewer GIL
      hand-offs, larger batches). Larger bodies go to the pool;
    - the latency label: ``scope["route"]`` is set to the route, so ``route_template`` gives the
      same template.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from starlette._utils import get_route_path  # the path routes match (Starlette's own rule)
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import compile_path

from api import inline
from api.batching import BatcherStopped
from api.slots import CpuSlots
from dlrm_core.threads import LazyPool

Handler = Callable[[object, dict[str, str], bytes, Headers], Response]
"""``(service, path parameters, body, headers) -> Response``, run off the event loop."""
THREADS = 40
"""Threads scoring requests at once (anyio's default limit, which ``run_in_threadpool`` applies)."""
_pool = LazyPool(THREADS, "score")
ADMITTED_PER_SLOT = 4
"""Requests in pool threads per CPU slot: enough waiting on the batcher for it to coalesce them,
few enough that completions and wake-ups do not crowd the event loop."""


def pool() -> ThreadPoolExecutor:
    """The process's scoring threads (started as needed, shared by every app of the process)."""
    return _pool.get()


@dataclass(frozen=True)
class Staged:
    """A scoring route split around its model call, for small requests that arrive while others
    are in flight: ``prepare`` (decode, validate, featurise; bounded by the body's size) and
    ``render`` run on the event loop, the model call on the batcher thread, coalesced with the
    requests queued beside it (no pool thread per request)."""

    prepare: Callable[[object, dict[str, str], bytes, Headers], object]
    """``(service, path parameters, body, headers) -> Pending`` (``api/service.py``)."""
    render: Callable[[object, object], Response]
    """``(Pending, Scored) -> Response``."""


@dataclass(frozen=True)
class FastRoute:
    """One POST route of the app, in routing order."""

    path: str
    """Its path template (the latency histogram's label, read as ``scope["route"].path``)."""
    regex: re.Pattern
    """Starlette's compiled pattern of the template."""
    handler: Handler | None
    """The scoring handler, or None: a POST route that FastAPI answers."""
    staged: Staged | None = None
    """The same route split around its model call (None: always the handler)."""


class FastScoring:
    """Answers POSTs to the scoring routes (``handlers``: template -> handler) without FastAPI.

    Args:
        routes: (template, method) of every route of the app, in routing order
            (``openapi.route_table``); only the POST ones are matched.
        handlers: template -> handler of the scoring routes.
    """

    def __init__(
        self,
        app,
        routes: list[tuple[str, str]],
        handlers: dict[str, Handler],
        inline_max_bytes: int = 0,
        staged: dict[str, Staged] | None = None,
        slots: CpuSlots | None = None,
    ) -> None:
        self.app = app
        self.inline_max_bytes = inline_max_bytes
        self.slots = slots or CpuSlots(THREADS)
        self._admitted: asyncio.Semaphore | None = None
        """Requests in pool threads at once (``ADMITTED_PER_SLOT`` per CPU slot; made on the
        loop)."""
        """Pool threads doing CPU work at once (a wait for the batcher gives the slot back)."""
        self.in_flight = 0
        """Scoring requests between their arrival and their answer (this process's loop)."""
        posts = [t for t, method in routes if method == "POST"]
        staged = staged or {}
        missing = (set(handlers) | set(staged)) - set(posts)
        if missing or set(staged) - set(handlers):
            raise ValueError(
                f"fast-path handlers without a POST route or staged without a handler: "
                f"{sorted(missing | (set(staged) - set(handlers)))}"
            )
        self.routes = [
            FastRoute(t, compile_path(t)[0], handlers.get(t), staged.get(t))
            for t in dict.fromkeys(posts)
        ]

    def match(self, scope) -> tuple[FastRoute, dict[str, str]] | None:
        path = get_route_path(scope)
        for route in self.routes:
            m = route.regex.match(path)
            if m is not None:
                return (route, m.groupdict()) if route.handler is not None else None
        return None

    async def __call__(self, scope, receive, send):
        found = self.match(scope) if scope["type"] == "http" and scope["method"] == "POST" else None
        if found is None:
            return await self.app(scope, receive, send)
        route, params = found
        scope["route"] = route
        scope["path_params"] = params
        request = Request(scope, receive)
        self.in_flight += 1
        try:
            body = await request.body()
            service = scope["app"].state.service
            response = await self._on_loop(route, service, params, body, request.headers)
            if response is None:
                response = await self._in_pool(route, service, params, body, request.headers)
        except Exception as exc:
            handler = exception_handler(scope["app"], exc)
            if handler is None:
                raise
            if inspect.iscoroutinefunction(handler):
                response = await handler(request, exc)
            else:
                response = await asyncio.get_running_loop().run_in_executor(
                    pool(), handler, request, exc
                )
        finally:
            self.in_flight -= 1
        await response(scope, receive, send)

    async def _in_pool(
        self, route: FastRoute, service, params: dict[str, str], body: bytes, headers: Headers
    ) -> Response:
        """The handler's response from a pool thread holding one of ``pool_concurrency`` CPU
        slots (``api/slots.py``): fewer threads contending for the GIL, so the loop (probes, new
        connections, small requests) gets it within a switch interval or two."""
        ctx = contextvars.copy_context()  # the request id, for the handler's log lines
        if self._admitted is None:
            self._admitted = asyncio.Semaphore(ADMITTED_PER_SLOT * self.slots.n)
        # the others wait here, holding no thread and no memory of a batch
        async with self._admitted:
            return await asyncio.get_running_loop().run_in_executor(
                pool(), ctx.run, self._held, route.handler, service, params, body, headers
            )

    def _held(self, handler: Handler, *args) -> Response:
        with self.slots.held():
            return handler(*args)

    async def _on_loop(
        self, route: FastRoute, service, params: dict[str, str], body: bytes, headers: Headers
    ) -> Response | None:
        """The response of a small request answered here on the event loop (alone: scored here;
        beside others: prepared here, scored by the batcher thread), or None: the pool's."""
        if len(body) > self.inline_max_bytes:
            return None
        if params.get("version") is not None and not service.versions.holds(params["version"]):
            return None  # a pinned version loaded on first use reads the store
        if await self._alone(service):
            return on_loop(route.handler, service, params, body, headers)
        if route.staged is None or not service.batcher.running:
            return None
        pending = staged_on_loop(route.staged, service, params, body, headers)
        if pending is None:
            return None
        try:
            return route.staged.render(pending, await service.finish_queued(pending))
        except BatcherStopped:  # shutting down since the check
            return None

    async def _alone(self, service) -> bool:
        """Whether a small request is scored on the loop: a local store or a row cache, the only
        one in flight once the requests that arrived with it have started (a small body is read
        without
        yielding: without one pass of the loop, requests arriving together would each find
        themselves alone and run one after another on the loop, never batched)."""
        if self.in_flight != 1:
            return False
        if service.store.remote and (service.model is None or service.model.cache is None):
            return False  # no row cache: every request reads the store
        await asyncio.sleep(0)
        return self.in_flight == 1


def on_loop(
    handler: Handler, service, params: dict[str, str], body: bytes, headers: Headers
) -> Response | None:
    """The handler's response, run here on the event loop; None when a remote store's request
    would need a round trip (``api/inline.py``): the caller runs it again in the pool."""
    if not service.store.remote:
        return handler(service, params, body, headers)
    try:
        with inline.remote_on_loop():
            return handler(service, params, body, headers)
    except inline.Offload:
        return None


def staged_on_loop(staged: Staged, service, params: dict[str, str], body: bytes, headers: Headers):
    """The request prepared here on the event loop (``staged.prepare``) -> its ``Pending``; None
    when preparing it would read the store (a pinned version not loaded yet, whatever the
    store): the caller hands it to the pool from its body."""
    try:
        with inline.remote_on_loop():  # any store read raises Offload here
            return staged.prepare(service, params, body, headers)
    except inline.Offload:
        return None


def exception_handler(app, exc: Exception):
    """The app's handler of ``exc`` (Starlette's lookup: status code, then MRO), or None. The
    handler of 500 / ``Exception`` is the server-error middleware's, outside this layer: skipped."""
    handlers = {k: v for k, v in app.exception_handlers.items() if k not in (500, Exception)}
    if isinstance(exc, HTTPException) and exc.status_code in handlers:
        return handlers[exc.status_code]
    for cls in type(exc).__mro__:
        if cls in handlers:
            return handlers[cls]
    return None
