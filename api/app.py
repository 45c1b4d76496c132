"""The FastAPI application: routers (V1, the Open Inference Protocol, health and metrics), the
lifespan (store and service opened and closed), error mapping (``errors.py``), and the
middleware, outermost first: request context (id, latency, access log, JSON 500), bearer keys
(before anything is read), body size limit, gzip / deflate bodies decoded, the scoring routes'
lean path (``fastpath.py``); the documentation pages with local assets (``docs.py``)."""

from __future__ import annotations

import gc
import logging
import sys
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI

from api import docs, openapi, probes
from api.auth import RequireKey
from api.errors import register_error_handlers
from api.fastpath import FastScoring
from api.metrics import ServingMetrics
from api.middleware import BodyLimit, ContentEncoding, RequestContext
from api.router import SCORING as V1_SCORING
from api.router import router
from api.scoring import fast_handlers, staged_handlers
from api.service import ModelService
from api.settings import Settings, get_settings
from api.slots import CpuSlots
from api.v2.router import SCORING as V2_SCORING
from api.v2.router import router as v2_router
from embedding_server.stores import ServingStore, open_store

log = logging.getLogger(__name__)


def create_app(
    settings: Settings | None = None,
    store: ServingStore | None = None,
    service_factory: type[ModelService] = ModelService,
    metrics: ServingMetrics | None = None,
) -> FastAPI:
    """Build the app.

    Args:
        settings: default from the environment (``DLRM_*``).
        store: an open store (tests inject one); default opened from ``settings.store``.
        service_factory: the serving logic (benchmarks inject a baseline).
        metrics: default: a registry of its own, or every worker's in multiprocess mode.

    Raises:
        ConfigError: a key source yields no key or a short one, or a key file cannot be read.
    """
    settings = settings or get_settings()
    keys = settings.key_ring()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        torch.set_num_threads(settings.threads)
        sys.setswitchinterval(settings.gil_switch_interval_us / 1e6)
        # Everything imported so far (torch, pydantic's schemas, ...) lives as long as the process:
        # out of the collector's sight, a full collection scans only requests' objects (without
        # this, one scan of the ~300k objects holds the GIL for ~100 ms, stalling the event loop).
        gc.collect()
        gc.freeze()
        own_store = store is None
        the_store = (
            store
            if store is not None
            else open_store(
                settings.store,
                timeout_s=settings.store_timeout_s,
                password_file=settings.store_password_file,
            )
        )
        service = service_factory(the_store, settings, metrics or ServingMetrics())
        app.state.service = service
        # one budget of CPU threads: the batcher's and the pool's
        service.batcher.slots = app.state.slots
        app.state.probes = probes.Probes(service)
        probes.install(app.state.probes)  # answered by dlrm serve's HTTP protocol, ahead of scoring
        try:
            service.refresh()
        except Exception as exc:  # serve (not ready) until the store answers
            log.warning("no model at start-up (%s); /readyz stays 503 until one is published", exc)
        service.start()
        try:
            yield
        finally:
            probes.install(None)
            service.stop()
            if own_store:
                the_store.close()

    app = FastAPI(
        title="DLRM serving API",
        version="1",
        summary="Scores recommendation examples with a published DLRM (KServe V1 and the Open "
        "Inference Protocol).",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,  # ours: offline assets, a key field (api/docs.py)
    )
    app.state.settings = settings
    app.include_router(router)
    app.include_router(v2_router)
    register_error_handlers(app, settings.retry_after_s)
    openapi.install(app, settings.model_name, secured=keys.enabled)
    docs.install(app, secured=keys.enabled)
    app.state.routes = openapi.route_table(app)
    app.state.slots = CpuSlots(settings.pool_concurrency)
    if settings.fast_path:  # innermost: inside the body cap, the key check and the request context
        app.add_middleware(
            FastScoring,
            routes=app.state.routes,
            handlers=fast_handlers([*V1_SCORING, *V2_SCORING]),
            inline_max_bytes=settings.inline_max_bytes,
            staged=staged_handlers([*V1_SCORING, *V2_SCORING]),
            slots=app.state.slots,
        )
    app.add_middleware(ContentEncoding, limit=settings.max_body_bytes)  # inside the cap on the wire
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(RequireKey, keys=keys)
    app.add_middleware(
        RequestContext, access_log=settings.access_log, templates=[p for p, _ in app.state.routes]
    )
    return app
