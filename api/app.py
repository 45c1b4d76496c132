"""The FastAPI application: routers, the lifespan (store and service opened and closed), error
mapping (``errors.py``) and size limits (``middleware.py``)."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI

from api import openapi
from api.errors import register_error_handlers
from api.metrics import ServingMetrics
from api.middleware import BodyLimit, Observe
from api.router import router
from api.service import ModelService
from api.settings import Settings, get_settings
from embedding_server.stores import ServingStore, open_store

log = logging.getLogger(__name__)


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
    register_error_handlers(app, settings.retry_after_s)
    openapi.install(app, settings.model_name)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(Observe)
    return app
