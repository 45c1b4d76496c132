"""Online inference: a FastAPI app that scores requests with a model published to a serving store.

Layout (as vLLM and FastAPI's own examples): ``router.py`` (HTTP only), ``schemas.py``
(pydantic bodies), ``service.py`` (the logic, held on ``app.state``), ``app.py`` (lifespan,
error mapping, limits), ``settings.py`` (pydantic-settings, ``DLRM_*``), ``cache.py`` (hot rows),
``metrics.py`` (Prometheus). It reads stores and features from ``embedding_server`` and takes
only the network definition (``dense_trainer.model``) from the trainer side.
"""
