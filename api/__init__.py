"""Online inference: a FastAPI app that scores requests with a model published to a serving store.

Layout (as vLLM and FastAPI's own examples): ``router.py`` (V1 and the server's own routes, HTTP
only), ``schemas.py`` (V1 pydantic bodies), ``v2/`` (the Open Inference Protocol: router,
protocol, tensors, the binary extension), ``service.py`` (``predict`` for each input kind, held
on ``app.state``), ``versions.py`` (the current and pinned versions, loading, live refresh),
``featurize.py`` (requests -> model inputs, through ``dlrm_core``'s featuriser), ``lookup.py``
(rows through the cache and the store), ``model.py`` (one loaded version), ``errors.py`` (errors
and their HTTP mapping, per protocol), ``auth.py`` (bearer keys), ``middleware.py`` (request
ids, latency, access log, JSON 500, limits), ``openapi.py`` (the document of the served model),
``app.py`` (lifespan and composition), ``settings.py`` (pydantic-settings, ``DLRM_*``),
``cache.py`` (hot rows), ``metrics.py`` (Prometheus, every worker).

It reads stores from ``embedding_server`` and takes only the network definition
(``dense_trainer.model``) from the trainer side; importing it loads no training kernel.
"""
