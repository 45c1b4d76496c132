"""Online inference: a FastAPI app that scores requests with a model published to a serving store.

Layout (as vLLM and FastAPI's own examples): ``router.py`` (HTTP only), ``schemas.py``
(pydantic bodies), ``service.py`` (loading, live refresh, ``predict``, held on ``app.state``),
``featurize.py`` (requests -> model inputs, through ``dlrm_core``'s featuriser), ``lookup.py``
(rows through the cache and the store), ``model.py`` (one loaded version), ``errors.py`` (errors
and their HTTP mapping), ``middleware.py`` (limits, latency), ``openapi.py`` (the document of the
served model's features), ``app.py`` (lifespan and composition), ``settings.py``
(pydantic-settings, ``DLRM_*``), ``cache.py`` (hot rows), ``metrics.py`` (Prometheus).

It reads stores from ``embedding_server`` and takes only the network definition
(``dense_trainer.model``) from the trainer side; importing it loads no training kernel.
"""
