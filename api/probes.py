"""Liveness and readiness answers, computed once and served ahead of scoring.

Under load the probes must not queue behind scoring requests (a kubelet that waits seconds for
``/healthz`` restarts a healthy server). So the answers are kept ready here: liveness is a
constant, readiness (a model loaded in every worker: ``ServingMetrics.workers_ready``, which in
multiprocess mode reads every worker's metric files) is recomputed at most every
``READY_TTL_S``. ``dlrm serve``'s HTTP protocol (``api/http_protocol.py``) answers a plain
``GET`` of a probe path from its parser callback, before any ASGI task exists (no routing, no
middleware, no thread); the FastAPI routes (``api/router.py``, ``api/v2/router.py``) give the
very same answers elsewhere (tests, other servers). Probes answered by the protocol are not in
the access log or the latency histogram.
"""

from __future__ import annotations

import json
import threading
import time

READY_TTL_S = 0.25
"""How long a computed readiness answer is served before it is computed again."""
LIVE = {"/healthz": {"status": "ok"}, "/v2/health/live": {"live": True}}
READY = ("/readyz", "/v2/health/ready")
PATHS = frozenset([*LIVE, *READY])


class Probes:
    """The probe answers of one app's service (``service``: ``api.service.ModelService``)."""

    def __init__(self, service) -> None:
        self.service = service
        self._ready: tuple[float, int, dict, str | None] | None = None
        self._lock = threading.Lock()

    def readiness(self) -> tuple[int, dict, str | None]:
        """(status, V1 body, reason when not ready), at most ``READY_TTL_S`` old."""
        now = time.monotonic()
        cached = self._ready
        if cached is not None and now - cached[0] < READY_TTL_S:
            return cached[1:]
        with self._lock:
            model = self.service.model
            if model is None:
                answer = (503, {}, "no model loaded yet")
            else:
                ready, workers = self.service.metrics.workers_ready()
                if ready < workers:
                    answer = (503, {}, f"{ready} of {workers} workers have a model loaded")
                else:
                    answer = (
                        200,
                        {"status": "ready", "model_version": model.version, "workers": workers},
                        None,
                    )
            self._ready = (now, *answer)
        return answer

    def answer(self, path: str) -> tuple[int, bytes] | None:
        """(status, JSON body) of a probe path, None for any other path."""
        if path in LIVE:
            return 200, _json(LIVE[path])
        if path not in READY:
            return None
        status, body, reason = self.readiness()
        if path == "/v2/health/ready":
            body = {"ready": True} if status == 200 else {"error": reason}
        elif status != 200:
            body = {"error": reason, "field": None}
        return status, _json(body)


def _json(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()  # as FastAPI's JSONResponse writes it


_installed: Probes | None = None


def install(probes: Probes | None) -> None:
    """The answers this process's HTTP protocol serves (None: none; the app's lifespan sets it)."""
    global _installed
    _installed = probes


def installed() -> Probes | None:
    return _installed
