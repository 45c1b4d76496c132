"""A scoring route, declared once: how a request is prepared (decoded, validated, featurised) and
how its scores are rendered. Everything else is derived from that declaration:

    - the FastAPI endpoints, for the current version (``{base}{verb}``) and a pinned one
      (``{base}/versions/{version}{verb}``), with their OpenAPI summary, body and response model;
    - the fast path's handler (``api/fastpath.py``): prepare, score, render, in one thread;
    - its staged split (``fastpath.Staged``): prepare and render on the event loop, the model call
      on the batcher thread.

So the V1 routes (``api/router.py``) and the Open Inference Protocol's (``api/v2/router.py``) are
each one :class:`ScoringRoute`, and adding a route is adding one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool
from starlette.datastructures import Headers

from api.fastpath import Handler, Staged
from api.service import ModelService, Pending, Scored


def get_service(request: Request) -> ModelService:
    return request.app.state.service


ServiceDep = Annotated[ModelService, Depends(get_service)]

Prepare = Callable[[ModelService, str, "str | None", bytes, Headers], Pending]
"""``(service, model name, version or None, body, headers) -> Pending``: everything but the model
call (raises the request's 4xx errors)."""
Render = Callable[[Pending, Scored], Response]
"""``(Pending, Scored) -> Response``."""


@dataclass(frozen=True)
class ScoringRoute:
    """One scoring route of a protocol, for the current version and a pinned one."""

    base: str
    """The model's path, e.g. ``/v1/models/{name}`` (the protocol's router prefix included)."""
    verb: str
    """What follows it, e.g. ``:predict`` or ``/infer``."""
    name: str
    """The endpoint's name (``{name}_version`` for the pinned one): the OpenAPI operation ids."""
    prepare: Prepare
    render: Render
    summary: str
    """The OpenAPI summary of the current-version endpoint."""
    pinned_summary: str
    """... and of the pinned-version one."""
    body: dict[str, Any]
    """``openapi_extra`` declaring the request body (read raw, so FastAPI does not see it)."""
    response_model: type

    @property
    def paths(self) -> tuple[str, str]:
        """(current, pinned) path templates."""
        return f"{self.base}{self.verb}", f"{self.base}/versions/{{version}}{self.verb}"

    def handle(
        self, service: ModelService, params: dict[str, str], body: bytes, headers: Headers
    ) -> Response:
        """The whole request in this thread (off the event loop): prepared, scored (coalesced by
        the batcher with concurrent ones), rendered."""
        with service.batcher.coming():
            pending = self.prepare(service, params["name"], params.get("version"), body, headers)
            return self.render(pending, service.finish(pending))

    def staged(self) -> Staged:
        """The route split around its model call (``fastpath.Staged``)."""

        def prepare(service, params: dict[str, str], body: bytes, headers: Headers) -> Pending:
            return self.prepare(service, params["name"], params.get("version"), body, headers)

        return Staged(prepare, self.render)

    def register(self, router: APIRouter) -> None:
        """Add the two endpoints to ``router`` (whose prefix ``base`` starts with)."""
        if not self.base.startswith(router.prefix):
            raise ValueError(f"{self.base} is not under the router's prefix {router.prefix}")
        current, pinned = (p[len(router.prefix) :] for p in self.paths)

        async def endpoint(name: str, request: Request, service: ServiceDep) -> Response:
            body = await request.body()  # decoded, validated and scored off the event loop
            params = {"name": name}
            return await run_in_threadpool(self.handle, service, params, body, request.headers)

        async def pinned_endpoint(
            name: str, version: str, request: Request, service: ServiceDep
        ) -> Response:
            body = await request.body()
            params = {"name": name, "version": version}
            return await run_in_threadpool(self.handle, service, params, body, request.headers)

        for path, call, name, summary in (
            (current, endpoint, self.name, self.summary),
            (pinned, pinned_endpoint, f"{self.name}_version", self.pinned_summary),
        ):
            router.add_api_route(
                path,
                call,
                methods=["POST"],
                name=name,
                summary=summary,
                response_model=self.response_model,
                openapi_extra=self.body,
            )


def fast_handlers(routes: Sequence[ScoringRoute]) -> dict[str, Handler]:
    """Path template -> the fast path's handler, for both endpoints of every route."""
    return {path: r.handle for r in routes for path in r.paths}


def staged_handlers(routes: Sequence[ScoringRoute]) -> dict[str, Staged]:
    """Path template -> the staged split, for both endpoints of every route."""
    return {path: r.staged() for r in routes for path in r.paths}
